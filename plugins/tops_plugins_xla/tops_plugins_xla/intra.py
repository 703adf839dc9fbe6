"""Inside one chunk of per-key decays (kda, gla): the decays, the decayed token-pair products and kda's exact triangular inverse.

Per key ``d``, ``b[i, d] = g[1, d] + ... + g[i, d]`` is the cumulative log decay of token ``i``
inside the chunk. The chunked algorithm needs, for tokens ``j <= i`` of a chunk,

    Aqk[i, j] = sum_d q[i, d] k[j, d] exp(b[i, d] - b[j, d])        (j <= i)
    Akk[i, j] = sum_d k[i, d] k[j, d] exp(b[i, d] - b[j, d])        (j <  i)

and the inverse of the unit lower-triangular ``I + diag(beta) Akk``. With one decay per key the
decay does not factor out of the sum over ``d`` as one ``exp`` per pair, and factoring it as
``exp(b_i - r) * exp(r - b_j)`` around one reference point ``r`` per chunk overflows: one of the
two factors is ``exp`` of up to the chunk's whole log decay (``-640`` at ``g = -10``).

**Halving.** The pairs are split by halving: the chunk's second half against its first half,
then, inside each half, its second quarter against its first, and so on down to neighbouring
tokens. At every level the reference point ``r`` is the last token of the earlier block, so for
``j`` in the earlier block and ``i`` in the later one both factors, ``exp(b_i - r)`` and
``exp(r - b_j)``, are decays over tokens in time order (at most 1 when the gates are ``<= 0``).
Nothing above the diagonal is ever formed, and a factor only underflows where the exact product
is smaller still. Each level is one batched product per block pair; the diagonal ``i == j``
carries no decay.

**Decays without cancellation.** No exponent is ever a difference of cumulative gates:
``exp(b_i - r)`` is the product of ``exp(g)`` over the later block up to ``i`` (a prefix product
inside the block) and ``exp(r - b_j)`` the product over the earlier block after ``j`` (an exclusive
suffix product). Both are built bottom-up along the same halving, with the block totals, and the
last level yields the chunk's own ``exp(b)``, ``exp(b_C - b)`` and ``exp(b_C)``. Each decay is thus
accurate relative to its own size: ``exp(b_i - b_j)`` taken from a difference would carry the
rounding of ``b`` itself (``1e-5`` relative at ``|b| = 600`` in float32) into decays near 1. A
product of ``exp(g)``, each factor at most 1, never passes below its final value on the way, so
it underflows only where the exact decay does; and one ``exp`` per token and key, where summing
the exponents first took one per level. The gradient of ``g`` flows back along the same halving in
exponent space (``DecayCotangents``), so ``dg`` adds, for each token, the terms of the pairs whose
decay spans it, and nothing cancels.

**Inverse.** It is built along the same levels, exactly: for a unit lower-triangular block
matrix ``[[M_11, 0], [M_21, M_22]]`` the inverse is ``[[M_11^-1, 0], [-M_22^-1 M_21 M_11^-1,
M_22^-1]]``, starting from ``1`` on the diagonal. That is forward substitution done block by
block, about ``C^3 / 3`` multiply-adds; no truncated series.

Leading axes are batch axes; tokens are axis ``-2`` and keys axis ``-1`` (``[..., C, K]``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tops_plugins_xla.sweep import einsum

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Level:
    """One halving level: blocks of ``2 * size`` tokens, each its later half against its earlier half."""

    size: int = dataclasses.field(metadata=dict(static=True))
    later_decay: Array
    """``[..., blocks, size, K]``: ``exp(b_i - r)`` for the tokens ``i`` of each later half."""
    earlier_decay: Array
    """``[..., blocks, size, K]``: ``exp(r - b_j)`` for the tokens ``j`` of each earlier half."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Decays:
    """Every decay of a chunk, from its log decays ``g``."""

    levels: tuple[Level, ...]
    """Finest level first."""
    to_token: Array
    """``[..., C, K]``: ``exp(b)``, from the chunk start through each token."""
    to_end: Array
    """``[..., C, K]``: ``exp(b_C - b)``, from after each token to the chunk end."""
    whole: Array
    """``[..., 1, K]``: ``exp(b_C)``."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecayCotangents:
    """Gradients of the exponents of ``Decays`` (a factor ``f = exp(x)`` times ``x``: ``dx = f df``)."""

    later: tuple[Array, ...]
    """Per level (finest first), of the exponents of ``later_decay``."""
    earlier: tuple[Array, ...]
    to_token: Array
    to_end: Array
    whole: Array


def decays(g: Array) -> Decays:
    """The decays of a chunk with log decays ``g`` (``[..., C, K]``), as products along the halving.

    ``running`` holds each token's inclusive prefix product and exclusive suffix product of ``exp(g)``
    inside its block (``[2, ..., C, K]``), ``total`` each block's product (``[..., blocks, K]``); blocks
    start as single tokens.
    """
    C = g.shape[-2]
    token = jnp.exp(g)
    running, total = jnp.stack([token, jnp.ones_like(token)]), token
    result = []
    size = 1
    while size < C:
        earlier, later = halves(running, size)
        total_earlier, total_later = halves(total, 1)
        result.append(Level(size, later[0], earlier[1]))
        ones = jnp.ones_like(total_earlier)
        # The later half's prefix products start after the earlier half; the earlier half's suffix products run on through the later.
        running = join(earlier * jnp.stack([ones, total_later]), later * jnp.stack([total_earlier, ones]))
        total = (total_earlier * total_later)[..., 0, :]
        size *= 2
    return Decays(tuple(result), running[0], running[1], total)


def decays_backward(d: DecayCotangents) -> Array:
    """``dg`` from the gradients of the exponents: the reverse of ``decays``' sums, coarsest level first."""
    d_sums, d_total = jnp.stack([d.to_token, d.to_end]), d.whole
    for d_later, d_earlier in zip(reversed(d.later), reversed(d.earlier)):
        size = d_later.shape[-2]
        earlier, later = halves(d_sums, size)
        d_block = d_total[..., :, None, :]
        d_total = join(d_block + jnp.sum(later[0], axis=-2, keepdims=True),
                       d_block + jnp.sum(earlier[1], axis=-2, keepdims=True))
        zeros = jnp.zeros_like(d_later)
        d_sums = join(earlier + jnp.stack([zeros, d_earlier]), later + jnp.stack([d_later, zeros]))
    return d_sums[0] + d_total


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pairs:
    """The pair products of one chunk."""

    aqk: Array | None
    """``[..., C, C]``: ``Aqk``, zero above the diagonal; None when no queries were given."""
    akk: Array
    """``[..., C, C]``: ``Akk`` (without ``beta``), zero on and above the diagonal."""
    inverse: Array
    """``[..., C, C]``: ``(I + diag(beta) Akk)^-1``, unit lower-triangular."""


