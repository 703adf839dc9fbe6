"""The delta rule, chunked, in plain jax.numpy: the sweeps of kda and gated_delta_rule, forward and backward.

Per sequence and head, tokens are cut into chunks of ``C``. Inside a chunk, with ``b`` the
cumulative log decay per token (and key, for kda's per-key gates), ``S`` the state before the chunk,
``q`` already normalised and times ``scale``, and ``Aqk``, ``Akk`` and the inverse from ``intra``
(per-key gates) or ``intra_per_head`` (one gate per head: ``g`` of width 1 here), the
delta rule's writes ``delta_t`` (``S_t = diag(exp(g_t)) S_{t-1} + k_t^T delta_t``) solve a unit
lower-triangular system::

    (I + diag(beta) Akk) delta = beta * (v - (exp(b) * k) S)
    o     = (exp(b) * q) S + Aqk delta
    S_out = exp(b_C) * S + (exp(b_C - b) * k)^T delta            (b_C: the chunk's last token)

The backward recomputes the state before every chunk (a forward sweep that stores
``[T/C, K, V]`` per row and head), then walks the chunks backwards carrying ``dS``, the
gradient of the state after the chunk. With ``r = v - (exp(b) * k) S`` and ``M^-1`` the inverse::

    d_delta = Aqk^T do + (exp(b_C - b) * k) dS^T
    d_r     = M^-T d_delta                    (the gradient of beta * r)
    dv      = beta * d_r
    dbeta   = rowsum(d_r * r) + rowsum(dAkk * Akk),   dAkk = -tril_strict(d_r delta^T)
    dAqk    = tril(do delta^T),   and beta * dAkk for Akk without beta, into ``pairs_backward``
    dS_in   = exp(b_C) * dS + (exp(b) * q)^T do - (exp(b) * k)^T dv

plus the direct terms of ``exp(b) * q``, ``exp(b) * k`` and ``exp(b_C - b) * k`` in ``dq`` and
``dk``. ``dg`` comes from the gradients of every decay's exponent, summed back along the halving
that built them (``intra.decays_backward``; for a gate per head, the exponents' gradients summed over
the keys first). The normalisation of ``q`` and ``k`` is differentiated
per chunk too.

**Grouped value heads.** Everything per value head (``v, g, beta``, the states, ``o``) has the
``HV = G * H`` value heads; ``q`` and ``k`` keep their ``H`` heads and are normalised there, then
repeated to the value heads one chunk at a time. Their gradients are summed over each group per
chunk, before the normalisation's backward.

**Gate and beta.** With ``use_gate`` and ``use_beta_sigmoid`` the sweeps run on ``g_eff`` and
``beta_eff`` (``tops_core.ops.kda``'s ``gate`` and ``beta_activation``), computed on the way into
the chunk layout; the backward chains the sweeps' ``dg_eff`` and ``dbeta_eff`` through
``jax.vjp`` of the same functions for ``dg``, ``dbeta``, ``dA_log`` and ``ddt_bias``.

Both sweeps loop over chunks, all rows and heads of a chunk at once, and write their outputs in
place: every temporary stays the size of one chunk. Memory is O(T (K + V) + (T / C) K V).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tops_core import KDAGrads
from tops_core.ops.base import state_dtype
from tops_core.ops.kda import l2norm
from tops_plugins_xla.chunk_layout import ChunkLayout, dense_layout, packed_layout
from tops_plugins_xla import intra, intra_per_head
from tops_plugins_xla.sweep import einsum, flat_states, forward_sweep, heads_first, put, reverse_sweep

Array = jax.Array

_STATIC = ("scale", "use_qk_l2norm", "chunk_size", "activations")


@functools.partial(jax.jit, static_argnames=_STATIC + ("output_final_state",))
def run_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *, scale, output_final_state, use_qk_l2norm,
                chunk_size, activations):
    """``(o, final_state)``: ``g`` ``[B, T, HV, K]`` per key, or ``[B, T, HV, 1]`` one gate per head."""
    # Activated on the way into the chunk layout, where XLA fuses it into the packing: raw g is read once.
    g, beta = activations.applied(g, beta, A_log, dt_bias)
    x = _chunked(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, chunk_size)
    o, final, _ = _forward_sweep(x, output_dtype=v.dtype, record_states=False)
    final_state = flat_states(final) if output_final_state else None
    return x.layout.unpack(o), final_state


@functools.partial(jax.jit, static_argnames=_STATIC)
def run_backward(q, k, v, g, beta, A_log, dt_bias, do, initial_state, dht, cu_seqlens, *, scale, use_qk_l2norm, chunk_size,
                 activations):
    """``KDAGrads`` of the call (``dg`` shaped as ``g``)."""
    # The recurrence's backward is hand-written; the activations are elementwise, so jax.vjp gives their chain rule.
    (g_eff, beta_eff), activation_vjp = jax.vjp(activations.applied, g, beta, A_log, dt_bias)
    x = _chunked(q, k, v, g_eff, beta_eff, initial_state, cu_seqlens, scale, use_qk_l2norm, chunk_size)
    layout = x.layout
    _, final, states = _forward_sweep(x, output_dtype=None, record_states=True)
    if dht is not None:
        dht = dht.astype(x.dtype).reshape(final.shape)
    dq, dk, dv, dg_eff, dbeta_eff, dh0 = _reverse_sweep(x, layout.pack(do), dht, states)
    dg, dbeta, dA_log, ddt_bias = activation_vjp(
        (layout.unpack(dg_eff).astype(g_eff.dtype), layout.unpack(dbeta_eff).astype(beta_eff.dtype)))
    dinitial_state = None if initial_state is None else flat_states(dh0).astype(initial_state.dtype)
    return KDAGrads(
        dq=layout.unpack(dq), dk=layout.unpack(dk), dv=layout.unpack(dv), dg=dg, dbeta=dbeta,
        dinitial_state=dinitial_state, dA_log=dA_log, ddt_bias=ddt_bias,
    )


# -- the call, in its chunk layout ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Chunked:
    """A call moved into its chunk layout: ``[R, P, heads, .]`` (``R`` rows of ``P`` slots).

    ``q, k`` have the ``H`` key heads, ``v, g, beta`` the ``HV = G * H`` value heads; ``g`` and
    ``beta`` are the activated ones. ``q, k, v, g`` keep their dtype; ``beta`` is in the compute
    dtype. Padded slots hold zeros: no decay, no write.
    """

    layout: ChunkLayout
    q: Array
    k: Array
    v: Array
    g: Array
    beta: Array
    initial_state: Array | None
    """``[R, sequences_per_row, HV, K, V]`` in the compute dtype, or None."""
    scale: float
    use_qk_l2norm: bool

    @property
    def dtype(self):
        """The compute dtype: float32, float64 for float64 inputs."""
        return state_dtype(self.q.dtype)

    @property
    def groups(self) -> int:
        """``G``: the value heads that share each query/key head."""
        return self.v.shape[2] // self.q.shape[2]

    @property
    def pair_products(self):
        """Where a chunk's pair products come from: ``intra`` for gates per key, ``intra_per_head`` for one per head."""
        return intra_per_head if self.g.shape[-1] == 1 else intra

    def of_gate_width(self, x: Array) -> Array:
        """The gradient of a decay's exponent per key, summed over the keys for a gate per head."""
        return jnp.sum(x, axis=-1, keepdims=True) if self.g.shape[-1] == 1 else x


