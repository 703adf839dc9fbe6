"""gla, chunked, in plain jax.numpy: the forward and a hand-written backward.

Per sequence and head, tokens are cut into chunks of ``C``. Inside a chunk, with ``b`` the
cumulative log decay per token and key, ``S`` the state before the chunk, ``q`` times ``scale``,
and ``Aqk[i, j] = sum_d q[i, d] k[j, d] exp(b[i, d] - b[j, d])`` (``j <= i``) from
``intra.query_pairs`` (built along the halving, so no factor ever overflows)::

    o     = (exp(b) * q) S + Aqk v
    S_out = exp(b_C) * S + (exp(b_C - b) * k)^T v            (b_C: the chunk's last token)

The backward recomputes the state before every chunk (a forward sweep that stores
``[T/C, K, V]`` per row and head), then walks the chunks backwards carrying ``dS``, the
gradient of the state after the chunk::

    dv    = Aqk^T do + (exp(b_C - b) * k) dS
    dAqk  = tril(do v^T), into ``intra.pairs_backward``
    dS_in = exp(b_C) * dS + (exp(b) * q)^T do

plus the direct terms of ``exp(b) * q`` and ``exp(b_C - b) * k`` in ``dq`` and ``dk``. ``dg``
comes from the gradients of every decay's exponent, summed back along the halving that built them
(``intra.decays_backward``). Packed sequences run in ``packed_layout``: a chunk never holds two
sequences, and padded slots hold zeros (no decay, no write).

Both sweeps loop over chunks, all rows and heads of a chunk at once, and write their outputs in
place: every temporary stays the size of one chunk. Memory is O(T (K + V) + (T / C) K V).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tops_core import GLAGrads
from tops_core.ops.base import state_dtype
from tops_plugins_xla import intra
from tops_plugins_xla.chunk_layout import ChunkLayout, dense_layout, packed_layout
from tops_plugins_xla.sweep import einsum, flat_states, forward_sweep, heads_first, put, reverse_sweep

Array = jax.Array


def forward(q, k, v, g, *, scale, initial_state, output_final_state, cu_seqlens, config):
    """``(o, final_state)`` of gla (the ``Forward`` protocol of ``tops_core.ops.gla``)."""
    return _forward(q, k, v, g, initial_state, cu_seqlens, scale=scale, output_final_state=output_final_state,
                    chunk_size=config.chunk_size)


def backward(q, k, v, g, do, *, scale, initial_state, dht, cu_seqlens, config):
    """The VJP of gla (the ``Backward`` protocol of ``tops_core.ops.gla``)."""
    return _backward(q, k, v, g, do, initial_state, dht, cu_seqlens, scale=scale, chunk_size=config.chunk_size)


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "output_final_state"))
def _forward(q, k, v, g, initial_state, cu_seqlens, *, scale, output_final_state, chunk_size):
    x = _chunked(q, k, v, g, initial_state, cu_seqlens, scale, chunk_size)
    o, final, _ = _forward_sweep(x, output_dtype=v.dtype, record_states=False)
    return x.layout.unpack(o), flat_states(final) if output_final_state else None


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size"))
def _backward(q, k, v, g, do, initial_state, dht, cu_seqlens, *, scale, chunk_size):
    x = _chunked(q, k, v, g, initial_state, cu_seqlens, scale, chunk_size)
    layout = x.layout
    _, final, states = _forward_sweep(x, output_dtype=None, record_states=True)
    if dht is not None:
        dht = dht.astype(x.dtype).reshape(final.shape)
    dq, dk, dv, dg, dh0 = _reverse_sweep(x, layout.pack(do), dht, states)
    return GLAGrads(
        dq=layout.unpack(dq), dk=layout.unpack(dk), dv=layout.unpack(dv), dg=layout.unpack(dg),
        dinitial_state=None if initial_state is None else flat_states(dh0).astype(initial_state.dtype),
    )


@dataclasses.dataclass(frozen=True)
class _Chunked:
    """A call moved into its chunk layout: ``[R, P, H, .]`` (``R`` rows of ``P`` slots), inputs in their dtypes."""

    layout: ChunkLayout
    q: Array
    k: Array
    v: Array
    g: Array
    initial_state: Array | None
    """``[R, sequences_per_row, H, K, V]`` in the compute dtype, or None."""
    scale: float

    @property
    def dtype(self):
        """The compute dtype: float32, float64 for float64 inputs."""
        return state_dtype(self.q.dtype)


def _chunked(q, k, v, g, initial_state, cu_seqlens, scale, chunk_size) -> _Chunked:
    B, T = q.shape[:2]
    layout = dense_layout(T, chunk_size) if cu_seqlens is None else packed_layout(cu_seqlens, T, chunk_size)
    h0 = None
    if initial_state is not None:
        rows = B if cu_seqlens is None else 1
        h0 = initial_state.astype(state_dtype(q.dtype)).reshape(rows, layout.sequences_per_row, *initial_state.shape[1:])
    return _Chunked(layout, layout.pack(q), layout.pack(k), layout.pack(v), layout.pack(g), h0, scale)


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """Chunk ``n`` of every row, heads first (``[R, H, C, .]``), in the compute dtype; ``q`` times ``scale``."""

    q: Array
    k: Array
    v: Array
    decays: intra.Decays


def _take_chunk(x: _Chunked, n: Array) -> _Chunk:
    C = x.layout.chunk_size
    return _Chunk(
        q=heads_first(x.q, n, C, x.dtype) * x.scale, k=heads_first(x.k, n, C, x.dtype), v=heads_first(x.v, n, C, x.dtype),
        decays=intra.decays(heads_first(x.g, n, C, x.dtype)),
    )


def _forward_sweep(x: _Chunked, *, output_dtype, record_states: bool):
    """Walk the chunks in order carrying the state; returns ``(o, final_states, states)``.

    ``o`` (``[R, P, H, V]``) only when ``output_dtype`` is given; ``states``
    (``[num_chunks, R, H, K, V]``, the state before each chunk) only when ``record_states``.
    """
    R, P, H, K = x.q.shape
    V = x.v.shape[-1]
    C = x.layout.chunk_size
    o = None if output_dtype is None else jnp.zeros((R, P, H, V), output_dtype)

    def step(n, state, o):
        c = _take_chunk(x, n)
        if o is not None:
            aqk = intra.query_pairs(c.q, c.k, c.decays.levels)
            query_state = einsum("rhik,rhkv->rhiv", c.q * c.decays.to_token, state)
            o = put(o, n, query_state + einsum("rhij,rhjv->rhiv", aqk, c.v), C)
        state = c.decays.whole[..., 0, :, None] * state + einsum("rhjk,rhjv->rhkv", c.k * c.decays.to_end, c.v)
        return state, o

    return forward_sweep(x.layout, x.initial_state, jnp.zeros((R, H, K, V), x.dtype), step, o, record_states=record_states)


def _reverse_sweep(x: _Chunked, do: Array, dht: Array | None, states: Array):
    """Walk the chunks backwards carrying the state gradient; returns ``dq, dk, dv, dg, dh0``."""
    R, P, H, K = x.q.shape
    V = x.v.shape[-1]
    C = x.layout.chunk_size
    grads = tuple(jnp.zeros(a.shape, a.dtype) for a in (x.q, x.k, x.v, x.g))

    def step(n, dstate, grads):
        dq, dk, dv, dg = grads
        state = states[n]
        c = _take_chunk(x, n)
        do_n = heads_first(do, n, C, x.dtype)
        to_token, to_end = c.decays.to_token, c.decays.to_end
        query_decayed, key_to_end = c.q * to_token, c.k * to_end

        aqk = intra.query_pairs(c.q, c.k, c.decays.levels)
        dv_n = einsum("rhij,rhiv->rhjv", aqk, do_n) + einsum("rhjk,rhkv->rhjv", key_to_end, dstate)
        daqk = einsum("rhiv,rhjv->rhij", do_n, c.v)
        dq_pairs, dk_pairs, d_later, d_earlier = intra.pairs_backward(c.q, c.k, c.decays.levels, daqk)
        dq_decayed = einsum("rhiv,rhkv->rhik", do_n, state)
        dk_to_end = einsum("rhjv,rhkv->rhjk", c.v, dstate)
        dg_n = intra.decays_backward(intra.DecayCotangents(
            later=d_later, earlier=d_earlier, to_token=query_decayed * dq_decayed, to_end=key_to_end * dk_to_end,
            whole=c.decays.whole * jnp.sum(state * dstate, axis=-1)[..., None, :],
        ))
        dq_n = (dq_pairs + to_token * dq_decayed) * x.scale
        dk_n = dk_pairs + to_end * dk_to_end
        grads = (put(dq, n, dq_n, C), put(dk, n, dk_n, C), put(dv, n, dv_n, C), put(dg, n, dg_n, C))
        dstate = c.decays.whole[..., 0, :, None] * dstate + einsum("rhik,rhiv->rhkv", query_decayed, do_n)
        return dstate, grads

    grads, dh0 = reverse_sweep(x.layout, dht, jnp.zeros((R, H, K, V), x.dtype), step, grads)
    return (*grads, dh0)
