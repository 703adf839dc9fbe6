"""What one chunk of KDA does inside the kernel: decays, pair products, the exact inverse, outputs and state.

Per key ``d``, ``b[i, d] = g[1, d] + ... + g[i, d]`` is token ``i``'s cumulative log decay inside
the chunk. With ``q`` normalised when asked and times ``scale``, and ``S`` the float32 state
entering the chunk (``K x value block``), the delta rule's writes ``delta`` solve a unit
lower-triangular system (the derivation is xla.chunk's, in the xla plugin)::

    Akk[i, j] = sum_d k[i, d] k[j, d] exp(b[i, d] - b[j, d])              (j <  i)
    Aqk[i, j] = sum_d q[i, d] k[j, d] exp(b[i, d] - b[j, d])              (j <= i)
    (I + diag(beta) Akk) delta = beta * (v - (exp(b) * k) S)
    o     = (exp(b) * q) S + Aqk delta
    S_out = exp(b_C) * S + (exp(b_C - b) * k)^T delta

**Halving levels.** With one decay per key the decay does not factor out of the sum over ``d``,
and factoring it around a single point per chunk overflows (``exp`` of up to ``-b_C``: 640 at
``g = -10`` and chunk 64). So the pairs ``j < i`` are split by levels: at level ``s`` (1, 2, 4,
... ``C/2``) every block of ``2s`` tokens pairs its later half ``i`` with its earlier half ``j``,
around the point ``r``, the earlier half's last token. Both factors, ``exp(b_i - b_r)`` and
``exp(b_r - b_j)``, are then decays over tokens in time order (at most 1 for gates ``<= 0``), so
nothing overflows; each pair ``j < i`` belongs to exactly one level. A level is one
``(2C x K) @ (K x C)`` matmul over the whole chunk (later-half rows of ``k`` and ``q`` against
earlier-half rows of ``k``), masked to pairs inside one block.

**Exponents without cancellation.** Every exponent is a sum of ``g`` over a run of tokens inside
the chunk: ``b_i`` (from the chunk start), ``b_C - b_j`` (after ``j`` to the end) and, per level,
``b_i - b_r`` for the later half and ``b_r - b_j`` for the earlier half (one section: a token lies in one
half, so its row holds the run it needs). The runs inside each group of 8 tokens are one matmul of 0/1
run masks with ``g`` (``run_sums``: as exact as float32 with float32 inputs, to ``2**-17`` with narrower
ones, ``run_sum_parts``), and the longer runs' decays are products of whole groups' decays on the VPU
(``decay_sections``); none is a difference of two large cumulative sums, so a decay near 1 keeps float32
accuracy however large ``|b|`` grows. Rows a mask leaves empty get exponent 0, never a positive one.

**Resets.** A gate of ``-inf`` (``exp(-inf) = 0``: the key's row of the state is reset) would make the
masks' zeros times ``-inf`` NaN. It is taken as ``exponents.RESET_LOG_DECAY`` (``-2**100``) instead:
exponents here are only ever sums, never differences, so a run that holds it sums to ``-2**100`` or
below, whose ``exp`` is exactly 0, and every other run is untouched.

**The inverse**, exactly, along the same levels: with ``D_s`` the inverse of ``I + diag(beta) Akk``
restricted to blocks of ``s`` tokens (``D_1 = I``) and ``P_s`` the level-``s`` pairs of
``diag(beta) Akk``, ``D_2s = D_s - D_s P_s D_s`` (the inverse of ``[[A, 0], [C, D]]`` is
``[[A^-1, 0], [-D^-1 C A^-1, D^-1]]``). Blocked forward substitution; no truncated series. ``D_2 = I - P_1``
takes no product. The chain of ``2 log2 C - 2`` dependent products per chunk is what bounds a chunk's time
on the MXU's latency, so a grid step's chunks compute their pairs and then their inverses together, level by
level (``interleaved_pairs``, ``exact_inverses``), before the state's own chain through them (``chunk_steps``).

**Bounded gates** (``lower_bound = L``: every ``g >= L``, fla's ``safe_gate``). Over a sub-chunk of
``s`` tokens a decay relative to a point inside it is then at most ``exp(|L| s)``. With ``s`` the
largest power of two with ``|L| s <= 80`` (``fine_block_size``; 16 at Kimi Linear's ``L = -5``) and
the point ``r`` the middle of the sub-chunk (its first half's last token), every exponent
``e_i = b_i - b_r`` lies in ``[-40, 40]``: ``exp(+-e)`` is finite and far from float32's
subnormals, whose low bf16 parts a TPU would flush. With bf16 operands and ``q``, ``k`` normalised
(``wide_sub_chunks``) the forward's walk doubles it, ``|L| s <= 160`` (32 at ``L = -5``, one coarse
level fewer): its factors reach ``exp(+-80)``, below float32's largest number times any normalised row,
and what a flushed subnormal operand would lose is below ``2**-126 exp(75)``, ``4e-6`` of a pair's
scale, against bf16's rounding of ``2**-9``. Pairs the mask discards may then overflow to ``inf``;
the mask is a select, so none reaches a kept pair. All pairs inside one sub-chunk are then one
plain masked matmul of decayed keys, ``Akk[i, j] = sum_d (k[i, d] exp(e_i)) (k[j, d] exp(-e_j))``
(``Aqk`` likewise with ``q``'s rows), replacing the levels ``1 .. s/2`` and their run-sum sections
by one section (``e``, a run of signed masks: ``+g`` after ``r``, ``-g`` up to it, never both in a
row, so still no cancellation); the levels ``s .. C/2`` stay as they are. The inverse keeps its
exact recursion: the fine levels' ``P_t`` are masks of the one sub-chunk matrix. A packed call
resets the state at sequence starts (``resets``): those rows are ``RESET_LOG_DECAY`` for every
run sum but ``e``, which runs over the gate as given (finite, ``>= L``), and pairs with a start in
``(j, i]`` (``crossings``, a 0/1 matmul) are masked to zero, so every reset is still exact. Where a packed
sequence's own initial state enters and its final state leaves: ``kda/sequences.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tops_core.ops.kda import L2NORM_EPSILON
from tops_core.tpu import fast_paths
from tops_plugins_tpu_pallas.exponents import RESET_LOG_DECAY
from tops_plugins_tpu_pallas.grid import Work
from tops_plugins_tpu_pallas.mxu import (
    COLUMNS_BY_COLUMNS, ROWS_BY_ROWS, bf16_parts, known_product, matmul, mxu_operand_dtype, row_and_column_iotas,
)
from tops_plugins_tpu_pallas.layout import LANES, SUBLANES, Geometry
from tops_plugins_tpu_pallas.recurrence import Recurrence

_F32 = jnp.float32



FINE_EXPONENT_LIMIT = 80.0
"""``|L| s`` at most this: the bounded path's sub-chunk decays stay within ``exp(+-40)`` around its middle."""