def _chunked(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, chunk_size) -> _Chunked:
    B, T = q.shape[:2]
    C = chunk_size
    layout = dense_layout(T, C) if cu_seqlens is None else packed_layout(cu_seqlens, T, C)
    dtype = state_dtype(q.dtype)
    rows = B if cu_seqlens is None else 1
    h0 = None
    if initial_state is not None:
        h0 = initial_state.astype(dtype).reshape(rows, layout.sequences_per_row, *initial_state.shape[1:])
    return _Chunked(
        layout=layout, q=layout.pack(q), k=layout.pack(k), v=layout.pack(v),
        g=layout.pack(g), beta=layout.pack(beta.astype(dtype)),
        initial_state=h0, scale=scale, use_qk_l2norm=use_qk_l2norm,
    )


# -- one chunk ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """Chunk ``n`` of every row, heads first (``[R, HV, C, .]``: value heads), in the compute dtype."""

    q: Array
    """Queries, normalised when asked, times ``scale``, each value head's own copy."""
    k: Array
    """Keys, normalised when asked, each value head's own copy."""
    v: Array
    beta: Array
    """``[R, HV, C]``."""
    decays: intra.Decays
    q_heads: Array
    """``[R, H, C, K]``: the queries on their own heads, normalised when asked (not scaled)."""
    k_heads: Array
    q_norm: Array | None
    """``[R, H, C, 1]``: ``sqrt(sum(q^2) + eps)`` when normalising, else None."""
    k_norm: Array | None


