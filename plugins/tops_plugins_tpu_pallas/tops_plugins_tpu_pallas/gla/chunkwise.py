"""What one chunk of gla does inside the kernel: kda's per-key decays and query pairs (``kda/chunkwise.py``) without the
delta rule. With ``b`` the chunk's cumulative log decays per token and key, ``q`` times ``scale`` and ``S`` the state
entering the chunk::

    Aqk[i, j] = sum_d q[i, d] k[j, d] exp(b[i, d] - b[j, d])              (j <= i)
    o     = (exp(b) * q) S + Aqk v
    S_out = exp(b_C) * S + (exp(b_C - b) * k)^T v

``Aqk`` is kda's, level by level along the halving (no decay is ever ``exp`` of a positive exponent, however strong the
gates), each level streaming the later half's query rows only; there is no ``Akk`` and no inverse, and the writes are
the values themselves.

**Mild chunks.** Where every chunk of a grid step decays by at most ``exp(-MILD_LOG_DECAY)`` in every key (gla's usual
gates, ``log_sigmoid(x) / 16``, decay by about ``exp(-3)`` over 64 tokens), the step takes kda's bounded form with one
sub-chunk as wide as the chunk instead: the exponents ``e`` around the chunk's middle lie in ``[-40, 40]``, as the
bounded path's budget (``FINE_EXPONENT_LIMIT``) asks, so ``Aqk`` is one masked product of ``q exp(e)`` and
``k exp(-e)``, with no levels and their run sums. Where the chunks are not mild but every 32 tokens are, the step
takes the bounded form's sub-chunks of 32 with exact levels above them (``kda.chunkwise.by_mildness``, in the forward
kernel, the checkpoints walk and the gradients kernel). The kernel tests the step's ``g`` and takes one of the three;
a stronger decay, or a gate of ``-inf``, takes the halving.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from tops_plugins_tpu_pallas.grid import Work
from tops_plugins_tpu_pallas.kda.chunkwise import (
    Decays, Factors, by_mildness, chunk_body_vmem, decay_work, interleaved_pairs, level_rows, level_sizes, run_sum_parts,
)
from tops_plugins_tpu_pallas.layout import Geometry
from tops_plugins_tpu_pallas.mxu import COLUMNS_BY_COLUMNS, matmul
from tops_plugins_tpu_pallas.recurrence import Recurrence

_F32 = jnp.float32


def chunk_factors(chunks, *, operands, fine_size: int | None = None, inverses=None) -> list[Factors]:
    """Every chunk's decays, then every chunk's ``Aqk`` (kda's ``interleaved_pairs`` without the delta rule), from ``(q, k,
    g, beta, resets)`` each (``beta`` None; ``resets`` None or a packed chunk's sequence starts); ``fine_size``: None
    (the halving), the chunk's size (a mild step's one product) or a mild step's sub-chunk
    (``kda.chunkwise.by_mildness``); ``inverses`` unused (gla has no inverse)."""
    del inverses
    every_resets = [resets for *_, resets in chunks]
    decays = Decays.of_chunks([g for _, _, g, _, _ in chunks], fine_size, every_resets, run_sum_parts(operands))
    every_pairs = interleaved_pairs(
        [(q, k, None, d, resets) for (q, k, _, _, _), d, resets in zip(chunks, decays, every_resets)], operands, delta_rule=False,
    )
    return [Factors(d.to_token, d.to_end, d.whole, p.aqk, None) for d, p in zip(decays, every_pairs)]


def ahead_of_state(q, k, v, beta, factors: Factors, operands) -> Factors:
    """``factors`` with ``ahead``: ``(k * to_end)^T v``, what the chunk adds to the state, and ``Aqk v`` (None without the
    queries), neither of which depends on the state. Written before the chain, they keep the MXU busy while the state's
    own link (``whole * S`` plus the first) waits on the VPU, where written inside it each held the next chunk's ``q S``."""
    del beta
    v = v.astype(_F32)
    writes = matmul(k * factors.to_end, v, operands, COLUMNS_BY_COLUMNS)
    return dataclasses.replace(factors, ahead=(writes, None if q is None else matmul(factors.aqk, v, operands)))


def through_state(q, k, v, beta, state, entering, factors: Factors, operands):
    """``(o, S_out, v)`` of one chunk from the state entering it and its ``factors`` (the writes are ``v``, float32).

    ``entering``: None, or a packed chunk's initial-state terms ``(keys, queries, leaving)`` (``kda.sequences``; ``keys``,
    the delta rule's, unused) added to ``o`` and ``S_out``. ``q`` None: no ``o`` (None), the states alone."""
    if factors.ahead is None:
        factors = ahead_of_state(q, k, v, beta, factors, operands)
    writes, intra = factors.ahead
    state_out = factors.whole * state + writes + (0.0 if entering is None else entering[2])
    if q is None:
        return None, state_out, v.astype(_F32)
    o = matmul(q * factors.to_token, state, operands) + intra
    if entering is not None:
        o = o + entering[1]
    return o, state_out, v.astype(_F32)


def chunk_work(geometry: Geometry, use_qk_l2norm: bool = False, lower_bound: float | None = None, packed: bool = False) -> Work:
    """One chunk's ``chunk_factors`` and ``through_state`` for one value block, counted op by op: the decays (kda's
    ``decay_work``), one ``C x K @ K x C`` product per level, the state's three products and ``Aqk v``.
    ``use_qk_l2norm``, ``lower_bound`` and ``packed`` change none of it."""
    del use_qk_l2norm, lower_bound, packed
    C, K, Vb = geometry.chunk_size, geometry.padded_key_dim, geometry.value_block
    pairs = sum(2 * level_rows(C, s) * K * C for s in level_sizes(C))
    outputs = 2 * C * K * Vb + 2 * C * C * Vb + 2 * C * K * Vb
    return decay_work(C, K, level_sizes(C), None) + Work(flops=pairs + outputs)


def kept_vmem(geometry: Geometry, lower_bound: float | None = None) -> int:
    """An upper estimate of what each chunk of a grid step keeps from its decays to its turn at the state (bytes): float32
    ``q``, ``k``, ``v``, the three decays, ``Aqk``, and what ``ahead_of_state`` computes from them before the chain (the
    writes ``K x value block``, ``Aqk v``). (Its working values are kda's ``chunk_body_vmem``, which holds more: its
    ``Akk`` and inverse besides.)"""
    del lower_bound
    C, K, Vb = geometry.chunk_size, geometry.padded_key_dim, geometry.value_block
    return 4 * (5 * C * K + C * Vb + C * C + K * Vb + C * Vb)


GLA = Recurrence(
    op="gla", gate_per_key=True, delta_rule=False, factors=chunk_factors, through_state=through_state, chunk_work=chunk_work,
    chunk_body_vmem=chunk_body_vmem, kept_vmem=kept_vmem, arms=by_mildness, ahead=ahead_of_state, fast_walk=True,
    fast_gradients=True,
)
