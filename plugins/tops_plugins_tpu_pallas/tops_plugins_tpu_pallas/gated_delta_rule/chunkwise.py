"""What one chunk of gated_delta_rule does inside the kernel: kda's delta rule (``kda/chunkwise.py``) with one gate per
head and token, whose decays are simple_gla's (``simple_gla/chunkwise.py``).

With one log decay per token, ``exp(b_i - b_j)`` is one number per pair of tokens: ``ChunkGates`` gives it as a
``C x C`` matrix (exactly 0 above the diagonal and across a gate of ``-inf``, never ``exp`` of a positive exponent),
with ``exp(b_i)``, ``exp(b_C - b_j)`` and ``exp(b_C)`` as columns. So both pair matrices come from one product of
the chunk's rows, masked by it::

    [Akk; Aqk] = ([k; q] k^T) * decays           (Akk strictly below the diagonal)

where kda builds them level by level from per-key decays. The inverse of ``I + diag(beta) Akk`` is kda's exact one
(``exact_inverses``, blocked forward substitution along the halving levels), and the way through the state is kda's
``through_state``, the decays broadcast over the keys. A grid step whose every gate is finite (any model's) takes
decays that count no ``-inf`` gates apart (``by_finiteness``).

At chunks of 128 and more the kernels read ``g`` laid out ``[B, HV, T]`` (``GATED_DELTA_RULE.gates_along_lanes``), and
``chunk_factors`` takes a grid step's log decays at once from its chunks' rows (``LogDecays.of_rows``): one MXU pass
for every chunk's cumulative sum, whose weights (the triangle) load once, and each chunk's column from one transpose.
Cycles one TensorCore issues at the bench's shape on v6e (any gates / finite gates), each chunk's own gates -> a
step's at once: forward 325248 -> 294562 / 294432 -> 277746, checkpoints walk 288468 -> 256102 / 255316 -> 238518,
gradients kernel 679465 -> 595185 / 639097 -> 560897.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from tops_core.tpu import fast_paths

from tops_plugins_tpu_pallas.grid import Work
from tops_plugins_tpu_pallas.kda.chunkwise import (
    Factors, ahead_of_walk, inverse_work, inverses_of_strictly_lower, level_sizes, through_state, walked_link,
)
from tops_plugins_tpu_pallas.layout import LANES, Geometry
from tops_plugins_tpu_pallas.mxu import ROWS_BY_ROWS, matmul, row_and_column_iotas
from tops_plugins_tpu_pallas.recurrence import Recurrence
from tops_plugins_tpu_pallas.simple_gla.chunkwise import ChunkGates, LogDecays


def chunk_factors(chunks, *, operands, fine_size: int | None = None, inverses=None) -> list[Factors]:
    """kda's ``chunk_factors`` for gates per head: ``(q, k, g, beta, resets)`` each, ``g`` float32 (0 past the end of
    the sequence, ``-inf`` a reset, as a packed chunk's ``resets`` rows are) a ``(1, C)`` row where the kernels read
    gates along lanes (``GATED_DELTA_RULE.gates_along_lanes``: the step's log decays at once, ``LogDecays.of_rows``),
    else a ``(C, 1)`` column, and ``resets`` laid out as ``g``; ``q`` None: no ``Aqk``; ``inverses`` where known,
    ``kda.chunkwise.inverses_of``. No decay can overflow, so ``fine_size`` is not a sub-chunk here but the arm
    ``by_finiteness`` chose: the chunk's size where every gate is finite and no sequence starts (the decays from the
    cumulative sums alone), None where ``-inf`` gates may lie (counted apart, ``LogDecays``)."""
    C = chunks[0][1].shape[0]
    counts_resets = fine_size is None
    i, j = row_and_column_iotas(C)
    gs = [g if resets is None else jnp.where(resets, -jnp.inf, g) for _, _, g, _, resets in chunks]
    if GATED_DELTA_RULE.gates_along_lanes(C):
        every_log = LogDecays.of_rows(jnp.concatenate(gs, axis=0), counts_resets)
    else:
        every_log = [LogDecays.compute(0.0, g, None, C, counts_resets) for g in gs]
    gates, aqk, every_n = [], [], []
    for (q, k, _, beta, _), log in zip(chunks, every_log):
        own = ChunkGates.of(_column_across_lanes(log, k.shape[1]))
        products = matmul(k if q is None else jnp.concatenate([k, q], axis=0), k, operands, ROWS_BY_ROWS)
        beta_akk = beta * jnp.where(j < i, products[:C] * own.decays, 0.0)
        gates.append(own)
        aqk.append(None if q is None else products[C:] * own.decays)
        every_n.append(beta_akk)
    inverses = inverses_of_strictly_lower(tuple(every_n), operands, None if inverses is None else tuple(inverses))
    return [
        Factors(to_token=own.query, to_end=own.key, whole=own.chunk, aqk=a, inverse=d, pairs=n)
        for own, a, d, n in zip(gates, aqk, inverses, every_n)
    ]


def _column_across_lanes(log: LogDecays, key_dim: int) -> LogDecays:
    """``log`` with its column ``B`` broadcast along the lanes once, ``(C, C)``, where the chunk and its keys are one row
    of lanes wide (``C = K_pad = 128``, the kernels' chunk): the decays, ``exp(b)`` and ``exp(b_C - b)`` (which scale
    ``(C, K_pad)`` queries and keys) then take it as it is (``b_C`` its last row, so ``b_C - b`` is lane by lane too),
    and the VJP adds their cotangents lane by lane and takes one lane sum for ``dB``, where a ``(C, 1)`` column took one
    per use. It costs the forward nothing (a column takes a register per 8 rows either way); the gradients kernel on
    v6e (cycles, finite gates, in the backward's program) 487262 -> 462189."""
    C = log.column.shape[0]
    if C != LANES or key_dim != LANES:
        return log
    return dataclasses.replace(log, column=jnp.broadcast_to(log.column, (C, C)))


FINITE_GATES = "finite gates"
"""The fast arm's name (``tops_core.tpu.fast_paths``) of a step whose every gate is finite."""


def by_finiteness(gs, step, fine_size: int | None, fast: bool, resets=None):
    """``step(C)`` where every gate ``g`` (``(C, 1)`` each) of the grid step is finite (``FINITE_GATES``), else
    ``step(fine_size)`` (None: ``-inf`` gates counted apart, ``LogDecays``): a model's gates are finite, and counting
    what no gate holds cost a quarter of the gate's work (the forward kernel on v6e, modelled: 321578 -> 292554
    cycles without it). A packed chunk's sequence starts (``resets``, ``(C, 1)`` bool each, or None) are ``-inf``
    gates: a packed step takes the fast arm where no sequence starts in it. Not for a differentiated caller
    (``kda.chunkwise.by_mildness``)."""
    if not fast:
        return step(fine_size)
    if resets is not None and any(r is not None for r in resets):
        gs = [g if r is None else jnp.where(r, -jnp.inf, g) for g, r in zip(gs, resets)]
    finite = jnp.all(jnp.stack([jnp.min(g) for g in gs]) > -jnp.inf)  # false for NaN too
    return fast_paths.choose(finite, lambda: step(gs[0].shape[0]), lambda: step(fine_size), arm=FINITE_GATES)


def chunk_work(geometry: Geometry, use_qk_l2norm: bool, lower_bound: float | None = None, packed: bool = False) -> Work:
    """One chunk's ``chunk_factors`` and ``through_state`` for one value block, counted op by op: the cumulative sum (gates
    along lanes: four rows, ``g``'s three bf16 parts and its resets, by a ``C x C`` triangle, in the step's one product;
    else the triangle by a ``C x 128`` operand), the pair products, the inverse's levels,
    the state's products; the exps of the decays and, with ``use_qk_l2norm``, the norms' square roots. ``lower_bound``
    and ``packed`` change none of it."""
    del lower_bound, packed
    C, K, Vb = geometry.chunk_size, geometry.padded_key_dim, geometry.value_block
    cumulative = 2 * 4 * C * C if GATED_DELTA_RULE.gates_along_lanes(C) else 2 * C * C * LANES
    pairs = 2 * (2 * C) * K * C
    outputs = 2 * (2 * C) * K * Vb + 2 * C * C * Vb + 2 * C * C * Vb + 2 * C * K * Vb
    exps = C * C + 2 * C + 1 + (2 * C if use_qk_l2norm else 0)
    return inverse_work(C) + Work(flops=cumulative + pairs + outputs, transcendentals=exps)


def chunk_body_vmem(geometry: Geometry, lower_bound: float | None = None) -> int:
    """An upper estimate of one chunk's working values (bytes): the cumulative sum's ``C x 128`` operand, the pair
    products ``2C x C``, every level's pairs and the inverse's products, decayed ``q`` and ``k``, the state in and out,
    four ``C x value block`` values."""
    del lower_bound
    C, K, Vb = geometry.chunk_size, geometry.padded_key_dim, geometry.value_block
    levels = len(level_sizes(C))
    return 4 * (2 * C * LANES + (2 + levels + 4) * C * C + 4 * C * K + 2 * K * Vb + 4 * C * Vb)


def kept_vmem(geometry: Geometry, lower_bound: float | None = None) -> int:
    """An upper estimate of what each chunk of a grid step keeps until its turn at the state (bytes): float32 ``q``, ``k``,
    ``v``, ``Aqk``, the inverse, the decays and their columns."""
    del lower_bound
    C, K, Vb = geometry.chunk_size, geometry.padded_key_dim, geometry.value_block
    return 4 * (2 * C * K + C * Vb + 3 * C * C + 3 * C * LANES)


GATED_DELTA_RULE = Recurrence(
    op="gated_delta_rule", gate_per_key=False, delta_rule=True, factors=chunk_factors, through_state=through_state,
    walked_link=walked_link, chunk_work=chunk_work, chunk_body_vmem=chunk_body_vmem, kept_vmem=kept_vmem, arms=by_finiteness,
    ahead=ahead_of_walk, fast_walk=True, fast_gradients=True,
)
