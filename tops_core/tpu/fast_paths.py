"""A kernel's fast path for the inputs that allow it, chosen from the data inside the kernel, and what the cost model assumes.

A kernel may hold two ways to compute the same thing: a general one, right for every input, and a
cheaper one, right only where a test on the data holds (gla's chunks that decay mildly: one dense pair
product instead of the halving's levels). ``choose`` picks one at run time with ``lax.cond``, so a
TPU runs only the arm the data ask for.

The cost model reads what a compiled kernel issues, and a conditional's two arms are both in that
program: counted together they would model a step that runs both. So the model compiles such a kernel
once per arm, each arm alone (``assume``): the general arm gives its rows (what any input may cost),
the fast arm the rows for inputs that take it. ``recording`` says whether a traced program has a
choice at all.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax import lax

FAST, GENERAL = "fast", "general"

_assumed: contextvars.ContextVar[str | None] = contextvars.ContextVar("assumed_arm", default=None)
_chosen: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("chosen", default=None)


def choose(allowed: jax.Array, fast: Callable[[Any, Any], Any], general: Callable[[Any, Any], Any], operands: Any,
           constants: Any = ()) -> Any:
    """``fast(operands, constants)`` where the scalar ``allowed`` holds, else ``general(operands, constants)``: ``lax.cond``,
    or the assumed arm alone while the cost model traces under ``assume``.

    ``operands`` are what the result is differentiated by, ``constants`` what it is not (masks, integers); the arms
    close over no traced value (Mosaic lowers no closed-over value of a ``custom_vjp``). Differentiable inside a Pallas
    TPU kernel: ``jax.vjp`` of a ``lax.cond`` there would carry the residuals of the arm not taken, which Mosaic cannot
    lower either, so the backward takes the choice again, each arm linearised afresh.
    """
    marks = _chosen.get()
    if marks is not None:
        marks.append(True)
    assumed = _assumed.get()

    def select(allowed, fast_arm, general_arm, *arguments):
        if assumed is None:
            return lax.cond(allowed, fast_arm, general_arm, *arguments)
        return (fast_arm if assumed == FAST else general_arm)(*arguments)

    # The model's arm goes through the same custom_vjp as a run's, so its program has the run's structure; without the
    # cond around it the compiler may merge the arm's recomputation in the backward with its values (plugin README).
    @jax.custom_vjp
    def chosen(allowed, operands, constants):
        return select(allowed, fast, general, operands, constants)

    def chosen_forward(allowed, operands, constants):
        return chosen(allowed, operands, constants), (allowed, operands, constants)

    def chosen_backward(residuals, cotangents):
        allowed, operands, constants = residuals

        def pullback(arm):
            return lambda operands, constants: jax.vjp(lambda x: arm(x, constants), operands)[1](cotangents)[0]

        return None, select(allowed, pullback(fast), pullback(general), operands, constants), None

    chosen.defvjp(chosen_forward, chosen_backward)
    return chosen(allowed, operands, constants)


@contextlib.contextmanager
def assume(arm: str) -> Iterator[None]:
    """Trace every ``choose`` as its ``arm`` (``FAST`` or ``GENERAL``) alone: for the cost model, never for a call that runs."""
    if arm not in (FAST, GENERAL):
        raise ValueError(f"arm must be {FAST!r} or {GENERAL!r}, got {arm!r}")
    token = _assumed.set(arm)
    try:
        yield
    finally:
        _assumed.reset(token)


@contextlib.contextmanager
def recording() -> Iterator[list[bool]]:
    """Collect one entry per ``choose`` traced inside: a non-empty list says the program has a fast path."""
    marks: list[bool] = []
    token = _chosen.set(marks)
    try:
        yield marks
    finally:
        _chosen.reset(token)
