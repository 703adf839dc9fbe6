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
``b_i - b_r`` and ``b_r - b_j``. All are computed at once as one matmul of 0/1 run masks with
``g`` (``run_sums``, as exact as float32); none is a difference of two large cumulative sums, so a decay near 1 keeps float32
accuracy however large ``|b|`` grows. Rows a mask leaves empty get exponent 0, never a positive one.

**Resets.** A gate of ``-inf`` (``exp(-inf) = 0``: the key's row of the state is reset) would make the
masks' zeros times ``-inf`` NaN. It is taken as ``exponents.RESET_LOG_DECAY`` (``-2**100``) instead:
exponents here are only ever sums, never differences, so a run that holds it sums to ``-2**100`` or
below, whose ``exp`` is exactly 0, and every other run is untouched.

**The inverse**, exactly, along the same levels: with ``D_s`` the inverse of ``I + diag(beta) Akk``
restricted to blocks of ``s`` tokens (``D_1 = I``) and ``P_s`` the level-``s`` pairs of
``diag(beta) Akk``, ``D_2s = D_s - D_s P_s D_s`` (the inverse of ``[[A, 0], [C, D]]`` is
``[[A^-1, 0], [-D^-1 C A^-1, D^-1]]``). Blocked forward substitution; no truncated series.

**Bounded gates** (``lower_bound = L``: every ``g >= L``, fla's ``safe_gate``). Over a sub-chunk of
``s`` tokens a decay relative to a point inside it is then at most ``exp(|L| s)``. With ``s`` the
largest power of two with ``|L| s <= 80`` (``fine_block_size``; 16 at Kimi Linear's ``L = -5``) and
the point ``r`` the middle of the sub-chunk (its first half's last token), every exponent
``e_i = b_i - b_r`` lies in ``[-40, 40]``: ``exp(+-e)`` is finite and far from float32's
subnormals, whose low bf16 parts a TPU would flush. All pairs inside one sub-chunk are then one
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

import jax
import jax.numpy as jnp
from jax import lax

from tops_core.ops.kda import L2NORM_EPSILON
from tops_plugins_tpu_pallas.exponents import RESET_LOG_DECAY
from tops_plugins_tpu_pallas.grid import Work
from tops_plugins_tpu_pallas.mxu import COLUMNS_BY_COLUMNS, ROWS_BY_ROWS, bf16_parts, matmul, mxu_operand_dtype, row_and_column_iotas
from tops_plugins_tpu_pallas.layout import Geometry

_F32 = jnp.float32



FINE_EXPONENT_LIMIT = 80.0
"""``|L| s`` at most this: the bounded path's sub-chunk decays stay within ``exp(+-40)`` around its middle."""


def level_sizes(chunk_size: int) -> tuple[int, ...]:
    """Half-block sizes of the levels, finest first: 1, 2, ..., chunk_size / 2."""
    return tuple(1 << n for n in range(chunk_size.bit_length() - 1))


def fine_block_size(chunk_size: int, lower_bound: float | None) -> int | None:
    """The bounded path's sub-chunk: the largest power of two ``s <= chunk_size`` with ``|lower_bound| s <= 80``,
    or None (the exact path) without a bound or where ``s`` would be 1 (no pair inside a sub-chunk)."""
    if lower_bound is None:
        return None
    size = 1
    while 2 * size <= chunk_size and -lower_bound * 2 * size <= FINE_EXPONENT_LIMIT:
        size *= 2
    return size if size >= 2 else None


def coarse_level_sizes(chunk_size: int, fine_size: int | None) -> tuple[int, ...]:
    """The levels computed as levels: all of them on the exact path, ``fine_size .. C/2`` on the bounded one."""
    return tuple(s for s in level_sizes(chunk_size) if fine_size is None or s >= fine_size)


def _block(index: jax.Array, size: int) -> jax.Array:
    """Which block of ``size`` tokens (a power of two) ``index`` lies in."""
    return lax.shift_right_logical(index, jnp.int32(size.bit_length() - 1))


def _in_later_half(index: jax.Array, size: int) -> jax.Array:
    """Whether ``index`` is in the later half of its block of ``2 * size`` tokens."""
    return (_block(index, size) & 1) == 1


def _run_masks(chunk_size: int, sizes: tuple[int, ...]) -> jax.Array:
    """0/1 rows ``(2 + 2 * len(sizes)) * C x C``: row ``i`` of each ``C``-row section sums ``g`` over one run of tokens.

    Sections: ``(.., i]`` (``b_i``), ``(i, ..)`` (``b_C - b_i``), then per level of ``sizes`` the run from the
    level's point ``r`` to ``i`` for later-half tokens (``b_i - b_r``) and from ``i`` to ``r`` for
    earlier-half tokens (``b_r - b_i``); tokens in the other half get an empty run.
    """
    i, t = row_and_column_iotas(chunk_size)
    sections = [t <= i, t > i]
    for s in sizes:
        same_half_block = _block(i, 2 * s) == _block(t, 2 * s)
        later_i, later_t = _in_later_half(i, s), _in_later_half(t, s)
        sections.append(same_half_block & later_i & later_t & (t <= i))
        sections.append(same_half_block & ~later_i & ~later_t & (t > i))
    return jnp.concatenate([m.astype(_F32) for m in sections], axis=0)


def _fine_mask(chunk_size: int, size: int) -> jax.Array:
    """Signed rows ``C x C`` whose product with ``g`` is ``e_i = b_i - b_r``, ``r`` the last token of the first half
    of ``i``'s sub-chunk of ``size``: ``+1`` on ``(r, i]`` after ``r``, ``-1`` on ``(i, r]`` up to it (empty at ``r``)."""
    i, t = row_and_column_iotas(chunk_size)
    r = _block(i, size) * size + (size // 2 - 1)
    after = (r < t) & (t <= i)
    before = (i < t) & (t <= r)
    return after.astype(_F32) - before.astype(_F32)


def _over_exact_parts(g: jax.Array, product) -> jax.Array:
    """``product(g)`` for a product linear in ``g`` whose other operand is exact in bf16 (0/1 or -1 masks, ones), to
    float32 accuracy in three native bf16 passes (HIGHEST takes six).

    ``g`` splits exactly into three bf16 parts (``bf16_parts``), so every product is exact and only the
    float32 accumulation rounds, as at HIGHEST. The high parts of the non-positive ``g`` share its sign
    and carry all but 2**-16 of each sum, so sums keep their accuracy without cancellation (and
    ``RESET_LOG_DECAY`` is its own high part).
    """
    return functools.reduce(operator.add, (product(part) for part in bf16_parts(g, 3)))


@jax.custom_vjp
def run_sums(masks: jax.Array, g: jax.Array) -> jax.Array:
    """``masks @ g`` for 0/1 (or -1) ``masks`` (``_over_exact_parts``); its gradient ``masks.T @ dsums`` likewise."""
    masks = masks.astype(jnp.bfloat16)
    return _over_exact_parts(g, lambda part: matmul(masks, part, jnp.bfloat16))


def _run_sums_forward(masks, g):
    return run_sums(masks, g), masks


def _run_sums_cotangents(masks, dsums):
    masks = masks.astype(jnp.bfloat16)
    return None, _over_exact_parts(dsums, lambda part: matmul(masks, part, jnp.bfloat16, COLUMNS_BY_COLUMNS))


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


@dataclasses.dataclass(frozen=True)
class Decays:
    """Every decay one chunk needs, ``exp`` of the run sums of ``_run_masks``."""

    to_token: jax.Array  # (C, K): exp(b_i)
    to_end: jax.Array  # (C, K): exp(b_C - b_i)
    whole: jax.Array  # (K, 1): exp(b_C), a column to scale the state's rows
    levels: tuple[tuple[jax.Array, jax.Array], ...]  # per coarse level, finest first: (exp(b_i - b_r), exp(b_r - b_j)), (C, K) each
    fine: tuple[jax.Array, jax.Array] | None = None  # bounded path: (exp(e_i), exp(-e_i)), (C, K) each (_fine_mask)
    fine_size: int | None = None  # bounded path: the sub-chunk (fine_block_size)

    @classmethod
    def compute(cls, g: jax.Array, fine_size: int | None = None, resets: jax.Array | None = None) -> Decays:
        """From the chunk's log decays ``g`` (float32 ``(C, K)``, zero in rows past the end of the sequence, ``-inf`` a
        reset; with ``fine_size`` every one ``>= L`` of ``fine_block_size``) and ``resets`` (``(C, 1)`` bool or None:
        rows whose every key is reset, a packed sequence's first token)."""
        C = g.shape[0]
        bounded_g = g
        if resets is not None:
            g = jnp.where(resets, jnp.float32(RESET_LOG_DECAY), g)
        g = jnp.maximum(g, RESET_LOG_DECAY)
        sizes = coarse_level_sizes(C, fine_size)
        masks = _run_masks(C, sizes)
        fine_separately = fine_size is not None and resets is not None
        if fine_size is not None and not fine_separately:  # no reset: e's run sums ride along in the one matmul
            masks = jnp.concatenate([masks, _fine_mask(C, fine_size)], axis=0)
        sums = run_sums(masks, g)
        fine = None
        if fine_size is not None:
            exponents = run_sums(_fine_mask(C, fine_size), bounded_g) if fine_separately else sums[-C:]
            sums = sums if fine_separately else sums[:-C]
            fine = (jnp.exp(exponents), jnp.exp(-exponents))
        decays = jnp.exp(sums)
        sections = [decays[n * C : (n + 1) * C] for n in range(decays.shape[0] // C)]
        whole = jnp.exp(column_sums(g, jnp.ones((C, 1), jnp.bool_)))
        levels = tuple(zip(sections[2::2], sections[3::2]))
        return cls(to_token=sections[0], to_end=sections[1], whole=whole, levels=levels, fine=fine, fine_size=fine_size)


def l2_normalised(x: jax.Array) -> jax.Array:
    return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2NORM_EPSILON)


@dataclasses.dataclass(frozen=True)
class Pairs:
    aqk: jax.Array  # (C, C), zero above the diagonal
    inverse: jax.Array  # (C, C): (I + diag(beta) Akk)^-1, unit lower-triangular


def crossings(resets: jax.Array) -> jax.Array:
    """``(C, C)``: how many of the rows ``resets`` (``(C, 1)`` bool) lie in ``(j, i]``, one exact 0/1 bf16 matmul."""
    C = resets.shape[0]
    i, t = row_and_column_iotas(C)
    up_to_i = (t <= i).astype(jnp.bfloat16)  # [i, t]
    after_j = jnp.where(resets & (i > t), 1.0, 0.0).astype(jnp.bfloat16)  # [t, j]: row t resets and t > j
    return matmul(up_to_i, after_j, jnp.bfloat16)


def pairs(q: jax.Array, k: jax.Array, beta: jax.Array, decays: Decays, operands, resets: jax.Array | None = None) -> Pairs:
    """``Aqk`` and the exact inverse of ``I + diag(beta) Akk``, level by level (float32 ``q``, ``k``; ``beta`` ``(C, 1)``).

    On the bounded path (``decays.fine``) the pairs inside a sub-chunk are one matmul, but for those across a row
    of ``resets`` (``(C, 1)`` bool or None), which are zero; the levels above it are as on the exact path."""
    C = k.shape[0]
    i, j = row_and_column_iotas(C)
    rows = lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    aqk = jnp.where(i == j, jnp.sum(q * k, axis=1, keepdims=True), 0.0)
    inverse = (i == j).astype(_F32)
    if decays.fine is not None:
        size = decays.fine_size
        row_decay, column_decay = decays.fine
        products = matmul(jnp.concatenate([k * row_decay, q * row_decay], axis=0), k * column_decay, operands, ROWS_BY_ROWS)
        inside = (_block(i, size) == _block(j, size)) & (j < i)
        if resets is not None:
            inside = inside & (crossings(resets) == 0)
        aqk = aqk + jnp.where(inside, products[C:], 0.0)
        beta_akk = beta * jnp.where(inside, products[:C], 0.0)
        for t in level_sizes(size):  # the fine levels' P_t: pairs of the later and earlier half of a 2t-block
            level = (_block(i, 2 * t) == _block(j, 2 * t)) & _in_later_half(i, t) & ~_in_later_half(j, t)
            inverse = inverse - matmul(inverse, matmul(jnp.where(level, beta_akk, 0.0), inverse, operands), operands)
    for s, (later_decay, earlier_decay) in zip(coarse_level_sizes(C, decays.fine_size), decays.levels):
        later = _in_later_half(rows, s)
        later_keys = jnp.where(later, k * later_decay, 0.0)
        later_queries = jnp.where(later, q * later_decay, 0.0)
        earlier_keys = jnp.where(later, 0.0, k * earlier_decay)
        products = matmul(jnp.concatenate([later_keys, later_queries], axis=0), earlier_keys, operands, ROWS_BY_ROWS)
        same_block = _block(i, 2 * s) == _block(j, 2 * s)
        akk_level = jnp.where(same_block, products[:C], 0.0)
        aqk = aqk + jnp.where(same_block, products[C:], 0.0)
        # D_2s = D_s - D_s P_s D_s: D_s is block-diagonal and P_s lies inside the 2s-blocks, so no mask is needed.
        inverse = inverse - matmul(inverse, matmul(beta * akk_level, inverse, operands), operands)
    return Pairs(aqk=aqk, inverse=inverse)


def prepared_queries_keys(q, k, *, scale: float, use_qk_l2norm: bool) -> tuple[jax.Array, jax.Array]:
    """``q`` and ``k`` as the chunk math takes them: float32, normalised when asked, ``q`` times ``scale``."""
    q, k = q.astype(_F32), k.astype(_F32)
    if use_qk_l2norm:
        q, k = l2_normalised(q), l2_normalised(k)
    return q * scale, k


def chunk_core(q, k, v, g, beta, state, entering, *, operands, lower_bound: float | None, resets: jax.Array | None):
    """``(o, S_out, delta)`` of one chunk from ``prepared_queries_keys``' ``q`` and ``k``: the pairs, the inverse, the
    writes ``delta`` (float32 ``(C, value block)``) and what they and ``state`` give.

    ``entering``: None, or a packed chunk's initial-state terms ``(keys, queries, leaving)`` (``kda.sequences``) added to
    ``k S``, ``o`` and ``S_out``; ``resets``: None or the packed chunk's ``(C, 1)`` sequence starts. A pure function
    of its array arguments, so its VJP is the backward's (``kda.backward``)."""
    decays = Decays.compute(g, fine_block_size(g.shape[0], lower_bound), resets)
    p = pairs(q, k, beta, decays, operands, resets)
    keys_by_state = matmul(k * decays.to_token, state, operands)
    o = matmul(q * decays.to_token, state, operands)
    state_out = decays.whole * state
    if entering is not None:
        keys, queries, leaving = entering
        keys_by_state, o, state_out = keys_by_state + keys, o + queries, state_out + leaving
    delta = matmul(p.inverse, beta * (v.astype(_F32) - keys_by_state), operands)
    o = o + matmul(p.aqk, delta, operands)
    state_out = state_out + matmul(k * decays.to_end, delta, operands, COLUMNS_BY_COLUMNS)
    return o, state_out, delta


def chunk_step(q, k, v, g, beta, state, *, scale: float, use_qk_l2norm: bool, lower_bound: float | None = None, packed=None):
    """``(o, S_out)`` of one chunk: ``o`` float32 ``(C, value block)``, the state float32 ``(K_pad, value block)``.

    ``q``, ``k``, ``v`` in the input dtype, ``g`` ``(C, K_pad)`` and ``beta`` ``(C, 1)`` float32,
    every row past the end of the sequence already zero (no decay, no write). ``lower_bound``: static,
    a bound every ``g`` respects (the bounded path where ``fine_block_size`` allows it). ``packed``: a packed
    chunk's sequences (``kda.sequences.PackedChunk``) or None: its sequences' first rows reset the state
    (every key's decay ``exp(-inf)``), their initial states enter there and their final states leave.
    """
    operands = mxu_operand_dtype(q.dtype)
    q, k = prepared_queries_keys(q, k, scale=scale, use_qk_l2norm=use_qk_l2norm)
    resets = entering = None
    if packed is not None:
        g = packed_log_decays(g)
        resets = packed.resets()
        entering = packed.entering(q, k, g, operands)
    o, state_out, delta = chunk_core(q, k, v, g, beta, state, entering, operands=operands, lower_bound=lower_bound, resets=resets)
    if packed is not None:
        packed.leave(k, g, delta, state, operands)
    return o, state_out


def packed_log_decays(g: jax.Array) -> jax.Array:
    """A packed chunk's ``g`` with ``-inf`` taken as ``RESET_LOG_DECAY``, for the sequences' run sums too (``-inf`` times a
    mask's 0 would be NaN)."""
    return jnp.maximum(g, RESET_LOG_DECAY)


def chunk_work(geometry: Geometry, use_qk_l2norm: bool, lower_bound: float | None = None, packed: bool = False) -> Work:
    """``chunk_step`` for one chunk and value block, counted op by op (a ragged last chunk computes whole;
    with several value blocks each redoes the decays and pairs); ``lower_bound`` and ``packed`` as ``chunk_step``'s
    (resets given)."""
    C, K, Vb = geometry.chunk_size, geometry.padded_key_dim, geometry.value_block
    fine = fine_block_size(C, lower_bound)
    coarse = len(coarse_level_sizes(C, fine))
    sections = 2 + 2 * coarse + (1 if fine else 0)  # the fine section e: in the one matmul, or its own when packed
    run_sums = 2 * sections * C * C * K + 2 * C * K
    per_level = 2 * (2 * C) * K * C  # a level's (or the sub-chunk's) products
    inverse = len(level_sizes(C)) * 2 * (2 * C * C * C)  # D_2s = D_s - D_s P_s D_s at every level, fine or coarse
    pairs_ = (coarse + (1 if fine else 0)) * per_level + inverse + (2 * C * C * C if fine and packed else 0)
    outputs = 2 * C * K * Vb + 2 * C * C * Vb + 2 * C * K * Vb + 2 * C * C * Vb + 2 * C * K * Vb
    exps = (sections + (1 if fine else 0)) * C * K + K + (2 * C if use_qk_l2norm else 0)
    return Work(flops=run_sums + pairs_ + outputs, transcendentals=exps)


def chunk_body_vmem(geometry: Geometry, lower_bound: float | None = None) -> int:
    """An upper estimate of the float32 values one grid step holds at once (bytes).

    The run masks and their decays (``(2 + 2 levels) C`` rows of ``C`` and ``K``, on the bounded path
    ``(3 + 2 coarse levels) C`` and ``exp(-e)``), float32 q, k and their decayed copies (6 of ``C x K``),
    a level's products (``2C x C``) and the ``C x C`` matrices (Aqk, a level's Akk, the inverse and a
    product; bounded: the sub-chunk's masked Akk, a level's restriction of it and the crossings besides),
    the state in and out, and four ``C x value block`` values (residual, delta, two partial outputs).
    """
    C, K, Vb = geometry.chunk_size, geometry.padded_key_dim, geometry.value_block
    fine = fine_block_size(C, lower_bound)
    sections = (2 + 2 * len(coarse_level_sizes(C, fine)) + (1 if fine else 0)) * C
    decays = sections + (C if fine else 0)
    squares = 6 + (3 if fine else 0)
    return 4 * (sections * C + 2 * decays * K + 6 * C * K + squares * C * C + 2 * K * Vb + 4 * C * Vb)