def _take_chunk(x: _Chunked, n: Array) -> _Chunk:
    C = x.layout.chunk_size
    q = heads_first(x.q, n, C, x.dtype)
    k = heads_first(x.k, n, C, x.dtype)
    q_norm = k_norm = None
    if x.use_qk_l2norm:
        q_norm, k_norm = l2norm(q), l2norm(k)
        q, k = q / q_norm, k / k_norm
    return _Chunk(
        q=_to_value_heads(q * x.scale, x.groups), k=_to_value_heads(k, x.groups), v=heads_first(x.v, n, C, x.dtype),
        beta=heads_first(x.beta, n, C, x.dtype), decays=intra.decays(heads_first(x.g, n, C, x.dtype)),
        q_heads=q, k_heads=k, q_norm=q_norm, k_norm=k_norm,
    )


def _to_value_heads(x: Array, groups: int) -> Array:
    """``[R, H, C, .]`` -> ``[R, H * groups, C, .]``: value head ``j`` reads key head ``j // groups``.

    Per chunk only: the whole sequence's ``q, k`` are never repeated."""
    return jnp.repeat(x, groups, axis=1)


def _to_key_heads(x: Array, groups: int) -> Array:
    """The transpose of ``_to_value_heads``: ``[R, H * groups, C, .]`` summed over each group -> ``[R, H, C, .]``."""
    return jnp.sum(x.reshape(x.shape[0], -1, groups, *x.shape[2:]), axis=2)


def _l2norm_backward(normalised: Array, norm: Array, d_normalised: Array) -> Array:
    """The gradient of ``x`` for ``y = x / norm``, ``norm = sqrt(sum(x^2) + eps)``: ``(dy - y (y . dy)) / norm``."""
    return (d_normalised - normalised * jnp.sum(normalised * d_normalised, axis=-1, keepdims=True)) / norm


@dataclasses.dataclass(frozen=True)
class _Writes:
    """The delta rule inside one chunk, from the state before it."""

    pairs: intra.Pairs
    residual: Array
    """``[R, HV, C, V]``: ``r = v - (exp(b) * k) S``, what the decayed state misses."""
    delta: Array
    """``[R, HV, C, V]``: ``M^-1 (beta * r)``, each token's write."""


def _writes(x: _Chunked, c: _Chunk, state: Array, *, with_queries: bool) -> _Writes:
    """``with_queries``: also ``Aqk``, which the outputs and the gradients need but not the state."""
    pairs = x.pair_products.pairs(c.q if with_queries else None, c.k, c.decays.levels, c.beta)
    residual = c.v - einsum("rhik,rhkv->rhiv", c.k * c.decays.to_token, state)
    delta = einsum("rhij,rhjv->rhiv", pairs.inverse, c.beta[..., None] * residual)
    return _Writes(pairs, residual, delta)


def _state_after(c: _Chunk, state: Array, delta: Array) -> Array:
    decay_whole = c.decays.whole[..., 0, :, None]  # [R, HV, K, 1]
    return decay_whole * state + einsum("rhjk,rhjv->rhkv", c.k * c.decays.to_end, delta)


# -- the sweeps ---------------------------------------------------------------------------------


def _forward_sweep(x: _Chunked, *, output_dtype, record_states: bool):
    """Walk the chunks in order carrying the state; returns ``(o, final_states, states)``.

    ``o`` (``[R, P, HV, V]``) only when ``output_dtype`` is given; ``states``
    (``[num_chunks, R, HV, K, V]``, the state before each chunk) only when ``record_states``.
    """
    R, P, HV, V = x.v.shape
    K = x.k.shape[-1]
    C = x.layout.chunk_size
    o = None if output_dtype is None else jnp.zeros((R, P, HV, V), output_dtype)

    def step(n, state, o):
        c = _take_chunk(x, n)
        w = _writes(x, c, state, with_queries=o is not None)
        if o is not None:
            query_state = einsum("rhik,rhkv->rhiv", c.q * c.decays.to_token, state)
            o = put(o, n, query_state + einsum("rhij,rhjv->rhiv", w.pairs.aqk, w.delta), C)
        return _state_after(c, state, w.delta), o

    return forward_sweep(x.layout, x.initial_state, jnp.zeros((R, HV, K, V), x.dtype), step, o, record_states=record_states)


