"""Helpers of the loops over chunks that every op's sweeps share.

A sweep handles chunk ``n`` of every row and head at once: it reads the chunk heads first
(``[R, H, C, .]`` from ``[R, P, H, .]``), computes in the compute dtype, and writes its results
back into full-size buffers in place, so that every temporary stays the size of one chunk.
States per sequence (initial, final) are ``[R, sequences_per_row, H, K, V]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

# Full float32 products on GPU and TPU, whose default float32 matmul rounds to bfloat16 passes.
PRECISION = lax.Precision.HIGHEST


def einsum(spec, a, b):
    return jnp.einsum(spec, a, b, precision=PRECISION)


def heads_first(a: Array, n: Array, chunk_size: int, dtype) -> Array:
    """Chunk ``n`` of ``a`` (``[R, P, H, .]``), heads first: ``[R, H, C, .]``."""
    block = lax.dynamic_slice_in_dim(a, n * chunk_size, chunk_size, axis=1)
    return jnp.swapaxes(block, 1, 2).astype(dtype)


def put(buffer: Array, n: Array, value: Array, chunk_size: int) -> Array:
    """Write ``value`` (``[R, H, C, .]`` or ``[R, H, C]``) as chunk ``n`` of ``buffer`` (``[R, P, H, .]``)."""
    value = jnp.swapaxes(value, 1, 2).astype(buffer.dtype)
    return lax.dynamic_update_slice_in_dim(buffer, value, n * chunk_size, axis=1)


def sequence_state(states: Array | None, like: Array, sequence: Array) -> Array:
    """Row-wise ``states[:, sequence]`` (``[R, H, K, V]``), zeros when there are none."""
    if states is None:
        return jnp.zeros_like(like)
    return lax.dynamic_index_in_dim(states, sequence, axis=1, keepdims=False)


def record_if(condition: Array, records: Array, sequence: Array, value: Array) -> Array:
    """``records[:, sequence] = value`` when ``condition``, else ``records`` unchanged."""
    current = lax.dynamic_index_in_dim(records, sequence, axis=1, keepdims=False)
    return lax.dynamic_update_index_in_dim(records, jnp.where(condition, value, current), sequence, axis=1)


def flat_states(states: Array) -> Array:
    """``[R, sequences_per_row, H, K, V]`` -> ``[N, H, K, V]``."""
    return states.reshape(-1, *states.shape[2:])
