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


def choose(allowed: jax.Array, fast: Callable[[], Any], general: Callable[[], Any]) -> Any:
    """``fast()`` where the scalar ``allowed`` holds, else ``general()``: ``lax.cond``, or the assumed arm alone while the
    cost model traces under ``assume``.

    For code nothing differentiates: a forward walk, or a backward kernel's whole step with its ``jax.vjp`` calls inside
    each arm. So the arms may close over any traced value or ref. Differentiating through the choice instead would
    need what Mosaic cannot lower: a ``lax.cond``'s VJP carries the residuals of the arm not taken, and a ``custom_vjp``
    that takes the choice again in its backward closes over traced values (and linearises the chosen arm afresh, its
    work done twice).
    """
    marks = _chosen.get()
    if marks is not None:
        marks.append(True)
    assumed = _assumed.get()
    if assumed is None:
        return lax.cond(allowed, fast, general)
    return (fast if assumed == FAST else general)()


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
