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

A chunk whose log decay is mild in every key, row and head (``intra_mild.is_mild``: at least ``-40``
over the chunk, as gla's usual gates give) takes ``intra_mild``'s dense form instead: its decays as
running products and ``Aqk`` as one product, several times cheaper on CPU than the halving's levels;
``lax.cond`` picks the form per chunk, in both sweeps.

Both sweeps loop over chunks, all rows and heads of a chunk at once, and write their outputs in
place: every temporary stays the size of one chunk. Memory is O(T (K + V) + (T / C) K V).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from tops_core import GLAGrads
from tops_core.ops.base import state_dtype
from tops_plugins_xla import intra, intra_mild
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
    """Chunk ``n`` of every row, heads first (``[R, H, C, .]``), in the compute dtype; ``q`` times ``scale``.

    ``mild``: its decays are ``intra_mild``'s and its pair products one dense product, else ``intra``'s halving.
    """

    q: Array
    k: Array
    v: Array
    decays: intra.Decays
    mild: bool

    def query_pairs(self) -> Array:
        if self.mild:
            return intra_mild.query_pairs(self.q, self.k, self.decays)
        return intra.query_pairs(self.q, self.k, self.decays.levels)

    def pairs_backward(self, daqk: Array, by_state: intra.DecayCotangents) -> tuple[Array, Array, Array]:
        """``(dq, dk, dg)`` from ``query_pairs``' cotangent ``daqk``; ``dg`` adds ``by_state``, the state's terms in the
        gradients of the exponents of ``to_token``, ``to_end`` and ``whole`` (no levels)."""
        if self.mild:
            dq, dk, d_to_end = intra_mild.pairs_backward(self.q, self.k, self.decays, daqk)
            return dq, dk, intra_mild.decays_backward(dataclasses.replace(by_state, to_end=by_state.to_end + d_to_end))
        dq, dk, d_later, d_earlier = intra.pairs_backward(self.q, self.k, self.decays.levels, daqk)
        return dq, dk, intra.decays_backward(dataclasses.replace(by_state, later=d_later, earlier=d_earlier))


def _take_chunk(x: _Chunked, n: Array, g: Array, mild: bool) -> _Chunk:
    """Chunk ``n``, its log decays ``g`` already read (``_by_decay``)."""
    C = x.layout.chunk_size
    return _Chunk(
        q=heads_first(x.q, n, C, x.dtype) * x.scale, k=heads_first(x.k, n, C, x.dtype), v=heads_first(x.v, n, C, x.dtype),
        decays=intra_mild.decays(g) if mild else intra.decays(g), mild=mild,
    )


def _by_decay(x: _Chunked, n: Array, chunk_step, carry):
    """``chunk_step(carry, g, mild)`` for chunk ``n`` and its log decays ``g``: with ``mild`` true (``intra_mild``'s dense
    form) where ``intra_mild.is_mild`` accepts the chunk, else along ``intra``'s halving; one choice for all its rows and
    heads.

    The branches take and return one chunk's arrays only: the full-size buffers are written outside them.
    """
    g = heads_first(x.g, n, x.layout.chunk_size, x.dtype)
    return lax.cond(intra_mild.is_mild(g), functools.partial(chunk_step, mild=True), functools.partial(chunk_step, mild=False),
                    carry, g)


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
        def chunk_step(state, g, mild):
            c = _take_chunk(x, n, g, mild)
            o_n = None
            if o is not None:
                query_state = einsum("rhik,rhkv->rhiv", c.q * c.decays.to_token, state)
                o_n = query_state + einsum("rhij,rhjv->rhiv", c.query_pairs(), c.v)
            return c.decays.whole[..., 0, :, None] * state + einsum("rhjk,rhjv->rhkv", c.k * c.decays.to_end, c.v), o_n

        state, o_n = _by_decay(x, n, chunk_step, state)
        return state, None if o is None else put(o, n, o_n, C)

    return forward_sweep(x.layout, x.initial_state, jnp.zeros((R, H, K, V), x.dtype), step, o, record_states=record_states)


def _reverse_sweep(x: _Chunked, do: Array, dht: Array | None, states: Array):
    """Walk the chunks backwards carrying the state gradient; returns ``dq, dk, dv, dg, dh0``."""
    R, P, H, K = x.q.shape
    V = x.v.shape[-1]
    C = x.layout.chunk_size
    grads = tuple(jnp.zeros(a.shape, a.dtype) for a in (x.q, x.k, x.v, x.g))

    def chunk_step(n, dstate, g, mild):
        state = states[n]
        c = _take_chunk(x, n, g, mild)
        do_n = heads_first(do, n, C, x.dtype)
        to_token, to_end = c.decays.to_token, c.decays.to_end
        query_decayed, key_to_end = c.q * to_token, c.k * to_end

        aqk = c.query_pairs()
        dv_n = einsum("rhij,rhiv->rhjv", aqk, do_n) + einsum("rhjk,rhkv->rhjv", key_to_end, dstate)
        daqk = einsum("rhiv,rhjv->rhij", do_n, c.v)
        dq_decayed = einsum("rhiv,rhkv->rhik", do_n, state)
        dk_to_end = einsum("rhjv,rhkv->rhjk", c.v, dstate)
        dq_pairs, dk_pairs, dg_n = c.pairs_backward(daqk, intra.DecayCotangents(
            later=(), earlier=(), to_token=query_decayed * dq_decayed, to_end=key_to_end * dk_to_end,
            whole=c.decays.whole * jnp.sum(state * dstate, axis=-1)[..., None, :],
        ))
        dq_n = (dq_pairs + to_token * dq_decayed) * x.scale
        dk_n = dk_pairs + to_end * dk_to_end
        dstate = c.decays.whole[..., 0, :, None] * dstate + einsum("rhik,rhiv->rhkv", query_decayed, do_n)
        return dstate, (dq_n, dk_n, dv_n, dg_n)

    def step(n, dstate, grads):
        dstate, grads_n = _by_decay(x, n, functools.partial(chunk_step, n), dstate)
        return dstate, tuple(put(grad, n, grad_n, C) for grad, grad_n in zip(grads, grads_n))

    grads, dh0 = reverse_sweep(x.layout, dht, jnp.zeros((R, H, K, V), x.dtype), step, grads)
    return (*grads, dh0)
