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

**Cuts.** A gate of ``-inf`` resets the state (``exp(-inf) = 0``), and so does, for packed
sequences, every sequence start. ``b`` sums the finite gates only and ``r_i`` counts the cuts in
the chunk up to token ``i``; a decay across a cut is 0, so ``D_ij = exp(b_i - b_j)`` only where
``r_i == r_j``, ``exp(b_i)`` only where ``r_i == 0``, ``exp(G - b_j)`` only where
``r_j == r_C`` and ``exp(G)`` only where ``r_C == 0``: each exponent is masked to ``-inf`` before
``exp``, so no ``-inf - (-inf)`` is ever formed, and the gradient of a cut's gate is 0.

**Packed sequences** (``cu_seqlens``) run as one stream in regular chunks, each start a cut, from
zero states, so the cost does not depend on the number of sequences; what initial and final states
add is linear and computed apart (``packed``). With states and few sequences (``N C <= T``) each
sequence runs in chunks of its own instead (``packed_layout``, ``T / C + N`` chunks), where the
sweeps carry the states: there that costs less than the states' terms.

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
from tops_core.packing import sequence_starts
from tops_plugins_xla.chunk_layout import ChunkLayout, dense_layout, packed_layout
from tops_plugins_xla.simple_gla.packed import PackedStates, packed_states
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
    with_states = initial_state is not None or output_final_state
    x = _chunked(q, k, v, g, g_gamma, initial_state, cu_seqlens, scale, chunk_size, with_states)
    if x.packed is None:
        o, final, _ = _forward_sweep(x, output_dtype=v.dtype, record_states=False)
        return x.layout.unpack(o), flat_states(final) if output_final_state else None

    # Packed: the stream from zero states, then what the states add (in the compute dtype, rounded once).
    h0 = None if initial_state is None else initial_state.astype(x.dtype)
    o, _, _ = _forward_sweep(x, output_dtype=v.dtype if h0 is None else x.dtype, record_states=False)
    o = x.layout.unpack(o)
    if h0 is not None:
        o = o + x.packed.initial_state_outputs(q.astype(x.dtype) * scale, h0)
    final_state = x.packed.final_states(k.astype(x.dtype), v.astype(x.dtype), h0) if output_final_state else None
    return o.astype(v.dtype), final_state


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size"))
def _backward(q, k, v, do, g, g_gamma, initial_state, dht, cu_seqlens, *, scale, chunk_size):
    x = _chunked(q, k, v, g, g_gamma, initial_state, cu_seqlens, scale, chunk_size, initial_state is not None or dht is not None)
    layout = x.layout
    _, final, states = _forward_sweep(x, output_dtype=None, record_states=True)
    if x.packed is None:
        if dht is not None:
            dht = dht.astype(x.dtype).reshape(final.shape)
        *grads, dh0 = _reverse_sweep(x, layout.pack(do), dht, states)
        dq, dk, dv, dlog_decay = (layout.unpack(d) for d in grads)
        dh0 = flat_states(dh0)
    else:
        dq, dk, dv, dlog_decay, dh0 = _packed_backward(x, q, k, v, do, initial_state, dht, states)
    dg = dg_gamma = dinitial_state = None
    if g is not None:
        dg = dlog_decay.astype(g.dtype)
    if g_gamma is not None:
        # A scalar g_gamma is shared by the heads too.
        summed = (0, 1) if g_gamma.ndim else (0, 1, 2)
        dg_gamma = jnp.sum(dlog_decay, axis=summed).astype(g_gamma.dtype)
    if initial_state is not None:
        dinitial_state = dh0.astype(initial_state.dtype)
    return SimpleGLAGrads(
        dq=dq.astype(q.dtype), dk=dk.astype(k.dtype), dv=dv.astype(v.dtype),
        dg=dg, dg_gamma=dg_gamma, dinitial_state=dinitial_state,
    )


def _packed_backward(x: _Chunked, q, k, v, do, initial_state, dht, states):
    """``dq, dk, dv, da, dh0`` of a packed call: the stream's, from the reverse sweep (which nothing
    carries across a sequence start), plus the gradients of what the states add."""
    with_states = initial_state is not None or dht is not None
    # With states, the sweep's gradients stay in the compute dtype until the states' terms are added.
    grads = _reverse_sweep(x, x.layout.pack(do), None, states, grad_dtype=x.dtype if with_states else None)
    dq, dk, dv, da = (x.layout.unpack(d) for d in grads[:4])
    if not with_states:
        return dq, dk, dv, da, None
    f = x.dtype
    h0 = None if initial_state is None else initial_state.astype(f)
    dht = None if dht is None else dht.astype(f)
    dq_states, dk_states, dv_states, da_states, dh0 = x.packed.backward(
        q.astype(f) * x.scale, k.astype(f), v.astype(f), do.astype(f), h0, dht)
    if dq_states is not None:
        dq = dq + dq_states * x.scale
    if dk_states is not None:
        dk, dv = dk + dk_states, dv + dv_states
    return dq, dk, dv, da + da_states, dh0


