"""simple_gla, chunked, in plain jax.numpy: the forward and a hand-written backward.

Per sequence and head, tokens are cut into chunks of ``C``. With ``b_i`` the cumulative log
decay inside a chunk (``b_i = a_1 + ... + a_i``), ``G = b_C`` the chunk's total, ``S`` the state
before the chunk and ``D_ij = exp(b_i - b_j)`` for ``i >= j`` (0 above the diagonal)::

    o     = ((q k^T) * D) v + exp(b) * (q S)                    (q already times ``scale``)
    S_out = exp(G) S + k^T (exp(G - b) * v)

The backward recomputes the state before every chunk (a forward sweep that stores
``[T/C, K, V]`` per row and head), then walks the chunks backwards carrying ``dS``, the
gradient of the state after the chunk::

    dP    = (do v^T) * D
    dq    = dP k + exp(b) * (do S^T)
    dk    = dP^T q + exp(G - b) * (v dS^T)
    dv    = ((q k^T) * D)^T do + exp(G - b) * (k dS)
    dS_in = exp(G) dS + (exp(b) * q)^T do

Both sweeps loop over chunks, all rows and heads of a chunk at once, and write their outputs in
place: every temporary stays the size of one chunk. On CPU that matters more than arithmetic,
because every freshly allocated page costs a fault. Memory is O(T (K + V) + (T / C) K V).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tops_core import SimpleGLAGrads
from tops_core.ops.base import state_dtype
from tops_plugins_xla.chunk_layout import ChunkLayout, dense_layout, packed_layout
from tops_plugins_xla.sweep import einsum, flat_states, forward_sweep, heads_first, put, reverse_sweep

Array = jax.Array


def forward(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, config):
    """``(o, final_state)`` of simple_gla (the ``Forward`` protocol of ``tops_core.ops.simple_gla``)."""
    return _forward(q, k, v, g, g_gamma, initial_state, cu_seqlens, scale=scale,
                    output_final_state=output_final_state, chunk_size=config.chunk_size)


def backward(q, k, v, do, *, g, g_gamma, scale, initial_state, dht, cu_seqlens, config):
    """The VJP of simple_gla (the ``Backward`` protocol of ``tops_core.ops.simple_gla``)."""
    return _backward(q, k, v, do, g, g_gamma, initial_state, dht, cu_seqlens, scale=scale,
                     chunk_size=config.chunk_size)


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "chunk_size"))
def _forward(q, k, v, g, g_gamma, initial_state, cu_seqlens, *, scale, output_final_state, chunk_size):
    x = _chunked(q, k, v, g, g_gamma, initial_state, cu_seqlens, scale, chunk_size)
    o, final, _ = _forward_sweep(x, output_dtype=v.dtype, record_states=False)
    final_state = flat_states(final) if output_final_state else None
    return x.layout.unpack(o), final_state


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size"))
def _backward(q, k, v, do, g, g_gamma, initial_state, dht, cu_seqlens, *, scale, chunk_size):
    x = _chunked(q, k, v, g, g_gamma, initial_state, cu_seqlens, scale, chunk_size)
    layout = x.layout
    _, final, states = _forward_sweep(x, output_dtype=None, record_states=True)
    if dht is not None:
        dht = dht.astype(x.dtype).reshape(final.shape)
    dq, dk, dv, dlog_decay, dh0 = _reverse_sweep(x, layout.pack(do), dht, states, final)
    dg = dg_gamma = dinitial_state = None
    if g is not None or g_gamma is not None:
        dlog_decay = layout.unpack(dlog_decay)
        if g is not None:
            dg = dlog_decay.astype(g.dtype)
        if g_gamma is not None:
            # A scalar g_gamma is shared by the heads too.
            summed = (0, 1) if g_gamma.ndim else (0, 1, 2)
            dg_gamma = jnp.sum(dlog_decay, axis=summed).astype(g_gamma.dtype)
    if initial_state is not None:
        dinitial_state = flat_states(dh0).astype(initial_state.dtype)
    return SimpleGLAGrads(
        dq=layout.unpack(dq), dk=layout.unpack(dk), dv=layout.unpack(dv),
        dg=dg, dg_gamma=dg_gamma, dinitial_state=dinitial_state,
    )


# -- the call, in its chunk layout ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Chunked:
    """A call moved into its chunk layout.

    ``q, k, v`` are ``[R, P, H, .]`` in their own dtype (``R`` rows of ``P`` slots). The decays
    are ``[num_chunks, R, H, C]`` (``[num_chunks, R, H]`` for the whole chunk), so a step reads
    one contiguous block of each.
    """

    layout: ChunkLayout
    q: Array
    k: Array
    v: Array
    decay_to_token: Array
    """``exp(b)``: from the chunk start to each token (inclusive)."""
    decay_to_end: Array
    """``exp(G - b)``: from each token (exclusive) to the chunk end."""
    decay_whole: Array
    """``exp(G)``: across the whole chunk."""
    gate: Array | None
    """``b`` when the decay varies per token (``g`` given); None when ``intra`` holds ``D``."""
    intra: Array | None
    """``[1 or H, C, C]``: ``D`` when the decay is a constant per head (no ``g``), the same in every chunk."""
    initial_state: Array | None
    """``[R, sequences_per_row, H, K, V]`` in the compute dtype, or None."""
    scale: float

    @property
    def dtype(self):
        """The compute dtype: float32, float64 for float64 inputs."""
        return state_dtype(self.q.dtype)


def _chunked(q, k, v, g, g_gamma, initial_state, cu_seqlens, scale, chunk_size) -> _Chunked:
    B, T, H, _ = q.shape
    C = chunk_size
    layout = dense_layout(T, C) if cu_seqlens is None else packed_layout(cu_seqlens, T, C)
    dtype = state_dtype(q.dtype)
    rows = B if cu_seqlens is None else 1
    log_decay = jnp.zeros((rows, layout.num_slots, H), dtype)
    if g is not None:
        log_decay += layout.pack(g.astype(dtype))
    if g_gamma is not None:
        # Padded slots must not decay the state: the final state is exact.
        real = layout.token_mask()[None, :, None]
        log_decay += jnp.where(real, g_gamma.astype(dtype), 0)
    gate = jnp.cumsum(log_decay.reshape(rows, layout.num_chunks, C, H), axis=2)
    gate = jnp.transpose(gate, (1, 0, 3, 2))  # [num_chunks, R, H, C]
    total = gate[..., -1]

    intra = None
    if g is None:
        # Slots of a chunk are its sequence's tokens in order, then padding whose q, k, v and do
        # are zero, so D = exp(gamma (i - j)) is right wherever it matters, in every chunk.
        gamma = jnp.zeros((1,), dtype) if g_gamma is None else jnp.reshape(g_gamma.astype(dtype), (-1,))
        steps = jnp.arange(C, dtype=dtype)
        intra = _masked_exp(gamma[:, None, None] * (steps[:, None] - steps[None, :]))

    h0 = None
    if initial_state is not None:
        h0 = initial_state.astype(dtype).reshape(rows, layout.sequences_per_row, *initial_state.shape[1:])
    return _Chunked(
        layout=layout, q=layout.pack(q), k=layout.pack(k), v=layout.pack(v),
        decay_to_token=jnp.exp(gate), decay_to_end=jnp.exp(total[..., None] - gate),
        decay_whole=jnp.exp(total), gate=gate if g is not None else None, intra=intra,
        initial_state=h0, scale=scale,
    )


def _masked_exp(diff: Array) -> Array:
    """``exp`` of ``diff[..., i, j]`` on and below the diagonal, 0 above it.

    The exponent is masked before ``exp``: above the diagonal it can be large and positive, and
    ``exp`` of it would overflow into ``inf * 0 = nan``.
    """
    C = diff.shape[-1]
    causal = jnp.tril(jnp.ones((C, C), bool))
    return jnp.exp(jnp.where(causal, diff, -jnp.inf))


# -- one chunk ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """Chunk ``n`` of every row, heads first (``[R, H, C, .]``), in the compute dtype."""

    q: Array
    """Queries times ``scale``."""
    k: Array
    v: Array
    decay_to_token: Array
    """``[R, H, C, 1]``."""
    decay_to_end: Array
    """``[R, H, C, 1]``."""
    decay_whole: Array
    """``[R, H, 1, 1]``."""
    intra: Array
    """``[R or 1, H or 1, C, C]``: ``D``."""


def _take_chunk(x: _Chunked, n: Array) -> _Chunk:
    C = x.layout.chunk_size
    if x.intra is None:
        b = x.gate[n]
        intra = _masked_exp(b[..., :, None] - b[..., None, :])
    else:
        intra = x.intra[None]
    return _Chunk(
        q=heads_first(x.q, n, C, x.dtype) * x.scale,
        k=heads_first(x.k, n, C, x.dtype),
        v=heads_first(x.v, n, C, x.dtype),
        decay_to_token=x.decay_to_token[n][..., None],
        decay_to_end=x.decay_to_end[n][..., None],
        decay_whole=x.decay_whole[n][..., None, None],
        intra=intra,
    )


# -- the sweeps ---------------------------------------------------------------------------------


def _forward_sweep(x: _Chunked, *, output_dtype, record_states: bool):
    """Walk the chunks in order carrying the state; returns ``(o, final_states, states)``.

    ``o`` (``[R, P, H, V]``) only when ``output_dtype`` is given; ``states``
    (``[num_chunks, R, H, K, V]``, the state before each chunk) only when ``record_states``.
    With one sequence per row the state starts from the initial state and is never reset.
    """
    layout = x.layout
    R, P, H, K = x.q.shape
    V = x.v.shape[-1]
    C = layout.chunk_size
    o = None if output_dtype is None else jnp.zeros((R, P, H, V), output_dtype)

    def step(n, state, o):
        c = _take_chunk(x, n)
        if o is not None:
            scores = einsum("rhik,rhjk->rhij", c.q, c.k) * c.intra
            o_n = einsum("rhij,rhjv->rhiv", scores, c.v) + c.decay_to_token * einsum("rhik,rhkv->rhiv", c.q, state)
            o = put(o, n, o_n, C)
        state = c.decay_whole * state + einsum("rhjk,rhjv->rhkv", c.k, c.decay_to_end * c.v)
        return state, o

    return forward_sweep(layout, x.initial_state, jnp.zeros((R, H, K, V), x.dtype), step, o, record_states=record_states)


def _reverse_sweep(x: _Chunked, do: Array, dht: Array | None, states: Array, finals: Array):
    """Walk the chunks backwards carrying the state gradient; returns ``dq, dk, dv, da, dh0``.

    ``da`` (``[R, P, H]``) is the gradient of each slot's log decay. The decay ``a_t`` scales
    every product between a token ``j < t`` and a token ``i >= t`` of its sequence, so ``da_t``
    sums the terms of exactly those pairs: pairs inside the chunk, pairs with ``i`` in the chunk
    and ``j`` earlier (``do_i . exp(b_i) q_i S``), pairs with ``j`` in the chunk and ``i`` later
    (``v_j . exp(G - b_j) k_j dS``), and pairs spanning the chunk (``exp(G) S . dS``, the
    same for every token of the chunk). The equivalent suffix sums of ``q . dq - k . dk``
    cancel large terms (the diagonal ``i == j`` above all) and lose float32 digits under strong
    decays; this sum does not (docs/ops.md, "Precision of dg").
    """
    layout = x.layout
    R, P, H, K = x.q.shape
    V = x.v.shape[-1]
    C = layout.chunk_size
    at_or_after = jnp.tril(jnp.ones((C, C), x.dtype))
    before = jnp.triu(jnp.ones((C, C), x.dtype), 1)
    dq = jnp.zeros((R, P, H, K), x.q.dtype)
    dk = jnp.zeros((R, P, H, K), x.k.dtype)
    dv = jnp.zeros((R, P, H, V), x.v.dtype)
    da = jnp.zeros((R, P, H), x.dtype)

    def step(n, dstate, grads):
        dq, dk, dv, da = grads
        state = states[n]
        c = _take_chunk(x, n)
        do_n = heads_first(do, n, C, x.dtype)
        scores = einsum("rhik,rhjk->rhij", c.q, c.k) * c.intra
        do_v = einsum("rhiv,rhjv->rhij", do_n, c.v)
        dscores = do_v * c.intra
        dq_inter = c.decay_to_token * einsum("rhiv,rhkv->rhik", do_n, state)
        dq_n = einsum("rhij,rhjk->rhik", dscores, c.k) + dq_inter
        dk_n = einsum("rhij,rhik->rhjk", dscores, c.q)
        dk_n += c.decay_to_end * einsum("rhjv,rhkv->rhjk", c.v, dstate)
        dv_inter = c.decay_to_end * einsum("rhjk,rhkv->rhjv", c.k, dstate)
        dv_n = einsum("rhij,rhiv->rhjv", scores, do_n) + dv_inter
        dq = put(dq, n, dq_n * x.scale, C)
        dk = put(dk, n, dk_n, C)
        dv = put(dv, n, dv_n, C)

        # Sums over token ranges as products with 0/1 triangles ([j, t]: j < t; [i, t]: i >= t).
        pairs = scores * do_v
        within = jnp.sum(einsum("rhij,jt->rhit", pairs, before) * at_or_after, axis=-2)
        later_query = jnp.sum(c.q * dq_inter, axis=-1)  # i in the chunk, j earlier
        earlier_key = jnp.sum(c.v * dv_inter, axis=-1)  # j in the chunk, i later
        spanning = jnp.sum(c.decay_whole * state * dstate, axis=(-2, -1))[..., None]  # i after, j before
        da_n = (
            within
            + einsum("rhi,it->rht", later_query, at_or_after)
            + einsum("rhj,jt->rht", earlier_key, before)
            + spanning
        )
        da = put(da, n, da_n, C)

        dstate = c.decay_whole * dstate + einsum("rhik,rhiv->rhkv", c.decay_to_token * c.q, do_n)
        return dstate, (dq, dk, dv, da)

    (dq, dk, dv, da), dh0 = reverse_sweep(layout, dht, jnp.zeros((R, H, K, V), x.dtype), step, (dq, dk, dv, da))
    return dq, dk, dv, da, dh0
