"""A kernel's fast path for the inputs that allow it, chosen from the data inside the kernel, and what the cost model assumes.

A kernel may hold two ways to compute the same thing: a general one, right for every input, and a
cheaper one, right only where a test on the data holds (gla's chunks that decay mildly: one dense pair
product instead of the halving's levels). ``choose`` picks one at run time with ``lax.cond``, so a
TPU runs only the arm the data ask for. Choices nest: a general side may hold another choice, its
own fast arm named apart (gla's sub-chunks that decay mildly where its whole chunks do not).

The cost model reads what a compiled kernel issues, and a conditional's two arms are both in that
program: counted together they would model a step that runs both. So the model compiles such a kernel
once per arm, each arm alone (``assume``): the general sides give its rows (what any input may cost),
each named fast arm the rows for inputs that take it. ``recording`` names the fast arms a traced
program holds.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax import lax

FAST, GENERAL = "fast path", "general"
"""The default fast arm's name, and the assumption under which every choice takes its general side."""

_assumed: contextvars.ContextVar[str | None] = contextvars.ContextVar("assumed_arm", default=None)
_chosen: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("chosen", default=None)


def choose(allowed: jax.Array, fast: Callable[[], Any], general: Callable[[], Any], arm: str = FAST) -> Any:
    """``fast()`` where the scalar ``allowed`` holds, else ``general()``: ``lax.cond``, or while the cost model traces
    under ``assume``, ``fast()`` alone if it assumes this choice's ``arm`` (the fast side's name, a row of the model's
    own) and ``general()`` alone otherwise.

    For code nothing differentiates: a forward walk, or a backward kernel's whole step with its ``jax.vjp`` calls inside
    each arm. So the arms may close over any traced value or ref. Differentiating through the choice instead would
    need what Mosaic cannot lower: a ``lax.cond``'s VJP carries the residuals of the arm not taken, and a ``custom_vjp``
    that takes the choice again in its backward closes over traced values (and linearises the chosen arm afresh, its
    work done twice).
    """
    if arm == GENERAL:
        raise ValueError(f"a fast arm cannot be named {GENERAL!r}, the general sides' assumption")
    names = _chosen.get()
    if names is not None:
        names.append(arm)
    assumed = _assumed.get()
    if assumed is None:
        return lax.cond(allowed, fast, general)
    return (fast if assumed == arm else general)()


@contextlib.contextmanager
def assume(arm: str) -> Iterator[None]:
    """Trace every ``choose`` alone: the fast side of those whose arm is ``arm``, the general side of the rest (all of
    them with ``GENERAL``). For the cost model, never for a call that runs."""
    if not isinstance(arm, str):
        raise TypeError(f"arm must be an arm's name or {GENERAL!r}, got {arm!r}")
    token = _assumed.set(arm)
    try:
        yield
    finally:
        _assumed.reset(token)


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """Collect the fast arm's name of every choice traced inside, in order: empty without a choice."""
    names: list[str] = []
    token = _chosen.set(names)
    try:
        yield names
    finally:
        _chosen.reset(token)