def _reverse_sweep(x: _Chunked, do: Array, dht: Array | None, states: Array):
    """Walk the chunks backwards carrying the state gradient; returns ``dq, dk, dv, dg, dbeta, dh0``."""
    R, P, H, K = x.q.shape
    HV, V = x.v.shape[2:]
    C = x.layout.chunk_size
    grads = (
        jnp.zeros((R, P, H, K), x.q.dtype), jnp.zeros((R, P, H, K), x.k.dtype), jnp.zeros((R, P, HV, V), x.v.dtype),
        jnp.zeros(x.g.shape, x.g.dtype), jnp.zeros((R, P, HV), x.dtype),
    )

    def step(n, dstate, grads):
        dq, dk, dv, dg, dbeta = grads
        state = states[n]
        c = _take_chunk(x, n)
        w = _writes(x, c, state, with_queries=True)
        do_n = heads_first(do, n, C, x.dtype)
        decay, decay_to_end = c.decays.to_token, c.decays.to_end
        key_to_end = c.k * decay_to_end

        d_delta = einsum("rhij,rhiv->rhjv", w.pairs.aqk, do_n) + einsum("rhjk,rhkv->rhjv", key_to_end, dstate)
        d_residual = einsum("rhij,rhiv->rhjv", w.pairs.inverse, d_delta)  # M^-T d_delta: of beta * r
        dv_n = c.beta[..., None] * d_residual
        d_pairs = einsum("rhiv,rhjv->rhij", jnp.concatenate([do_n, d_residual], axis=-2), w.delta)
        daqk, dakk = d_pairs[..., :C, :], -d_pairs[..., C:, :]  # dakk: of diag(beta) Akk, strictly lower part used
        dbeta_n = jnp.sum(d_residual * w.residual, axis=-1) + jnp.sum(dakk * w.pairs.akk, axis=-1)
        dq_pairs, dk_pairs, d_later, d_earlier = x.pair_products.pairs_backward(
            c.q, c.k, c.decays.levels, daqk, c.beta[..., None] * dakk)

        # (exp(b) * q) S and (exp(b) * k) S: gradients of the decayed queries and keys.
        d_decayed = einsum("rhiv,rhkv->rhik", jnp.concatenate([do_n, -dv_n], axis=-2), state)
        dq_decayed, dk_decayed = d_decayed[..., :C, :], d_decayed[..., C:, :]
        dk_to_end = einsum("rhjv,rhkv->rhjk", w.delta, dstate)
        dq_n = dq_pairs + decay * dq_decayed
        dk_n = dk_pairs + decay * dk_decayed + decay_to_end * dk_to_end
        dg_n = intra.decays_backward(intra.DecayCotangents(
            later=d_later, earlier=d_earlier,
            to_token=x.of_gate_width((c.q * decay) * dq_decayed + (c.k * decay) * dk_decayed),
            to_end=x.of_gate_width(key_to_end * dk_to_end),
            whole=c.decays.whole * x.of_gate_width(jnp.sum(state * dstate, axis=-1)[..., None, :]),
        ))

        dq_n = _to_key_heads(dq_n, x.groups) * x.scale
        dk_n = _to_key_heads(dk_n, x.groups)
        if x.use_qk_l2norm:
            dq_n = _l2norm_backward(c.q_heads, c.q_norm, dq_n)
            dk_n = _l2norm_backward(c.k_heads, c.k_norm, dk_n)
        grads = (put(dq, n, dq_n, C), put(dk, n, dk_n, C), put(dv, n, dv_n, C), put(dg, n, dg_n, C),
                 put(dbeta, n, dbeta_n, C))
        dstate = (c.decays.whole[..., 0, :, None] * dstate
                  + einsum("rhik,rhiv->rhkv", jnp.concatenate([c.q * decay, c.k * decay], axis=-2),
                           jnp.concatenate([do_n, -dv_n], axis=-2)))
        return dstate, grads

    grads, dh0 = reverse_sweep(x.layout, dht, jnp.zeros((R, HV, K, V), x.dtype), step, grads)
    return (*grads, dh0)