WIDE_FINE_EXPONENT_LIMIT = 160.0
"""``|L| s`` at most this where ``wide_sub_chunks``: decays within ``exp(+-80)``, finite times any row of norm 1 (and
times a query's ``scale`` of at most 1), whose flushed subnormals lose less than bf16 operands round away."""


def wide_sub_chunks(operands, use_qk_l2norm: bool, scale: float) -> bool:
    """Whether the bounded path's sub-chunks may span ``WIDE_FINE_EXPONENT_LIMIT``: bf16 MXU operands and ``q``, ``k``
    normalised, ``|scale| <= 1``. Not for float32 operands, whose low bf16 parts at HIGHEST would go subnormal (and be
    flushed) near ``exp(-80)``, a loss near their tolerance; not for unnormalised rows, which ``exp(80)`` could
    overflow. The forward's walk only (``chunk_steps``): the backward's gradients kernel keeps the narrow sub-chunks,
    where its VJP of ``e`` over 32 tokens lost half as much again of ``ddt_bias``'s accuracy (over its tolerance on one
    input in twelve). Modelled at the bench's
    shape with ``use_qk_l2norm, use_gate, A_log, lower_bound = -5`` (2026-12-07): the forward kernel 373296 -> 362992
    cycles on v6e and 562868 -> 550388 on v5e, the backward's checkpoints walk 314578 -> 309714 and 475091 -> 469011."""
    return jnp.dtype(operands) == jnp.bfloat16 and use_qk_l2norm and abs(scale) <= 1


def level_sizes(chunk_size: int) -> tuple[int, ...]:
    """Half-block sizes of the levels, finest first: 1, 2, ..., chunk_size / 2."""
    return tuple(1 << n for n in range(chunk_size.bit_length() - 1))


def fine_block_size(chunk_size: int, lower_bound: float | None, wide: bool = False) -> int | None:
    """The bounded path's sub-chunk: the largest power of two ``s <= chunk_size`` with ``|lower_bound| s <= 80`` (160
    when ``wide``: ``wide_sub_chunks``), or None (the exact path) without a bound or where ``s`` would be 1 (no pair
    inside a sub-chunk)."""
    if lower_bound is None:
        return None
    limit = WIDE_FINE_EXPONENT_LIMIT if wide else FINE_EXPONENT_LIMIT
    size = 1
    while 2 * size <= chunk_size and -lower_bound * 2 * size <= limit:
        size *= 2
    return size if size >= 2 else None


def sub_chunk_size(chunk_size: int, lower_bound: float | None, operands, *, use_qk_l2norm: bool, scale: float) -> int | None:
    """A call's bounded sub-chunk (``fine_block_size`` at the budget ``wide_sub_chunks`` allows), or None: what
    ``chunk_steps`` (the forward's kernel, the backward's walk for the states) passes the recurrence's ``factors``."""
    return fine_block_size(chunk_size, lower_bound, wide_sub_chunks(operands, use_qk_l2norm, scale))


def coarse_level_sizes(chunk_size: int, fine_size: int | None) -> tuple[int, ...]:
    """The levels computed as levels: all of them on the exact path, ``fine_size .. C/2`` on the bounded one."""
    return tuple(s for s in level_sizes(chunk_size) if fine_size is None or s >= fine_size)


def _block(index: jax.Array, size: int) -> jax.Array:
    """Which block of ``size`` tokens (a power of two) ``index`` lies in."""
    return lax.shift_right_logical(index, jnp.int32(size.bit_length() - 1))


def _in_later_half(index: jax.Array, size: int) -> jax.Array:
    """Whether ``index`` is in the later half of its block of ``2 * size`` tokens."""
    return (_block(index, size) & 1) == 1


def _group_run_masks(chunk_size: int, group: int, sizes: tuple[int, ...], fine_size: int | None) -> jax.Array:
    """0/1 (and for ``e``, signed) rows, ``C`` per section: row ``i`` of each section sums ``g`` over one run of tokens
    inside ``i``'s group of ``group`` tokens (``decay_sections`` builds the longer runs' decays from them).

    Sections: ``P_G``, the run from the group's first token to ``i`` inclusive, and ``X_G``, from after ``i`` to the
    group's last token; per level of ``sizes`` below the group the run between the level's point ``r`` and ``i``:
    ``(r, i]`` for a later-half token (``b_i - b_r``), ``(i, r]`` for an earlier-half one (``b_r - b_i``; a token is in
    one half only, so one section serves both factors); then ``e`` (``_fine_mask``) where its sub-chunk fits the group.
    """
    i, t = row_and_column_iotas(chunk_size)
    same_group = _block(i, group) == _block(t, group)
    sections = [same_group & (t <= i), same_group & (t > i)]
    for s in sizes:
        if s < group:
            same_half = _block(i, s) == _block(t, s)
            sections.append(same_half & jnp.where(_in_later_half(i, s), t <= i, t > i))
    masks = jnp.concatenate([m.astype(_F32) for m in sections], axis=0)
    if fine_size is not None and fine_size <= group:
        masks = jnp.concatenate([masks, _fine_mask(chunk_size, fine_size)], axis=0)
    return masks


