"""The loops over chunks that every op's sweeps share, and their helpers.

A sweep handles chunk ``n`` of every row and head at once: it reads the chunk heads first
(``[R, H, C, .]`` from ``[R, P, H, .]``), computes in the compute dtype, and writes its results
back into full-size buffers in place, so that every temporary stays the size of one chunk.
``forward_sweep`` and ``reverse_sweep`` carry a state (or its gradient) from chunk to chunk and
restart it at sequence boundaries; an op supplies the step for one chunk. States per sequence
(initial, final) are ``[R, sequences_per_row, H, K, V]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tops_plugins_xla.chunk_layout import ChunkLayout

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


def forward_sweep(layout: ChunkLayout, initial_state: Array | None, zero_state: Array, step, outputs, *,
                  record_states: bool):
    """Walk the chunks in order, carrying the state of every row's current sequence.

    ``step(n, state, outputs) -> (state, outputs)`` handles chunk ``n`` of every row: it gets the
    state before the chunk and returns the state after it, with ``outputs`` (any pytree of
    buffers) written in place. At each sequence's first chunk the state is its row of
    ``initial_state`` (``[R, sequences_per_row, H, K, V]``; zeros when None); with one sequence
    per row it is never reset. ``zero_state`` (``[R, H, K, V]``) gives shape and dtype.

    Returns ``(outputs, finals, states)``: the state after each sequence's last chunk
    (``[R, sequences_per_row, H, K, V]``) and, when ``record_states``, the state before each
    chunk (``[num_chunks, R, H, K, V]``, else None).
    """
    reset = not layout.one_sequence_per_row
    state = zero_state if reset else sequence_state(initial_state, zero_state, 0)
    finals = jnp.zeros((zero_state.shape[0], layout.sequences_per_row, *zero_state.shape[1:]), zero_state.dtype) if reset else None
    states = jnp.zeros((layout.num_chunks, *zero_state.shape), zero_state.dtype) if record_states else None

    def body(n, carry):
        state, finals, states, outputs = carry
        sequence = layout.chunk_sequence[n]
        if reset:
            state = jnp.where(layout.chunk_is_first[n], sequence_state(initial_state, state, sequence), state)
        if states is not None:
            states = lax.dynamic_update_index_in_dim(states, state, n, axis=0)
        state, outputs = step(n, state, outputs)
        if reset:
            finals = record_if(layout.chunk_is_last[n], finals, sequence, state)
        return state, finals, states, outputs

    state, finals, states, outputs = lax.fori_loop(0, layout.num_chunks, body, (state, finals, states, outputs))
    if not reset:
        finals = state[:, None]
    return outputs, finals, states


def reverse_sweep(layout: ChunkLayout, dht: Array | None, zero_state: Array, step, outputs):
    """Walk the chunks backwards, carrying the gradient of the state of every row's current sequence.

    ``step(n, dstate, outputs) -> (dstate, outputs)`` handles chunk ``n`` of every row: it gets
    the gradient of the state after the chunk and returns that of the state before it. At each
    sequence's last chunk the gradient starts from its row of ``dht`` (zeros when None).

    Returns ``(outputs, dh0)``: the gradient of each sequence's initial state
    (``[R, sequences_per_row, H, K, V]``).
    """
    reset = not layout.one_sequence_per_row
    dstate = zero_state if reset else sequence_state(dht, zero_state, 0)
    dh0 = jnp.zeros((zero_state.shape[0], layout.sequences_per_row, *zero_state.shape[1:]), zero_state.dtype) if reset else None

    def body(i, carry):
        dstate, dh0, outputs = carry
        n = layout.num_chunks - 1 - i
        sequence = layout.chunk_sequence[n]
        if reset:
            dstate = jnp.where(layout.chunk_is_last[n], sequence_state(dht, dstate, sequence), dstate)
        dstate, outputs = step(n, dstate, outputs)
        if reset:
            dh0 = record_if(layout.chunk_is_first[n], dh0, sequence, dstate)
        return dstate, dh0, outputs

    dstate, dh0, outputs = lax.fori_loop(0, layout.num_chunks, body, (dstate, dh0, outputs))
    if not reset:
        dh0 = dstate[:, None]
    return outputs, dh0