def pairs(q: Array | None, k: Array, levels: tuple[Level, ...], beta: Array) -> Pairs:
    """``Aqk``, ``Akk`` and ``(I + diag(beta) Akk)^-1`` of a chunk; ``beta`` is ``[..., C]``.

    Without queries (``q`` None: the sweep that only carries the state) ``Aqk`` is not formed.
    """
    C = k.shape[-2]
    ones = jnp.ones((*k.shape[:-2], C, 1, 1), k.dtype)
    # 1x1 diagonal blocks of Akk and the inverse (and Aqk): [2 or 3, ..., C, 1, 1].
    blocks = [jnp.zeros_like(ones), ones]
    if q is not None:
        blocks.append(jnp.sum(q * k, axis=-1)[..., None, None])
    blocks = jnp.stack(blocks)
    for level in levels:
        s = level.size
        k_earlier, k_later = halves(k, s)
        _, beta_later = halves(beta[..., None], s)
        later = [k_later]
        if q is not None:
            later.append(halves(q, s)[1])
        later = jnp.concatenate([x * level.later_decay for x in later], axis=-2)
        cross = einsum("...ik,...jk->...ij", later, k_earlier * level.earlier_decay)
        akk_cross = cross[..., :s, :]
        crosses = [akk_cross, inverse_cross(blocks[1], beta_later * akk_cross)] + ([cross[..., s:, :]] if q is not None else [])
        blocks = assemble(blocks, jnp.stack(crosses))
    blocks = blocks.reshape(len(blocks), *k.shape[:-2], C, C)
    return Pairs(aqk=blocks[2] if q is not None else None, akk=blocks[0], inverse=blocks[1])


def inverse_cross(inverse_blocks: Array, cross: Array) -> Array:
    """One level of the blockwise inverse of a unit lower-triangular matrix: from the inverse's diagonal blocks
    ``[..., 2 m, s, s]`` and the matrix's lower-left blocks between each pair ``[..., m, s, s]``, the inverse's
    lower-left blocks ``-M_22^-1 M_21 M_11^-1``."""
    inverse_earlier, inverse_later = block_pairs(inverse_blocks)
    return -einsum("...ij,...jl->...il", inverse_later, einsum("...ij,...jl->...il", cross, inverse_earlier))


def unit_lower_inverse(a: Array) -> Array:
    """``(I + a)^-1`` for a strictly lower-triangular ``a`` (``[..., C, C]``), built along the halving levels as
    ``pairs`` builds kda's: forward substitution a block at a time, exact."""
    C = a.shape[-1]
    blocks = jnp.ones((*a.shape[:-2], C, 1, 1), a.dtype)
    size = 1
    while size < C:
        blocks = assemble(blocks, inverse_cross(blocks, diagonal_tiles(a, 2 * size)[..., size:, :size]))
        size *= 2
    return blocks.reshape(a.shape)


