"""Inside one chunk of the delta rule with one gate per head and token (gated_delta_rule): dense pair products.

With one decay per token, the pair decay ``D[i, j] = exp(b_i - b_j)`` (``j <= i``) factors out of the sum
over the keys, so ``Aqk = (q k^T) * D`` and ``Akk = (k k^T) * D`` (strictly lower) are one product each over
the whole chunk, where kda (``intra``) needs a product per halving level. ``D`` itself is built from the
halving's decays of ``intra.decays`` on gates of width 1: every entry ``exp(b_i - r) exp(r - b_j)``, two
decays over tokens in time order, never a difference of cumulative gates, so nothing overflows and a gate
of ``-inf`` gives exact zeros. The inverse is ``intra.unit_lower_inverse``.

``pairs`` and ``pairs_backward`` take and return what ``intra``'s do (``levels`` of width-1 decays; the
exponents' gradients per level), so the delta rule's sweeps (``delta_rule``) run on either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tops_plugins_xla.intra import Level, Pairs, assemble, diagonal_blocks, unit_lower_inverse
from tops_plugins_xla.sweep import einsum

Array = jax.Array


def pair_decays(levels: tuple[Level, ...], k: Array) -> Array:
    """``D`` ``[..., C, C]`` of a chunk with keys ``k`` (``[..., C, K]``): 1 on the diagonal, 0 above it."""
    C = k.shape[-2]
    blocks = jnp.ones((*k.shape[:-2], C, 1, 1), k.dtype)
    for level in levels:
        blocks = assemble(blocks, level.later_decay * jnp.swapaxes(level.earlier_decay, -1, -2))
    return blocks.reshape(*k.shape[:-2], C, C)


def pairs(q: Array | None, k: Array, levels: tuple[Level, ...], beta: Array) -> Pairs:
    """``Aqk``, ``Akk`` and ``(I + diag(beta) Akk)^-1`` of a chunk, as ``intra.pairs``; ``Aqk`` only with queries."""
    C = k.shape[-2]
    decays = pair_decays(levels, k)
    products = einsum("...ik,...jk->...ij", k if q is None else jnp.concatenate([k, q], axis=-2), k)
    akk = products[..., :C, :] * jnp.tril(decays, -1)
    aqk = None if q is None else products[..., C:, :] * decays
    return Pairs(aqk=aqk, akk=akk, inverse=unit_lower_inverse(beta[..., None] * akk))


def pairs_backward(q: Array, k: Array, levels: tuple[Level, ...], daqk: Array, dakk: Array):
    """Gradients of ``Aqk`` and ``Akk`` for cotangents ``daqk`` and ``dakk``, as ``intra.pairs_backward``:
    ``(dq, dk, d_later, d_earlier)``, the last two the gradients of each level's exponents (width 1)."""
    C = k.shape[-2]
    decays = pair_decays(levels, k)
    by_query = daqk * decays  # the pair products' cotangents through their decays
    by_key = dakk * jnp.tril(decays, -1)
    dq = einsum("...ij,...jk->...ik", by_query, k)
    dk = einsum("...ij,...ik->...jk", jnp.concatenate([by_query, by_key], axis=-2), jnp.concatenate([q, k], axis=-2))
    dk += einsum("...ij,...jk->...ik", by_key, k)
    products = einsum("...ik,...jk->...ij", jnp.concatenate([q, k], axis=-2), k)
    d_exponents = by_query * products[..., :C, :] + by_key * products[..., C:, :]  # dD * D
    blocks = d_exponents[..., None, :, :]
    d_later, d_earlier = [], []
    for level in reversed(levels):
        s = level.size
        cross = blocks[..., s:, :s]
        d_later.append(jnp.sum(cross, axis=-1, keepdims=True))
        d_earlier.append(jnp.swapaxes(jnp.sum(cross, axis=-2, keepdims=True), -1, -2))
        blocks = diagonal_blocks(blocks, s)
    return dq, dk, tuple(reversed(d_later)), tuple(reversed(d_earlier))
