"""A sequence split over devices, for the ops whose state decays diagonally: simple_gla (one decay per head and
token, ``g + g_gamma``) and gla (one per key, ``g``). Every device runs its block; devices exchange states only.

Device ``p`` of ``P`` holds tokens ``[p L, (p + 1) L)`` of every batch row (with ``cu_seqlens``,
of the one packed row). The state update is affine in the state, so what a device does to a state
carried in is a map ``S -> diag(Gamma_p) S + S_p``: ``Gamma_p`` the total decay of its tokens (per head, or per
head and key) when one sequence covers the whole block and continues from the device before (else 0: the carried
state stops at a sequence boundary), ``S_p`` the state its last sequence segment reaches from its own
start (zero, or that sequence's ``initial_state`` when it starts here). Composing the maps of the
devices before ``p`` (``exclusive_affine_scan``, ``ceil(log2 P) + 1`` exchanges of one
``[B, H, K, V]`` state) gives the state ``S_in(p)`` carried into ``p``. The ordinary op then runs
on the block with it as the initial state of the sequence that continues into the block, with
boundaries clipped to the block: its outputs are exact, and so is the final state of every
sequence that ends in the block (the device holding a sequence's last token owns its final state).

The backward is the same in reverse. The cotangent of the carried state, ``dS_in(p)``, is
``U_p + diag(Gamma_p) dS_in(p + 1)`` while the sequence continues out of the block, with
``U_p = sum over the first segment of scale (exp(A_t) q_t)^T do_t`` (plus the decayed ``dht`` when
that sequence ends in the block), ``A_t`` the cumulative log decay from the block's start. A
reverse scan gives every device the cotangent of the state it passes on; one ordinary backward on
the block, with ``S_in(p)`` as initial state and that cotangent as the ``dht`` of the sequence
continuing out, then gives exact ``dq, dk, dv, dg`` for the block, ``dinitial_state`` for the
sequences starting in it, and the block's share of ``dg_gamma`` (simple_gla).

The extra work per device is two ``[L, K] x [L, V]`` products (the state of the last segment, and
``U_p`` in the backward), computed here in ``jax.numpy``; only differences of cumulative decays
that are sums of the segment's own log decays are exponentiated, masked before ``exp``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tops_core.ops import sequence_blocks
from tops_core.ops.base import Prepared, state_dtype
from tops_core.ops.sequence_blocks import Block
from tops_core.partitioning import SequenceShards, exclusive_affine_scan, per_row


def _log_decays(arrays: dict[str, Any], dtype: Any) -> jax.Array:
    """The log decay of every token in the accumulation dtype: simple_gla's ``g + g_gamma`` ``[B, L, H]`` (zero where
    neither is given), or gla's ``g`` ``[B, L, H, K]``."""
    B, L, H, K = arrays["q"].shape
    g, g_gamma = arrays["g"], arrays.get("g_gamma")
    a = jnp.zeros((B, L, H) + ((K,) if g is not None and g.ndim == 4 else ()), dtype)
    if g is not None:
        a = a + g.astype(dtype)
    if g_gamma is not None:
        a = a + g_gamma.astype(dtype)
    return a


def _weighted_outer(x: jax.Array, weights: jax.Array, y: jax.Array, dtype: Any) -> jax.Array:
    """``sum over t of (weights_t x_t)^T y_t`` per row and head, ``[B, H, K, V]``, accumulated in ``dtype``; ``weights``
    ``[B, L, H]`` or, one per key, ``[B, L, H, K]``."""
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 and jnp.dtype(x.dtype).itemsize >= 4 else None
    return jnp.einsum(
        "blhk,blhv->bhkv", x.astype(dtype) * per_row(weights, x), y.astype(dtype), precision=precision, preferred_element_type=dtype,
    )


def _at(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x[b, index[b]]`` for ``x`` ``[B, L, ...]``."""
    return jnp.take_along_axis(x, per_row(index, x), axis=1)[:, 0]


def _carried_in(arrays: dict[str, Any], block: Block, decays: jax.Array, shards: SequenceShards) -> jax.Array:
    """``[B, H, K, V]``: the state carried into this block from the devices before (for rows that continue in)."""
    dtype = decays.dtype
    suffix = jnp.cumsum(decays[:, ::-1], axis=1)[:, ::-1]  # sum of a_u for u >= t
    after = jnp.concatenate([suffix[:, 1:], jnp.zeros_like(suffix[:, :1])], axis=1)  # u > t
    in_last = per_row(jnp.arange(block.length)[None, :] >= block.last_start[:, None], decays)
    weights = jnp.where(in_last, jnp.exp(jnp.where(in_last, after, 0.0)), 0.0)
    state = _weighted_outer(arrays["k"], weights, arrays["v"], dtype)
    segment_decay = jnp.exp(_at(suffix, block.last_start))
    initial_state = arrays["initial_state"]
    covered = per_row(block.covered, segment_decay)
    if initial_state is not None:  # the last segment's sequence starts here, from its initial state
        starting = initial_state[block.last_seq].astype(dtype)
        state = state + per_row(jnp.where(covered, 0.0, segment_decay), starting) * starting
    carried = exclusive_affine_scan(jnp.where(covered, segment_decay, 0.0), state, shards)
    return jnp.where(per_row(block.crosses_in, carried), carried, 0.0)


def forward(arrays: dict[str, Any], prepared: Prepared, shards: SequenceShards, run: Any) -> tuple[Any, Any]:
    """This device's ``o`` and its share of the final states."""
    B, L = arrays["q"].shape[:2]
    block = Block.of(B, L, arrays["cu_seqlens"], shards)
    carried = _carried_in(arrays, block, _log_decays(arrays, state_dtype(arrays["q"].dtype)), shards)
    return sequence_blocks.forward(arrays, block, carried, prepared.option("output_final_state"), shards, run)


def backward(arrays: dict[str, Any], cotangents: tuple[Any, ...], prepared: Prepared, shards: SequenceShards, run: Any) -> Any:
    """This device's ``dq, dk, dv, dg`` and its shares of ``dg_gamma`` (simple_gla) and ``dinitial_state``."""
    do, dht = cotangents
    B, L = arrays["q"].shape[:2]
    dtype = state_dtype(arrays["q"].dtype)
    block = Block.of(B, L, arrays["cu_seqlens"], shards)
    decays = _log_decays(arrays, dtype)
    carried = _carried_in(arrays, block, decays, shards)

    prefix = jnp.cumsum(decays, axis=1)  # A_t from the block's start, t inclusive
    in_first = per_row(jnp.arange(L)[None, :] < block.first_end[:, None], decays)
    weights = jnp.where(in_first, jnp.exp(jnp.where(in_first, prefix, 0.0)), 0.0)
    into_state = prepared.option("scale") * _weighted_outer(arrays["q"], weights, do, dtype)  # U_p
    first_decay = jnp.exp(_at(prefix, jnp.maximum(block.first_end - 1, 0)))
    if dht is not None:  # the first segment's sequence ends in the block: its dht flows back through the segment
        ends = (block.first_end < L) | ~block.crosses_out
        ending = dht[block.first_seq].astype(dtype)
        into_state = into_state + per_row(jnp.where(per_row(ends, first_decay), first_decay, 0.0), ending) * ending
    through = jnp.where(per_row(block.covered & block.crosses_out, first_decay), first_decay, 0.0)
    passed_on = exclusive_affine_scan(through, into_state, shards, reverse=True)
    passed_on = jnp.where(per_row(block.crosses_out, passed_on), passed_on, 0.0)
    return sequence_blocks.backward(arrays, block, carried, passed_on, do, dht, shards, run)