def query_pairs(q: Array, k: Array, levels: tuple[Level, ...]) -> Array:
    """``Aqk`` alone (``[..., C, C]``, zero above the diagonal), for an op without the delta rule (gla)."""
    C = k.shape[-2]
    blocks = jnp.sum(q * k, axis=-1)[..., None, None]  # the 1x1 diagonal blocks [..., C, 1, 1]
    for level in levels:
        s = level.size
        k_earlier, _ = halves(k, s)
        _, q_later = halves(q, s)
        blocks = assemble(blocks, einsum("...ik,...jk->...ij", q_later * level.later_decay, k_earlier * level.earlier_decay))
    return blocks.reshape(*k.shape[:-2], C, C)


def pairs_backward(q: Array, k: Array, levels: tuple[Level, ...], daqk: Array, dakk: Array | None = None):
    """Gradients of ``Aqk`` and ``Akk`` for cotangents ``daqk`` and ``dakk`` (``[..., C, C]``; ``dakk`` None:
    ``Aqk`` alone, as ``query_pairs`` builds it).

    Returns ``(dq, dk, d_later, d_earlier)``: the last two per level (finest first), the
    gradients of the exponents of its decays. Only the entries ``Aqk`` and ``Akk`` have are read
    (on and below, or strictly below the diagonal).
    """
    diagonal = jnp.diagonal(daqk, axis1=-2, axis2=-1)[..., None]
    dq = diagonal * k
    dk = diagonal * q
    d_later, d_earlier = [], []
    with_keys = dakk is not None
    blocks = jnp.stack([daqk, dakk] if with_keys else [daqk])[..., None, :, :]
    for level in reversed(levels):
        s = level.size
        cotangent = jnp.concatenate([block[..., s:, :s] for block in blocks], axis=-2)
        blocks = diagonal_blocks(blocks, s)
        k_earlier, k_later = halves(k, s)
        _, q_later = halves(q, s)
        later = [q_later * level.later_decay] + ([k_later * level.later_decay] if with_keys else [])
        k_earlier = k_earlier * level.earlier_decay
        d_later_products = einsum("...ij,...jk->...ik", cotangent, k_earlier)
        dk_earlier = einsum("...ij,...ik->...jk", cotangent, jnp.concatenate(later, axis=-2))
        dq_later = d_later_products[..., :s, :]
        dq += join(jnp.zeros_like(dq_later), level.later_decay * dq_later)
        d_exponent = later[0] * dq_later
        dk_later = jnp.zeros_like(dq_later)
        if with_keys:
            dk_later = d_later_products[..., s:, :]
            d_exponent += later[1] * dk_later
        dk += join(level.earlier_decay * dk_earlier, level.later_decay * dk_later)
        d_later.append(d_exponent)
        d_earlier.append(k_earlier * dk_earlier)
    return dq, dk, tuple(reversed(d_later)), tuple(reversed(d_earlier))


# -- block bookkeeping ---------------------------------------------------------------------------


def halves(x: Array, size: int) -> tuple[Array, Array]:
    """``[..., C, F]`` -> the earlier and later halves of each block of ``2 * size`` rows, ``[..., C / (2 size), size, F]`` each."""
    C, F = x.shape[-2:]
    blocks = x.reshape(*x.shape[:-2], C // (2 * size), 2, size, F)
    return blocks[..., 0, :, :], blocks[..., 1, :, :]


def join(earlier: Array, later: Array) -> Array:
    """The inverse of ``halves``."""
    blocks = jnp.stack([earlier, later], axis=-3)
    return blocks.reshape(*blocks.shape[:-4], -1, blocks.shape[-1])


def block_pairs(blocks: Array) -> tuple[Array, Array]:
    """``[..., 2 m, s, s]`` diagonal blocks -> the earlier and the later of each pair, ``[..., m, s, s]`` each."""
    pairs = blocks.reshape(*blocks.shape[:-3], -1, 2, *blocks.shape[-2:])
    return pairs[..., 0, :, :], pairs[..., 1, :, :]


def assemble(blocks: Array, cross: Array) -> Array:
    """Diagonal blocks ``[..., 2 m, s, s]`` and the lower-left blocks ``[..., m, s, s]`` between each pair
    -> lower-triangular blocks ``[..., m, 2 s, 2 s]``."""
    earlier, later = block_pairs(blocks)
    top = jnp.concatenate([earlier, jnp.zeros_like(earlier)], axis=-1)
    bottom = jnp.concatenate([cross, later], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


def diagonal_tiles(a: Array, size: int) -> Array:
    """``[..., C, C]`` -> its diagonal blocks of ``size``, ``[..., C / size, size, size]``."""
    m = a.shape[-1] // size
    tiles = a.reshape(*a.shape[:-2], m, size, m, size)
    return jnp.moveaxis(jnp.diagonal(tiles, axis1=-4, axis2=-2), -1, -3)


def diagonal_blocks(blocks: Array, size: int) -> Array:
    """``[..., m, 2 s, 2 s]`` -> its two diagonal blocks of size ``s``, ``[..., 2 m, s, s]``: the inverse of ``assemble``."""
    pairs = jnp.stack([blocks[..., :size, :size], blocks[..., size:, size:]], axis=-3)
    return pairs.reshape(*pairs.shape[:-4], -1, size, size)