def _doubled_runs(prefix: jax.Array, suffix: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """``(P_2s, X_2s)`` from ``(P_s, X_s)``: the decays of each token's run from its ``s``-segment's first token to itself
    (inclusive) and from after it to the segment's last token. A later half's prefix takes in its earlier half's whole
    run (that half's last ``P_s`` row), an earlier half's suffix its later half's: products of decays, never a quotient.
    ``s`` a multiple of a vector register's rows, so every slice is whole registers and each whole run one row broadcast."""
    doubled_prefix, doubled_suffix = [], []
    for start in range(0, prefix.shape[0], 2 * size):
        middle, end = start + size, start + 2 * size
        doubled_prefix += [prefix[start:middle], prefix[middle:end] * prefix[middle - 1 : middle]]
        doubled_suffix += [suffix[start:middle] * prefix[end - 1 : end], suffix[middle:end]]
    return jnp.concatenate(doubled_prefix, axis=0), jnp.concatenate(doubled_suffix, axis=0)


def _by_halves(earlier: jax.Array, later: jax.Array, size: int) -> jax.Array:
    """``earlier``'s rows in the earlier half of every ``2 * size``-token block, ``later``'s in the later half."""
    return jnp.concatenate(
        [piece for start in range(0, earlier.shape[0], 2 * size) for piece in (earlier[start : start + size], later[start + size : start + 2 * size])],
        axis=0,
    )


def decay_sections(
    g: jax.Array, sizes: tuple[int, ...], fine_size: int | None, parts: int, exponents: bool = True,
) -> tuple[jax.Array, jax.Array | None]:
    """``exp`` of the run sums, ``(2 + len(sizes)) * C x K``: per token and key ``exp(b_i)``, ``exp(b_C - b_i)`` and one
    section per level of ``sizes`` (the run between the level's point and the token); and, with ``fine_size`` and
    ``exponents``, the bounded path's exponents ``e`` (``C x K``, not exponentiated: it needs ``exp(-e)`` too), or None
    (a packed chunk's ``e`` must not sum its resets' stand-in gates: ``Decays.of_chunks`` sums it apart).

    The MXU sums the runs inside each group of tokens (one float32 vector register's rows, the bounded path's
    sub-chunk, or with no levels the whole chunk: ``_run_group``; ``_group_run_masks``),
    ``parts`` exact bf16 parts at once (``run_sums``), and the EUP exponentiates them; ``_doubled_runs`` then grows
    the decays to every longer segment on the VPU, multiplying in whole runs, and a longer level's section is the
    halves of those segments. A product streams each section's ``C`` rows whatever the run's length, and an ``exp``
    costs an EUP push and a result pop where a product of decays takes one vector ALU slot.
    """
    C = g.shape[0]
    group = _run_group(C, sizes, fine_size)  # never below the sub-chunk: e's run lies inside the group
    with_exponents = exponents and fine_size is not None
    small = run_sums(_group_run_masks(C, group, sizes, fine_size if with_exponents else None), g, parts)
    prefix, suffix, *rest = (small[n * C : (n + 1) * C] for n in range(small.shape[0] // C))
    levels = {s: jnp.exp(section) for s, section in zip((s for s in sizes if s < group), rest)}
    fine = rest[-1] if with_exponents else None
    to_token, to_end = jnp.exp(prefix), jnp.exp(suffix)
    size = group
    while size < C:
        if size in sizes:
            levels[size] = _by_halves(to_end, to_token, size)
        to_token, to_end = _doubled_runs(to_token, to_end, size)
        size *= 2
    return jnp.concatenate([to_token, to_end, *(levels[s] for s in sizes)], axis=0), fine


def _run_group(chunk_size: int, sizes: tuple[int, ...], fine_size: int | None) -> int:
    """The tokens ``decay_sections`` sums its runs inside with the MXU, whose decays the VPU grows to every longer segment
    the levels need: the bounded path's sub-chunk (``fine_size``, its levels start there), or with no levels (a fast
    path's one sub-chunk) the whole chunk, every run one product's row; the exact path's (levels down to 1) one vector
    register's rows. Grown on the VPU from 8 tokens, the runs' products and their VJP cost more than the rows they
    save: modelled on v6e, gla's fast path forward kernel 113822 -> 101054 cycles, gradients kernel 347609 -> 310345;
    its sub-chunks of 32 120126 and 347609 (127502 and 380185 from 8); kda's bounded path (sub-chunks of 16, the
    bench's ``use_gate,A_log,lower_bound``) 362992 -> 360176 and 980313 -> 964121."""
    if fine_size is not None and fine_size >= SUBLANES:
        return fine_size
    return min(SUBLANES, chunk_size) if sizes else chunk_size


def _fine_mask(chunk_size: int, size: int) -> jax.Array:
    """Signed rows ``C x C`` whose product with ``g`` is ``e_i = b_i - b_r``, ``r`` the last token of the first half
    of ``i``'s sub-chunk of ``size``: ``+1`` on ``(r, i]`` after ``r``, ``-1`` on ``(i, r]`` up to it (empty at ``r``)."""
    i, t = row_and_column_iotas(chunk_size)
    r = _block(i, size) * size + (size // 2 - 1)
    after = (r < t) & (t <= i)
    before = (i < t) & (t <= r)
    return after.astype(_F32) - before.astype(_F32)


def run_sum_parts(operands) -> int:
    """How many bf16 parts of ``g`` the run sums take: three (float32 accuracy) for float32 operands; two for narrower
    ones, whose rounding of the decayed keys (``2**-9`` for bf16) dwarfs the two parts' error (``|run sum| * 2**-17`` in
    an exponent, at most ``0.37 * 2**-17`` in a decay ``exp(-|run sum|)``)."""
    return 3 if jnp.dtype(operands) == _F32 else 2


def _over_exact_parts(g: jax.Array, product) -> jax.Array:
    """``product(g)`` for a product linear in ``g`` whose other operand is exact in bf16 (0/1 or -1 masks, ones), to
    float32 accuracy in three native bf16 passes (HIGHEST takes six).

    ``g`` splits exactly into three bf16 parts (``bf16_parts``), so every product is exact and only the
    float32 accumulation rounds, as at HIGHEST (two parts round the second one's remainder). The high parts of
    the non-positive ``g`` share its sign and carry all but 2**-16 of each sum, so sums keep their accuracy without
    cancellation (and ``RESET_LOG_DECAY`` is its own high part).
    """
    return functools.reduce(operator.add, (product(part) for part in bf16_parts(g, 3)))


def _over_parts_side_by_side(g: jax.Array, product, parts: int) -> jax.Array:
    """``_over_exact_parts`` for a ``product`` that keeps ``g``'s columns: the parts side by side along lanes, one product,
    then the sum of its column blocks (the same sum as ``_over_exact_parts``'). The MXU streams the other operand's
    rows once for all parts where ``parts * K`` fits its width (256 on a v6e), not once per part."""
    width = g.shape[1]
    total = product(jnp.concatenate(bf16_parts(g, parts), axis=1))
    return functools.reduce(operator.add, (total[:, n * width : (n + 1) * width] for n in range(parts)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def run_sums(masks: jax.Array, g: jax.Array, parts: int = 3) -> jax.Array:
    """``masks @ g`` for 0/1 (or -1) ``masks``: ``g``'s exact bf16 parts stacked along the contraction against as many
    copies of ``masks``, so the MXU sums the parts' products as it accumulates and streams ``masks``' rows once for
    ``g``'s whole width. The low parts come first: their small sums round at their own scale before the high parts
    add in, as when each part's sum was its own product. Its gradient ``masks.T @ dsums`` as ``_over_parts_side_by_side``."""
    masks = masks.astype(jnp.bfloat16)
    return matmul(jnp.concatenate([masks] * parts, axis=1), jnp.concatenate(bf16_parts(g, parts)[::-1], axis=0), jnp.bfloat16)


def _run_sums_forward(masks, g, parts):
    return run_sums(masks, g, parts), masks


def _run_sums_cotangents(parts, masks, dsums):
    # One product per 128 lanes of g (a chunk's keys, of several side by side: Decays.of_chunks): the same MXU passes as
    # one product of them all, and the same sums, to the bit, however many chunks lie side by side.
    masks = masks.astype(jnp.bfloat16)
    return None, jnp.concatenate([
        _over_parts_side_by_side(dsums[:, lanes : lanes + LANES], lambda parts_: matmul(masks, parts_, jnp.bfloat16, COLUMNS_BY_COLUMNS), parts)
        for lanes in range(0, dsums.shape[1], LANES)
    ], axis=1)


run_sums.defvjp(_run_sums_forward, _run_sums_cotangents)


@jax.custom_vjp
def column_sums(g: jax.Array, rows: jax.Array) -> jax.Array:
    """``(K, 1)``: the sum of ``g``'s rows marked in the 0/1 column ``rows`` (``(C, 1)``), per key (``_over_exact_parts``);
    its gradient, ``dsums`` (``(K, 1)``) as a row on each marked row, likewise."""
    rows = rows.astype(jnp.bfloat16)
    return _over_exact_parts(g, lambda part: matmul(part, rows, jnp.bfloat16, COLUMNS_BY_COLUMNS))


def _column_sums_forward(g, rows):
    return column_sums(g, rows), rows


def _column_sums_cotangents(rows, dsums):
    rows = rows.astype(jnp.bfloat16)
    return _over_exact_parts(dsums, lambda part: matmul(rows, part, jnp.bfloat16, ROWS_BY_ROWS)), None


column_sums.defvjp(_column_sums_forward, _column_sums_cotangents)


def decay_work(chunk_size: int, key_dim: int, sizes: tuple[int, ...], fine_size: int | None, exponents: bool = True) -> Work:
    """``decay_sections``' matmul, one ``C x C @ C x K`` product per section of ``_group_run_masks``, and its ``exp``s,
    one ``C x K`` array per section but ``e`` (its caller's); the VPU's products of decays are elementwise, not counted."""
    group = _run_group(chunk_size, sizes, fine_size)
    exponentiated = 2 + sum(1 for s in sizes if s < group)
    sections = exponentiated + (1 if exponents and fine_size is not None else 0)
    return Work(flops=2 * sections * chunk_size * chunk_size * key_dim, transcendentals=exponentiated * chunk_size * key_dim)


@dataclasses.dataclass(frozen=True)
class Decays:
    """Every decay one chunk needs (``decay_sections``)."""

    to_token: jax.Array  # (C, K): exp(b_i)
    to_end: jax.Array  # (C, K): exp(b_C - b_i)
    whole: jax.Array  # (K, 1): exp(b_C), a column to scale the state's rows
    levels: tuple[jax.Array, ...]  # per coarse level, finest first, (C, K): exp(b_i - b_r) on later-half rows, exp(b_r - b_i) on earlier
    fine: tuple[jax.Array, jax.Array] | None = None  # bounded path: (exp(e_i), exp(-e_i)), (C, K) each (_fine_mask)
    fine_size: int | None = None  # bounded path: the sub-chunk (fine_block_size)

    @classmethod
    def compute(cls, g: jax.Array, fine_size: int | None = None, resets: jax.Array | None = None, parts: int = 3) -> Decays:
        """From the chunk's log decays ``g`` (float32 ``(C, K)``, zero in rows past the end of the sequence, ``-inf`` a
        reset; with ``fine_size`` every one ``>= L`` of ``fine_block_size``) and ``resets`` (``(C, 1)`` bool or None:
        rows whose every key is reset, a packed sequence's first token), in ``parts`` (``run_sum_parts``)."""
        (decays,) = cls.of_chunks([g], fine_size, [resets], parts)
        return decays

    @classmethod
    def of_chunks(cls, gs, fine_size: int | None, every_resets, parts: int) -> list[Decays]:
        """``compute`` of several chunks (``gs``, ``every_resets``: one each) at once: their ``g`` side by side along
        lanes, one ``decay_sections`` for all, so the run sums' product streams its masks' rows once for every chunk
        its output width holds (two of ``K = 128`` on a 256-wide MXU) and every elementwise step covers them all."""
        C, K = gs[0].shape
        packed = every_resets[0] is not None
        bounded_gs = gs
        gs = [g if resets is None else jnp.where(resets, jnp.float32(RESET_LOG_DECAY), g) for g, resets in zip(gs, every_resets)]
        g = jnp.maximum(jnp.concatenate(gs, axis=1), RESET_LOG_DECAY)
        sizes = coarse_level_sizes(C, fine_size)
        fine_separately = fine_size is not None and packed  # no reset: e's run sums ride along
        decays, exponents = decay_sections(g, sizes, fine_size, parts, exponents=not fine_separately)
        if fine_separately:
            exponents = run_sums(_fine_mask(C, fine_size), jnp.concatenate(bounded_gs, axis=1), parts)
        fine = None if fine_size is None else (jnp.exp(exponents), jnp.exp(-exponents))
        every_decays = []
        for n in range(len(gs)):
            keys = slice(n * K, (n + 1) * K)
            sections = [decays[m * C : (m + 1) * C, keys] for m in range(decays.shape[0] // C)]
            every_decays.append(cls(
                to_token=sections[0], to_end=sections[1],
                whole=sections[0][C - 1 :].T,  # b_C is b_i's last row: no products of its own, only a transpose to a column
                levels=tuple(sections[2:]), fine=None if fine is None else (fine[0][:, keys], fine[1][:, keys]), fine_size=fine_size,
            ))
        return every_decays


def l2_normalised(x: jax.Array) -> jax.Array:
    return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2NORM_EPSILON)


@dataclasses.dataclass(frozen=True)
class Pairs:
    aqk: jax.Array  # (C, C), zero above the diagonal
    inverse: jax.Array | None  # (C, C): (I + diag(beta) Akk)^-1, unit lower-triangular; None without the delta rule
    pairs: jax.Array | None = None  # (C, C): N = diag(beta) Akk, the levels' sum, which ``solved`` differentiates


def crossings(resets: jax.Array) -> jax.Array:
    """``(C, C)``: how many of the rows ``resets`` (``(C, 1)`` bool) lie in ``(j, i]``, one exact 0/1 bf16 matmul."""
    C = resets.shape[0]
    i, t = row_and_column_iotas(C)
    up_to_i = (t <= i).astype(jnp.bfloat16)  # [i, t]
    after_j = jnp.where(resets & (i > t), 1.0, 0.0).astype(jnp.bfloat16)  # [t, j]: row t resets and t > j
    return matmul(up_to_i, after_j, jnp.bfloat16)


def level_pairs_mask(chunk_size: int, size: int) -> jax.Array:
    """``(C, C)``: the pairs of level ``size``, the later half of a ``2 size``-block's rows with its earlier half's columns."""
    i, j = row_and_column_iotas(chunk_size)
    return (_block(i, 2 * size) == _block(j, 2 * size)) & _in_later_half(i, size) & ~_in_later_half(j, size)


def level_rows(chunk_size: int, size: int) -> int:
    """The rows of a chunk that level ``size``'s products stream (``interleaved_pairs``, ``exact_inverses``): the later
    halves alone where they are whole vector registers, else every row."""
    return chunk_size // 2 if size % SUBLANES == 0 else chunk_size


def inverse_work(chunk_size: int) -> Work:
    """``exact_inverses`` of one chunk: two products at every level but the first (``_doubled``)."""
    return Work(flops=sum(2 * 2 * level_rows(chunk_size, s) * chunk_size * chunk_size for s in level_sizes(chunk_size)[1:]))


def _later_rows(x: jax.Array, size: int) -> jax.Array:
    """The rows in the later half of each block of ``2 * size`` (``size`` a multiple of ``SUBLANES``), stacked in order."""
    return jnp.concatenate([x[start + size : start + 2 * size] for start in range(0, x.shape[0], 2 * size)], axis=0)


def _with_earlier_rows(earlier: jax.Array | None, later: jax.Array, size: int) -> jax.Array:
    """The inverse of ``_later_rows``: each block of ``2 * size`` rows is ``earlier``'s earlier half (None: zeros), then
    ``later``'s next ``size`` rows."""
    blocks = []
    for n in range(later.shape[0] // size):
        start = 2 * n * size
        blocks.append(jnp.zeros((size, later.shape[1]), later.dtype) if earlier is None else earlier[start : start + size])
        blocks.append(later[n * size : (n + 1) * size])
    return jnp.concatenate(blocks, axis=0)


def _doubled(inverse: jax.Array | None, level_pairs: jax.Array, size: int, operands) -> jax.Array:
    """``D_2s = D_s - D_s P_s D_s`` from ``D_s`` (None: ``D_1 = I``, whose products are ``P_1`` itself, so the finest
    level costs no matmul) and ``P_s`` (``level_pairs``, level ``size``).

    Only the later half of each ``2s``-block's rows of ``P_s`` is not zero, and so of ``D_s P_s D_s`` (``D_s`` is
    block-diagonal): where those rows are whole vector registers (``size`` a multiple of ``SUBLANES``), both products
    stream them alone, ``C / 2`` rows where the full product streams ``C``, the same sums."""
    if inverse is None:
        i, j = row_and_column_iotas(level_pairs.shape[0])
        return (i == j).astype(_F32) - level_pairs
    if level_rows(level_pairs.shape[0], size) == level_pairs.shape[0]:
        return inverse - matmul(inverse, matmul(level_pairs, inverse, operands), operands)
    pairs_by_inverse = _with_earlier_rows(None, matmul(_later_rows(level_pairs, size), inverse, operands), size)
    later_inverse = _later_rows(inverse, size)
    return _with_earlier_rows(inverse, later_inverse - matmul(later_inverse, pairs_by_inverse, operands), size)


def exact_inverses(every_levels, operands) -> tuple[jax.Array, ...]:
    """Each chunk's ``D = (I + N)^-1`` from its levels' pairs ``P_s`` (``every_levels``: per chunk, one ``(C, C)`` per
    level of ``level_sizes``, finest first, each zero off its level's pairs; ``N`` their sum), by ``D_2s = D_s - D_s P_s
    D_s``, level by level across the chunks (their chains are independent: issued level-major, each waits on the
    MXU while the others run). Not differentiated (``inverses_of`` stops its inputs' gradients): ``solved``
    differentiates each product with ``D`` to ``N`` itself."""
    inverses = [None] * len(every_levels)
    sizes = level_sizes(every_levels[0][0].shape[0])
    for level in range(len(every_levels[0])):
        inverses = [_doubled(d, levels[level], sizes[level], operands) for d, levels in zip(inverses, every_levels)]
    return tuple(inverses)


def inverses_of(every_levels, operands, known=None) -> tuple[jax.Array, ...]:
    """Each chunk's inverse from its levels' pairs: ``exact_inverses``, or the ``known`` ones (the backward's walk wrote
    them, so its gradients kernel need not recompute them). No gradient flows through an inverse: the products with it
    take theirs to ``N`` (``solved``), one product where ``D``'s cotangent and then ``N``'s from it took three."""
    if known is not None:
        return tuple(known)
    return exact_inverses(tuple(tuple(lax.stop_gradient(level) for level in levels) for levels in every_levels), operands)


def inverses_of_strictly_lower(every_n, operands, known=None) -> tuple[jax.Array, ...]:
    """``inverses_of`` each chunk's ``N`` ``(C, C)`` as it is, strictly lower triangular (its levels' pairs taken here;
    ``known`` as there), for an op whose pairs are one product (gated_delta_rule's)."""
    C = every_n[0].shape[0]
    masks = [level_pairs_mask(C, size) for size in level_sizes(C)]
    return inverses_of([tuple(jnp.where(mask, n, 0.0) for mask in masks) for n in every_n], operands, known)


def pairs(q: jax.Array, k: jax.Array, beta: jax.Array, decays: Decays, operands, resets: jax.Array | None = None) -> Pairs:
    """``Aqk`` and the exact inverse of ``I + diag(beta) Akk``, level by level (float32 ``q``, ``k``; ``beta`` ``(C, 1)``).

    On the bounded path (``decays.fine``) the pairs inside a sub-chunk are one matmul, but for those across a row
    of ``resets`` (``(C, 1)`` bool or None), which are zero; the levels above it are as on the exact path."""
    (result,) = interleaved_pairs([(q, k, beta, decays, resets)], operands)
    return result


def interleaved_pairs(chunks, operands, delta_rule: bool = True, inverses=None) -> list[Pairs]:
    """``pairs`` of several chunks ``(q, k, beta, decays, resets)``: every chunk's levels' products, then their inverses
    at once (``exact_inverses``). Without the ``delta_rule`` (gla: ``beta`` None), ``Aqk`` alone: each level streams
    only the later half's query rows, and no inverse (``Pairs.inverse`` None). Without the queries (``q`` None: a walk
    for the states alone), no ``Aqk`` (``Pairs.aqk`` None): the inverse alone, or nothing without the delta rule.
    ``inverses``: the chunks' inverses where they are known (``inverses_of``)."""
    C = chunks[0][1].shape[0]
    queries = chunks[0][0] is not None
    if not (queries or delta_rule):
        return [Pairs(aqk=None, inverse=None) for _ in chunks]
    i, j = row_and_column_iotas(C)
    rows = lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    aqk = [jnp.where(i == j, jnp.sum(q * k, axis=1, keepdims=True), 0.0) if queries else None for q, k, *_ in chunks]
    every_levels = [[] for _ in chunks]
    fine_size = chunks[0][3].fine_size
    if fine_size is not None:
        inside = (_block(i, fine_size) == _block(j, fine_size)) & (j < i)
        for n, (q, k, beta, decays, resets) in enumerate(chunks):
            row_decay, column_decay = decays.fine
            left = ([k * row_decay] if delta_rule else []) + ([q * row_decay] if queries else [])
            products = matmul(jnp.concatenate(left, axis=0), k * column_decay, operands, ROWS_BY_ROWS)
            kept = inside if resets is None else inside & (crossings(resets) == 0)
            if queries:
                aqk[n] = aqk[n] + jnp.where(kept, products[-C:], 0.0)
            if delta_rule:
                beta_akk = beta * jnp.where(kept, products[:C], 0.0)
                # The fine levels' P_t are masks of the one sub-chunk matrix.
                every_levels[n].extend(jnp.where(level_pairs_mask(C, t), beta_akk, 0.0) for t in level_sizes(fine_size))
    for level, s in enumerate(coarse_level_sizes(C, fine_size)):
        later = _in_later_half(rows, s)
        same_block = _block(i, 2 * s) == _block(j, 2 * s)
        # Only later-half rows pair at this level: where they are whole vector registers, they stream alone (C / 2 rows
        # of each operand, not C of which half are zeros) and are put back in place after the product.
        by_rows = level_rows(C, s) < C
        for n, (q, k, beta, decays, _) in enumerate(chunks):
            decayed_keys = k * decays.levels[level]
            earlier_keys = jnp.where(later, 0.0, decayed_keys)
            left = ([decayed_keys] if delta_rule else []) + ([q * decays.levels[level]] if queries else [])
            left = [_later_rows(x, s) for x in left] if by_rows else [jnp.where(later, x, 0.0) for x in left]
            products = matmul(jnp.concatenate(left, axis=0), earlier_keys, operands, ROWS_BY_ROWS)
            rows_of = (lambda x: _with_earlier_rows(None, x, s)) if by_rows else (lambda x: x)
            half = products.shape[0] // len(left)
            if queries:
                aqk[n] = aqk[n] + jnp.where(same_block, rows_of(products[-half:]), 0.0)
            if delta_rule:
                # Later rows against earlier columns inside one 2s-block: the level's pairs, zero elsewhere.
                every_levels[n].append(beta * jnp.where(same_block, rows_of(products[:half]), 0.0))
    if not delta_rule:
        return [Pairs(aqk=a, inverse=None) for a in aqk]
    return [
        Pairs(aqk=a, inverse=d, pairs=functools.reduce(operator.add, levels))
        for a, d, levels in zip(aqk, inverses_of(every_levels, operands, inverses), every_levels)
    ]


def prepared_queries_keys(q, k, *, scale: float, use_qk_l2norm: bool) -> tuple[jax.Array | None, jax.Array]:
    """``q`` and ``k`` as the chunk math takes them: float32, normalised when asked, ``q`` times ``scale`` (None stays
    None: a walk that computes the states alone, ``chunk_steps``)."""
    k = k.astype(_F32)
    if use_qk_l2norm:
        k = l2_normalised(k)
    if q is None:
        return None, k
    q = q.astype(_F32)
    return (l2_normalised(q) if use_qk_l2norm else q) * scale, k


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Factors:
    """What a chunk's way through the state (``through_state``) takes from the chunk's own rows: none of it depends on
    the state, so every chunk's factors can be computed before and apart from that chain (``chunk_steps``)."""

    to_token: jax.Array  # (C, K): exp(b_i)
    to_end: jax.Array  # (C, K): exp(b_C - b_i)
    whole: jax.Array  # (K, 1): exp(b_C)
    aqk: jax.Array | None  # (C, C); None without the queries (a walk for the states alone)
    inverse: jax.Array | None  # (C, C): (I + diag(beta) Akk)^-1; None without the delta rule (gla)
    ahead: Any = None  # what the op's ``Recurrence.ahead`` computed of the way through the state before the chain, or None
    pairs: jax.Array | None = None  # (C, C): N = diag(beta) Akk, strictly lower, which ``solved`` differentiates


def chunk_factors(chunks, *, operands, fine_size: int | None, inverses=None) -> list[Factors]:
    """The factors of consecutive chunks, ``(q, k, g, beta, resets)`` each (``q``, ``k`` from ``prepared_queries_keys``,
    ``resets`` None or a packed chunk's ``(C, 1)`` sequence starts): the decays, then the pairs and inverses of all of
    them at once (``interleaved_pairs``; ``inverses`` where known); ``fine_size``: the bounded path's sub-chunk
    (``sub_chunk_size``) or None. A pure function of its arrays, so its VJP is the backward's."""
    parts = run_sum_parts(operands)
    decays = Decays.of_chunks([g for _, _, g, _, _ in chunks], fine_size, [resets for *_, resets in chunks], parts)
    every_pairs = interleaved_pairs(
        [(q, k, beta, d, resets) for (q, k, _, beta, resets), d in zip(chunks, decays)], operands, inverses=inverses,
    )
    return [Factors(d.to_token, d.to_end, d.whole, p.aqk, p.inverse, pairs=p.pairs) for d, p in zip(decays, every_pairs)]


def with_wy(k, v, beta, factors: Factors, operands) -> Factors:
    """``factors`` with ``ahead`` the WY form's ``(W, u)``: ``W = D diag(beta) (k * to_token)`` and ``u = D diag(beta) v``,
    one product ``D [beta k exp(b) | beta v]`` (``D`` the inverse), with which the chunk's writes are ``delta = u - W S``
    (``through_state``): two products on the chain through the state per link, not three (flash-linear-attention's
    form). The backward's checkpoints walk takes it (``ahead_of_walk``) and, where ``wy_gradients`` says so, its
    gradients kernel (``kda.backward``)."""
    K = k.shape[1]
    both = solved(factors, beta * jnp.concatenate([k * factors.to_token, v.astype(_F32)], axis=1), operands)
    return dataclasses.replace(factors, ahead=(both[:, :K], both[:, K:]))


def ahead_of_walk(q, k, v, beta, factors: Factors, operands) -> Factors:
    """The delta rule's ``Recurrence.ahead``: the WY form (``with_wy``) for a walk for the states alone (``q`` None); with
    the queries (the forward), ``factors`` as they are, the solve, where ``W`` cost more than the link it saves.

    Modelled at the bench's shape (2026-12-07), the checkpoints walk's cycles with the solve -> in the WY form: kda v6e
    362402 -> 355170, v5e 488272 -> 482512; gated_delta_rule's finite gates v6e 264068 -> 255316, v5e 340977 ->
    321681, any gates v6e 298388 -> 288468, v5e 378449 -> 347985. The forward in the WY form: kda's v6e forward kernel
    420655 -> 434447, gated_delta_rule's (in a layer) 286448 -> 290714."""
    return factors if q is not None else with_wy(k, v, beta, factors, operands)


def through_state(q, k, v, beta, state, entering, factors: Factors, operands, known: StateProducts | None = None):
    """``(o, S_out, delta)`` of one chunk from the state entering it and its ``factors``: the writes ``delta`` (float32
    ``(C, value block)``) and what they and ``state`` give; ``delta = D diag(beta) (v - k exp(b) S)``, solved after the
    state's product, or ``u - W S`` where ``factors.ahead`` holds ``(W, u)`` (``ahead_of_walk``).

    ``entering``: None, or a packed chunk's initial-state terms ``(keys, queries, leaving)`` (``kda.sequences``) added to
    ``k S``, ``o`` and ``S_out``. ``q`` None: no ``o`` (None), the states alone. ``known``: the products with the state
    that a walk of the same link computed (``walked_link``), taken as they are. A pure function of its arrays, so its
    VJP is the backward's (``kda.backward``)."""
    return _link(q, k, v, beta, state, entering, factors, operands, known)[:3]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StateProducts:
    """A link's products that depend on the state entering it, as a walk for the states computed them (``walked_link``):
    the VJP of the same link takes them as known (``mxu.known_product``), where its primal would compute them again."""

    keys_by_state: jax.Array  # (C, value block): k exp(b) S, or W S in the WY form (a packed chunk's terms not added)
    solved: jax.Array | None  # (C, value block): the solve's product, delta; None in the WY form (no solve)


def solved(factors: Factors, rhs: jax.Array, operands, known: jax.Array | None = None) -> jax.Array:
    """``Y = D rhs`` (``D = factors.inverse``; ``known``: its value, where a walk of the same link computed it), whose
    cotangents go to ``N`` (``factors.pairs``) and ``rhs``: ``drhs = D^T dY`` and ``dN = -drhs Y^T`` on ``N``'s strictly
    lower triangle, since ``dN = -D^T dD D^T`` and ``dD = dY rhs^T``. One product for ``dN`` where going through ``D``'s
    cotangent took three; the inverse itself is not differentiated (``inverses_of``). ``operands`` a dtype."""
    return _solved(factors.pairs, factors.inverse, rhs, known, jnp.dtype(operands))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _solved(pairs, inverse, rhs, known, operands):
    del pairs
    return matmul(inverse, rhs, operands) if known is None else known


def _solved_forward(pairs, inverse, rhs, known, operands):
    value = _solved(pairs, inverse, rhs, known, operands)
    return value, (inverse, value, known)


def _solved_cotangents(operands, residuals, dvalue):
    inverse, value, known = residuals
    drhs = matmul(inverse, dvalue, operands, COLUMNS_BY_COLUMNS)
    i, j = row_and_column_iotas(inverse.shape[0])
    dpairs = jnp.where(j < i, -matmul(drhs, value, operands, ROWS_BY_ROWS), 0.0)
    return dpairs, jnp.zeros_like(inverse), drhs, None if known is None else jnp.zeros_like(known)


_solved.defvjp(_solved_forward, _solved_cotangents)


def walked_link(k, v, beta, state, entering, factors: Factors, operands) -> tuple[jax.Array, StateProducts]:
    """``through_state`` for the states alone (no queries): ``(S_out, StateProducts)``."""
    _, state_out, _, products = _link(None, k, v, beta, state, entering, factors, operands, None)
    return state_out, products


def _link(q, k, v, beta, state, entering, factors: Factors, operands, known: StateProducts | None):
    C = k.shape[0]
    solves = factors.ahead is None  # else the WY form: keys are W, and what they give already went through D
    keys = k * factors.to_token if solves else factors.ahead[0]
    if known is None:
        by_state = matmul(keys if q is None else jnp.concatenate([keys, q * factors.to_token], axis=0), state, operands)
        keys_by_state, o = by_state[:C], None if q is None else by_state[C:]  # one product: the state is loaded into the MXU once
    else:
        keys_by_state = known_product(known.keys_by_state, keys, state, operands)
        o = None if q is None else matmul(q * factors.to_token, state, operands)
    products = keys_by_state
    state_out = factors.whole * state
    if entering is not None:
        entering_keys, queries, leaving = entering
        state_out = state_out + leaving
        o = None if q is None else o + queries
        keys_by_state = keys_by_state + (entering_keys if solves else solved(factors, beta * entering_keys, operands))
    if solves:
        delta = solved(factors, beta * (v.astype(_F32) - keys_by_state), operands, None if known is None else known.solved)
    else:
        delta = factors.ahead[1] - keys_by_state
    if q is not None:
        o = o + matmul(factors.aqk, delta, operands)
    state_out = state_out + matmul(k * factors.to_end, delta, operands, COLUMNS_BY_COLUMNS)
    return o, state_out, delta, StateProducts(products, delta if solves else None)


MILD_LOG_DECAY = FINE_EXPONENT_LIMIT / 2
"""A sub-chunk whose log decay is at least ``-MILD_LOG_DECAY`` in every key keeps its exponents around its middle within
``exp(+-40)``, the bounded path's budget, with no bound promised: it may be one of the bounded path's sub-chunks."""

MILD_SUB_CHUNK = 32
"""The sub-chunk a step takes where its whole chunks are not mild but every block of this many tokens is
(``MILD_SUB_CHUNKS``): the bounded path's, its levels above the sub-chunk exact for any gate. gla on v6e, modelled at
the bench's shape, forward in a layer and backward's kernels against the floor: 1.19x and 2.47x at 32, 1.24x and 2.63x
at 16, against the halving's 1.96x and 3.74x (2026-12-07, runs grown from 8 tokens; 1.12x and 2.31x at 32 from the
sub-chunk's, ``_run_group``)."""

MILD_SUB_CHUNKS = "mild sub-chunks"
"""The fast arm's name (``tops_core.tpu.fast_paths``) of a step whose every ``MILD_SUB_CHUNK`` tokens are mild."""


def every_chunk_mild(gs, size: int | None = None) -> jax.Array:
    """Whether every block of ``size`` rows (None: the whole chunk) of every chunk's log decays ``g`` (``(C, K)`` each)
    sums to at least ``-MILD_LOG_DECAY`` in every key: false for a gate of ``-inf`` or NaN."""
    size = size or gs[0].shape[0]
    sums = [jnp.min(jnp.sum(g[start : start + size], axis=0)) for g in gs for start in range(0, g.shape[0], size)]
    return jnp.all(jnp.stack(sums) >= -MILD_LOG_DECAY)


def by_mildness(gs, step, fine_size: int | None, fast: bool, resets=None):
    """``step(sub-chunk)`` at the sub-chunk a grid step's log decays ``gs`` allow: with ``fast``, one as wide as the chunk
    where every chunk is mild (``fast_paths.FAST``: no coarse levels and no run sums of theirs), else ``MILD_SUB_CHUNK``
    where every block of that many tokens is (``MILD_SUB_CHUNKS``); else, and without ``fast``, ``fine_size`` (the
    halving's None or a promised bound's, ``sub_chunk_size``). ``tops_core.tpu.fast_paths.choose``, so a step runs one of
    the three: not for a differentiated caller (the backward takes the choice around its whole step, ``kda.backward``).
    ``resets`` (a packed chunk's sequence starts) change nothing: every arm takes them exactly (``Decays.of_chunks``)."""
    del resets
    if not fast:
        return step(fine_size)
    chunk_size = gs[0].shape[0]

    def sub_chunks():
        if MILD_SUB_CHUNK >= chunk_size:
            return step(fine_size)
        return fast_paths.choose(
            every_chunk_mild(gs, MILD_SUB_CHUNK), lambda: step(MILD_SUB_CHUNK), lambda: step(fine_size), arm=MILD_SUB_CHUNKS,
        )

    return fast_paths.choose(every_chunk_mild(gs), lambda: step(chunk_size), sub_chunks)


def chunk_steps(chunks, state, *, scale: float, use_qk_l2norm: bool, recurrence: Recurrence, lower_bound: float | None = None):
    """Consecutive chunks from ``state``: ``(o of each, the state entering each, the state leaving the last, the factors
    of each)``, ``o`` float32 ``(C, value block)``, the states float32 ``(K_pad, value block)``.

    ``chunks``: ``(q, k, v, g, beta, packed)`` each: ``q``, ``k``, ``v`` in the input dtype (``q`` None: the states alone,
    every ``o`` None, as the backward's walk needs them), ``g`` float32 ``(C, K_pad)`` (a gate per head: ``(C, 1)``, or
    ``(1, C)`` where ``recurrence.gates_along_lanes``) and ``beta`` ``(C, 1)`` float32 (None without the delta rule),
    every row past the end of the sequence already zero (no decay, no write). ``lower_bound``: static, a bound every
    ``g`` respects (kda's bounded path where ``sub_chunk_size`` allows it). ``packed``: a packed chunk's sequences
    (``kda.sequences.PackedChunk``) or None: its sequences' first rows reset the state (every key's decay ``exp(-inf)``),
    their initial states enter there and their final states leave.

    Every chunk's factors first (``recurrence.factors``), then what of each chunk's way through the state does not depend
    on the state (``recurrence.ahead``, where the op has it), then the chain through the state
    (``recurrence.through_state``). A chunk's inverse is a chain of dependent products, as is the state's way through
    the chunks; issued apart, each fills the other's waits. The kernels behave as if the MXU took its products in the
    order they are written, a product written into the chain waiting for the chain's previous link however independent.
    """
    operands = mxu_operand_dtype(chunks[0][1].dtype)
    prepared = []
    for q, k, v, g, beta, packed in chunks:
        q, k = prepared_queries_keys(q, k, scale=scale, use_qk_l2norm=use_qk_l2norm)
        prepared.append((q, k, g, beta, None if packed is None else packed.resets))
    fine_size = sub_chunk_size(prepared[0][1].shape[0], lower_bound, operands, use_qk_l2norm=use_qk_l2norm, scale=scale)
    every_factors = recurrence.arms(
        [g for _, _, g, _, _ in prepared], lambda size: recurrence.factors(prepared, operands=operands, fine_size=size),
        fine_size, recurrence.fast_walk, [resets for *_, resets in prepared],
    )
    if recurrence.ahead is not None:
        every_factors = [
            recurrence.ahead(q, k, v, beta, own, operands) for (q, k, _, beta, _), (_, _, v, *_), own in zip(prepared, chunks, every_factors)
        ]
    outputs, entering_states = [], []
    for (q, k, g, beta, _), (_, _, v, _, _, packed), own in zip(prepared, chunks, every_factors):
        entering_states.append(state)
        sequence_gates = None if packed is None else recurrence.per_key_log_decays(g, k.shape[1])
        entering = None if packed is None else packed.entering(q, k, sequence_gates, operands)
        o, state_out, writes = recurrence.through_state(q, k, v, beta, state, entering, own, operands)
        if packed is not None:
            packed.leave(k, sequence_gates, writes, state, operands)
        outputs.append(o)
        state = state_out
    return outputs, entering_states, state, every_factors


def chunk_work(geometry: Geometry, use_qk_l2norm: bool, lower_bound: float | None = None, packed: bool = False) -> Work:
    """One chunk's ``chunk_factors`` and ``through_state`` for one value block, counted op by op (a ragged last chunk computes whole;
    with several value blocks each redoes the decays and pairs); ``lower_bound`` and ``packed`` as ``chunk_steps``'s
    (resets given). Counted at the narrow budget (``fine_block_size``): a call that ``wide_sub_chunks`` computes one
    coarse level fewer."""
    C, K, Vb = geometry.chunk_size, geometry.padded_key_dim, geometry.value_block
    fine = fine_block_size(C, lower_bound)
    coarse = coarse_level_sizes(C, fine)
    decays = decay_work(C, K, coarse, fine, exponents=not packed)  # packed, e is its own matmul
    separate_fine = 2 * C * C * K if fine and packed else 0
    levels = sum(2 * (2 * level_rows(C, s)) * K * C for s in coarse)  # keys' and queries' rows
    sub_chunk = 2 * (2 * C) * K * C if fine else 0
    pairs_ = levels + sub_chunk + (2 * C * C * C if fine and packed else 0)
    outputs = 2 * C * K * Vb + 2 * C * C * Vb + 2 * C * K * Vb + 2 * C * C * Vb + 2 * C * K * Vb
    exps = (2 * C * K if fine else 0) + (2 * C if use_qk_l2norm else 0)  # exp(e) and exp(-e); the norms
    return inverse_work(C) + decays + Work(flops=separate_fine + pairs_ + outputs, transcendentals=exps)


def kept_vmem(geometry: Geometry, lower_bound: float | None = None) -> int:
    """An upper estimate of what each chunk of a grid step keeps from its decays to its turn at the state (bytes):
    float32 ``q``, ``k``, ``g``, ``v``, ``Aqk``, the inverse and every decay (``chunk_steps`` computes all chunks' pairs
    first), at the narrow budget (a wider sub-chunk keeps fewer levels' decays)."""
    C, K, Vb = geometry.chunk_size, geometry.padded_key_dim, geometry.value_block
    fine = fine_block_size(C, lower_bound)
    decays = 2 + len(coarse_level_sizes(C, fine)) + (2 if fine else 0)
    return 4 * ((decays + 3) * C * K + C * Vb + 2 * C * C)


def chunk_body_vmem(geometry: Geometry, lower_bound: float | None = None) -> int:
    """An upper estimate of the float32 values one chunk's factors and way through the state hold at once (bytes).

    The run masks and their decays (``(2 + levels) C`` rows of ``C`` and ``K``, on the bounded path
    ``(3 + coarse levels) C`` and ``exp(-e)``), float32 q, k and their decayed copies (6 of ``C x K``),
    a level's products (``2C x C``) and the ``C x C`` matrices (Aqk, a level's Akk, the inverse and a
    product; bounded: the sub-chunk's masked Akk, a level's restriction of it and the crossings besides),
    the state in and out, and four ``C x value block`` values (residual, delta, two partial outputs).
    """
    C, K, Vb = geometry.chunk_size, geometry.padded_key_dim, geometry.value_block
    fine = fine_block_size(C, lower_bound)
    sections = (2 + len(coarse_level_sizes(C, fine)) + (1 if fine else 0)) * C
    decays = sections + (C if fine else 0)
    squares = 6 + (3 if fine else 0)
    return 4 * (sections * C + 2 * decays * K + 6 * C * K + squares * C * C + 2 * K * Vb + 4 * C * Vb)


KDA = Recurrence(
    op="kda", gate_per_key=True, delta_rule=True, factors=chunk_factors, through_state=through_state,
    walked_link=walked_link, chunk_work=chunk_work, chunk_body_vmem=chunk_body_vmem, kept_vmem=kept_vmem, arms=by_mildness,
    ahead=ahead_of_walk,
)
