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
``g`` (``_run_sums``, as exact as float32); none is a difference of two large cumulative sums, so a decay near 1 keeps float32
accuracy however large ``|b|`` grows. Rows a mask leaves empty get exponent 0, never a positive one.

**Resets.** A gate of ``-inf`` (``exp(-inf) = 0``: the key's row of the state is reset) would make the
masks' zeros times ``-inf`` NaN. It is taken as ``exponents.RESET_LOG_DECAY`` (``-2**100``) instead:
exponents here are only ever sums, never differences, so a run that holds it sums to ``-2**100`` or
below, whose ``exp`` is exactly 0, and every other run is untouched.

**The inverse**, exactly, along the same levels: with ``D_s`` the inverse of ``I + diag(beta) Akk``
restricted to blocks of ``s`` tokens (``D_1 = I``) and ``P_s`` the level-``s`` pairs of
``diag(beta) Akk``, ``D_2s = D_s - D_s P_s D_s`` (the inverse of ``[[A, 0], [C, D]]`` is
``[[A^-1, 0], [-D^-1 C A^-1, D^-1]]``). Blocked forward substitution; no truncated series.
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



def level_sizes(chunk_size: int) -> tuple[int, ...]:
    """Half-block sizes of the levels, finest first: 1, 2, ..., chunk_size / 2."""
    return tuple(1 << n for n in range(chunk_size.bit_length() - 1))


def _block(index: jax.Array, size: int) -> jax.Array:
    """Which block of ``size`` tokens (a power of two) ``index`` lies in."""
    return lax.shift_right_logical(index, jnp.int32(size.bit_length() - 1))


def _in_later_half(index: jax.Array, size: int) -> jax.Array:
    """Whether ``index`` is in the later half of its block of ``2 * size`` tokens."""
    return (_block(index, size) & 1) == 1


def _run_masks(chunk_size: int) -> jax.Array:
    """0/1 rows ``(2 + 2 * levels) * C x C``: row ``i`` of each ``C``-row section sums ``g`` over one run of tokens.

    Sections: ``(.., i]`` (``b_i``), ``(i, ..)`` (``b_C - b_i``), then per level the run from the
    level's point ``r`` to ``i`` for later-half tokens (``b_i - b_r``) and from ``i`` to ``r`` for
    earlier-half tokens (``b_r - b_i``); tokens in the other half get an empty run.
    """
    i, t = row_and_column_iotas(chunk_size)
    sections = [t <= i, t > i]
    for s in level_sizes(chunk_size):
        same_half_block = _block(i, 2 * s) == _block(t, 2 * s)
        later_i, later_t = _in_later_half(i, s), _in_later_half(t, s)
        sections.append(same_half_block & later_i & later_t & (t <= i))
        sections.append(same_half_block & ~later_i & ~later_t & (t > i))
    return jnp.concatenate([m.astype(_F32) for m in sections], axis=0)


def _run_sums(masks: jax.Array, g: jax.Array) -> jax.Array:
    """``masks @ g`` to float32 accuracy in three native bf16 passes (HIGHEST takes six).

    The 0/1 masks are exact in bf16 and ``g`` splits exactly into three bf16 parts
    (``bf16_parts``), so every product is exact and only the float32 accumulation rounds, as at
    HIGHEST. The high parts of the non-positive ``g`` share its sign and carry all but 2**-16 of
    each sum, so the runs keep their accuracy without cancellation (and ``RESET_LOG_DECAY`` is
    its own high part).
    """
    masks = masks.astype(jnp.bfloat16)
    return functools.reduce(operator.add, (matmul(masks, part, jnp.bfloat16) for part in bf16_parts(g, 3)))


@dataclasses.dataclass(frozen=True)
class Decays:
    """Every decay one chunk needs, ``exp`` of the run sums of ``_run_masks``."""

    to_token: jax.Array  # (C, K): exp(b_i)
    to_end: jax.Array  # (C, K): exp(b_C - b_i)
    whole: jax.Array  # (K, 1): exp(b_C), a column to scale the state's rows
    levels: tuple[tuple[jax.Array, jax.Array], ...]  # per level, finest first: (exp(b_i - b_r), exp(b_r - b_j)), (C, K) each

    @classmethod
    def compute(cls, g: jax.Array) -> Decays:
        """From the chunk's log decays ``g`` (float32 ``(C, K)``, zero in rows past the end of the sequence, ``-inf`` a reset)."""
        C = g.shape[0]
        g = jnp.maximum(g, RESET_LOG_DECAY)
        decays = jnp.exp(_run_sums(_run_masks(C), g))
        sections = [decays[n * C : (n + 1) * C] for n in range(decays.shape[0] // C)]
        whole = jnp.exp(matmul(g, jnp.ones((C, 1), _F32), _F32, COLUMNS_BY_COLUMNS))
        levels = tuple(zip(sections[2::2], sections[3::2]))
        return cls(to_token=sections[0], to_end=sections[1], whole=whole, levels=levels)


def l2_normalised(x: jax.Array) -> jax.Array:
    return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2NORM_EPSILON)


@dataclasses.dataclass(frozen=True)
class Pairs:
    aqk: jax.Array  # (C, C), zero above the diagonal
    inverse: jax.Array  # (C, C): (I + diag(beta) Akk)^-1, unit lower-triangular


def pairs(q: jax.Array, k: jax.Array, beta: jax.Array, decays: Decays, operands) -> Pairs:
    """``Aqk`` and the exact inverse of ``I + diag(beta) Akk``, level by level (float32 ``q``, ``k``; ``beta`` ``(C, 1)``)."""
    C = k.shape[0]
    i, j = row_and_column_iotas(C)
    rows = lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    aqk = jnp.where(i == j, jnp.sum(q * k, axis=1, keepdims=True), 0.0)
    inverse = (i == j).astype(_F32)
    for s, (later_decay, earlier_decay) in zip(level_sizes(C), decays.levels):
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


def chunk_step(q, k, v, g, beta, state, *, scale: float, use_qk_l2norm: bool):
    """``(o, S_out)`` of one chunk: ``o`` float32 ``(C, value block)``, the state float32 ``(K_pad, value block)``.

    ``q``, ``k``, ``v`` in the input dtype, ``g`` ``(C, K_pad)`` and ``beta`` ``(C, 1)`` float32,
    every row past the end of the sequence already zero (no decay, no write).
    """
    operands = mxu_operand_dtype(q.dtype)
    q, k = q.astype(_F32), k.astype(_F32)
    if use_qk_l2norm:
        q, k = l2_normalised(q), l2_normalised(k)
    q = q * scale
    decays = Decays.compute(g)
    p = pairs(q, k, beta, decays, operands)
    residual = v.astype(_F32) - matmul(k * decays.to_token, state, operands)
    delta = matmul(p.inverse, beta * residual, operands)
    o = matmul(q * decays.to_token, state, operands) + matmul(p.aqk, delta, operands)
    state_out = decays.whole * state + matmul(k * decays.to_end, delta, operands, COLUMNS_BY_COLUMNS)
    return o, state_out


def chunk_work(geometry: Geometry, use_qk_l2norm: bool) -> Work:
    """``chunk_step`` for one chunk and value block, counted op by op (a ragged last chunk computes whole;
    with several value blocks each redoes the decays and pairs)."""
    C, K, Vb = geometry.chunk_size, geometry.padded_key_dim, geometry.value_block
    levels = len(level_sizes(C))
    run_sums = 2 * (2 + 2 * levels) * C * C * K + 2 * C * K
    per_level = 2 * (2 * C) * K * C + 2 * (2 * C * C * C)
    outputs = 2 * C * K * Vb + 2 * C * C * Vb + 2 * C * K * Vb + 2 * C * C * Vb + 2 * C * K * Vb
    exps = (2 + 2 * levels) * C * K + K + (2 * C if use_qk_l2norm else 0)
    return Work(flops=run_sums + levels * per_level + outputs, transcendentals=exps)


def chunk_body_vmem(geometry: Geometry) -> int:
    """An upper estimate of the float32 values one grid step holds at once (bytes).

    The run masks and their decays (``(2 + 2 levels) C`` rows of ``C`` and ``K``), float32 q, k
    and their decayed copies (6 of ``C x K``), a level's products (``2C x C``) and the ``C x C``
    matrices (Aqk, a level's Akk, the inverse and a product), the state in and out, and four
    ``C x value block`` values (residual, delta, two partial outputs).
    """
    C, K, Vb = geometry.chunk_size, geometry.padded_key_dim, geometry.value_block
    sections = (2 + 2 * len(level_sizes(C))) * C
    return 4 * (sections * C + 2 * sections * K + 6 * C * K + 6 * C * C + 2 * K * Vb + 4 * C * Vb)