# -- the call, in its chunk layout ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Chunked:
    """A call moved into its chunk layout.

    ``q, k, v`` are ``[R, P, H, .]`` in their own dtype (``R`` rows of ``P`` slots; packed
    sequences are one row). The decays are ``[num_chunks, R, H, C]`` (``[num_chunks, R, H]`` for
    the whole chunk), so a step reads one contiguous block of each; each is 0 across a cut.
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
    cuts: Array | None
    """``r``, the cuts in the chunk up to each token (int32), where a cut can fall inside a chunk
    (``g`` given, or packed sequences); None where ``intra`` already holds every cut."""
    intra: Array | None
    """``[1 or H, C, C]``: ``D`` when the decay is a constant per head (no ``g``), the same in every chunk."""
    initial_state: Array | None
    """``[R, sequences_per_row, H, K, V]`` in the compute dtype, or None (always None in the stream)."""
    packed: PackedStates | None
    """Packed sequences in one stream: what their states add; None otherwise."""
    scale: float

    @property
    def dtype(self):
        """The compute dtype: float32, float64 for float64 inputs."""
        return state_dtype(self.q.dtype)


def _chunked(q, k, v, g, g_gamma, initial_state, cu_seqlens, scale, chunk_size, with_states: bool) -> _Chunked:
    B, T, H, _ = q.shape
    C = chunk_size
    stream = cu_seqlens is not None and not _sequences_own_chunks(T, cu_seqlens.shape[0] - 1, C, with_states)
    layout = packed_layout(cu_seqlens, T, C) if cu_seqlens is not None and not stream else dense_layout(T, C)
    dtype = state_dtype(q.dtype)
    log_decay = jnp.zeros((B, T, H), dtype)
    if g is not None:
        log_decay += g.astype(dtype)
    if g_gamma is not None:
        log_decay += g_gamma.astype(dtype)
    cut = log_decay == -jnp.inf
    packed = None
    if stream:
        cut |= sequence_starts(cu_seqlens, T)[None, :, None]
        packed = packed_states(log_decay, cu_seqlens)

    # Padded slots (zeros) neither decay nor cut the state: the final state is exact.
    def chunk_major(x):  # [R, T, H] -> [num_chunks, R, H, C], summed along each chunk
        x = jnp.cumsum(layout.pack(x).reshape(B, layout.num_chunks, C, H), axis=2)
        return jnp.transpose(x, (1, 0, 3, 2))

    gate = chunk_major(jnp.where(cut, 0, log_decay))
    cuts = chunk_major(cut.astype(jnp.int32))
    total, cuts_total = gate[..., -1:], cuts[..., -1:]

    intra = None
    if g is None:
        # Slots of a chunk are tokens in order, then padding whose q, k, v and do are zero, so
        # D = exp(gamma (i - j)) is right wherever it matters, in every chunk.
        gamma = jnp.zeros((1,), dtype) if g_gamma is None else jnp.reshape(g_gamma.astype(dtype), (-1,))
        steps = jnp.arange(C, dtype=dtype)
        distance = steps[:, None] - steps[None, :]
        # The diagonal decays over no token (exp(0) = 1), also where gamma * 0 would be nan (gamma = -inf).
        exponent = jnp.where(distance == 0, 0, gamma[:, None, None] * distance)
        intra = _masked_exp(exponent, distance >= 0)

    h0 = None
    if initial_state is not None and not stream:
        h0 = initial_state.astype(dtype).reshape(B, layout.sequences_per_row, *initial_state.shape[1:])
    return _Chunked(
        layout=layout, q=layout.pack(q), k=layout.pack(k), v=layout.pack(v),
        decay_to_token=_masked_exp(gate, cuts == 0),
        decay_to_end=_masked_exp(total - gate, cuts == cuts_total),
        decay_whole=_masked_exp(total[..., 0], cuts_total[..., 0] == 0),
        gate=gate if g is not None else None,
        cuts=cuts if g is not None or stream else None,
        intra=intra, initial_state=h0, packed=packed, scale=scale,
    )


def _sequences_own_chunks(num_tokens: int, num_sequences: int, chunk_size: int, with_states: bool) -> bool:
    """Whether packed sequences run in chunks of their own (``packed_layout``) rather than as one stream.

    Their own chunks cost ``T / C + N`` chunks (``1 + N C / T`` times the stream's), and the
    sweeps carry the states through them. In the stream the states' terms cost about ``K V``
    per token and term (``packed``): worth it without states (nothing to add), and with states
    once ``N C / T`` exceeds about 1.
    """
    return with_states and num_sequences * chunk_size <= num_tokens


def _masked_exp(exponent: Array, keep: Array) -> Array:
    """``exp(exponent)`` where ``keep``, else 0.

    The exponent is masked before ``exp``: where it is not kept it can be large and positive
    (above a decay matrix's diagonal) or ``nan`` (``-inf - (-inf)``), and ``exp`` of it times 0
    would be ``nan``.
    """
    return jnp.exp(jnp.where(keep, exponent, -jnp.inf))


def _uncut(cuts: Array) -> Array:
    """``[.., C, C]``: True where ``i >= j`` and no cut falls in ``(j, i]`` (``r_i == r_j``)."""
    C = cuts.shape[-1]
    causal = jnp.tril(jnp.ones((C, C), bool))
    return causal & (cuts[..., :, None] == cuts[..., None, :])


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
    if x.gate is not None:
        b = x.gate[n]
        intra = _masked_exp(b[..., :, None] - b[..., None, :], _uncut(x.cuts[n]))
    elif x.cuts is not None:
        # Packed sequences start inside chunks. D is finite or (for a growing decay) inf, never nan:
        # selecting 0 outside the runs is exact.
        intra = jnp.where(_uncut(x.cuts[n]), x.intra[None], 0)
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
    Each row's state starts from its initial state (zeros when packed); the decays cut it.
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


def _reverse_sweep(x: _Chunked, do: Array, dht: Array | None, states: Array, *, grad_dtype=None):
    """Walk the chunks backwards carrying the state gradient; returns ``dq, dk, dv, da, dh0``.

    ``dq, dk, dv`` are in ``grad_dtype``, or in their inputs' dtypes when it is None.

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
    dq = jnp.zeros((R, P, H, K), grad_dtype or x.q.dtype)
    dk = jnp.zeros((R, P, H, K), grad_dtype or x.k.dtype)
    dv = jnp.zeros((R, P, H, V), grad_dtype or x.v.dtype)
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
