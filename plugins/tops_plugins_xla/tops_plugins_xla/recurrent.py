"""The recurrence token by token (``xla.recurrent``): decode steps, where a chunk would be mostly padding.

A server's decode step runs one token per sequence (a few for speculative decoding) from states it
keeps. The chunked implementations pad ``T`` to a whole chunk and build the chunk's attention
products; a step needs neither: it decays the state, writes the token into it and reads the output
from it, all rows and heads at once. Each op supplies its step; ``scan`` walks the tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

PRIORITY = 300
"""Up to ``tops_core.DECODE_STEP_TOKENS`` tokens (``tops_core.decode_step_priority``): above every chunked kernel
(xla.chunk 100 off TPU, 50 on it; the Pallas kernels 180 to 200), below the Pallas decode kernel on TPU."""


def scan(step: Callable[[Array, tuple[Array, ...]], tuple[Array, Array]], state: Array, tokens: tuple[Array, ...]) -> tuple[Array, Array]:
    """``(final state, outputs [B, T, ...])`` of ``step(state, token) -> (state, output)`` over the time axis (1)
    of each of ``tokens``. One token is one step, with no loop around it."""
    if tokens[0].shape[1] == 1:
        state, output = step(state, tuple(x[:, 0] for x in tokens))
        return state, output[:, None]
    state, outputs = lax.scan(step, state, tuple(jnp.moveaxis(x, 1, 0) for x in tokens))
    return state, jnp.moveaxis(outputs, 0, 1)
