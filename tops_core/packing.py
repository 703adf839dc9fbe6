"""Packed sequences' token indices from ``cu_seqlens`` (``[N + 1]``, may be traced), for every implementation: index
math on the host side of a kernel, which any plugin may call (the kernels themselves stay in their plugins)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sequence_starts(cu_seqlens: jax.Array, num_tokens: int) -> jax.Array:
    """``[num_tokens]`` bool: True at the first token of every non-empty packed sequence."""
    # Empty sequences share their start with the next one; those at the end start at num_tokens.
    starts = jnp.zeros(num_tokens + 1, bool).at[cu_seqlens[:-1]].set(True)
    return starts[:num_tokens]


def sequence_of(cu_seqlens: jax.Array, tokens: jax.Array) -> jax.Array:
    """int32, ``tokens``' shape: the packed sequence holding each token, the last ``n`` with ``cu_seqlens[n] <= token``."""
    # side="right" skips the empty sequences that share a boundary with the token's own.
    return jnp.searchsorted(cu_seqlens.astype(jnp.int32), tokens, side="right").astype(jnp.int32) - 1
