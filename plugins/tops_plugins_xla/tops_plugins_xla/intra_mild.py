"""Inside one chunk of per-key decays whose whole log decay is mild: prefix products and one dense pair product.

``intra`` builds every decay of a chunk along the halving so that no factor exceeds 1, whatever the
gates: the price is a batched product per level and the levels' bookkeeping, which XLA:CPU runs far
below its rate for one dense product. Most chunks of a trained model do not need that care: with
gla's usual gates (``log_sigmoid(x) / 16``) a chunk of 64 tokens decays by ``exp(-3)`` or so in
every key. When every key's log decay over the chunk, ``b_C``, is at least ``-MILD_LOG_DECAY``,
one reference point per chunk is safe: with ``b_C`` as that point,

    Aqk[i, j] = sum_d (q[i, d] / exp(b_C - b[i, d])) (k[j, d] exp(b_C - b[j, d]))

where the second factor is the decay the state update needs anyway and the first is at most
``exp(MILD_LOG_DECAY)`` times ``q``. Every factor is then a normal float32 number (``exp(-40)`` is
``4e-18``, far above float32's smallest normal ``1e-38``), each product ``q k exp(b_i - b_j)`` is
formed from two factors each accurate to a few roundings (no difference of cumulative gates is
exponentiated), and the masked entries above the diagonal are at most ``exp(40)`` times
``q k``: finite, and dropped by a select. A chunk with a stronger decay anywhere (or a gate of
``-inf``) takes ``intra``'s halving; ``is_mild`` decides, for all rows and heads of a chunk at once.

**Prefix products.** ``exp(b)`` is the running product of ``exp(g)`` over the chunk, built in two
passes of sequential products (inside blocks of about ``sqrt(C)`` tokens, then across the blocks),
which XLA fuses into a few loops; ``jax.lax.cumprod`` and ``cumsum`` run many times slower on CPU.
``exp(b_C - b)`` is ``exp(b_C) / exp(b)``: one rounding more, and never above 1.

**Gradients.** The first factor's exponent ``b_i - b_C`` is minus the second's, so the pair
products' gradients land on ``exp(b_C - b)`` alone, the diagonal's (which carries no decay) left out.
``dg`` then sums each exponent's gradient over the tokens whose gates it holds (``decays_backward``),
never as a difference of larger sums: at ``g = -10`` per token such a difference was 1e-3 off
in relative terms, where these sums match the halving's ``dg`` to rounding.

Leading axes are batch axes; tokens are axis ``-2`` and keys axis ``-1`` (``[..., C, K]``).
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

from tops_plugins_xla.intra import DecayCotangents, Decays
from tops_plugins_xla.sweep import einsum

Array = jax.Array

MILD_LOG_DECAY = 40.0
"""The strongest log decay over a chunk, in any key, that the dense pair product takes."""


def is_mild(g: Array) -> Array:
    """Whether every key's log decay over the chunk (``g`` ``[..., C, K]``, all leading axes) is at least ``-MILD_LOG_DECAY``.

    False for a gate of ``-inf`` (and for NaN), which ``intra``'s halving handles.
    """
    return jnp.all(jnp.sum(g, axis=-2) >= -MILD_LOG_DECAY)


def decays(g: Array) -> Decays:
    """The chunk's decays from its log decays ``g``, as running products of ``exp(g)``; no halving levels."""
    to_token = running(jnp.exp(g), operator.mul)
    whole = to_token[..., -1:, :]
    return Decays(levels=(), to_token=to_token, to_end=whole / to_token, whole=whole)


def query_pairs(q: Array, k: Array, decays: Decays) -> Array:
    """``Aqk`` (``[..., C, C]``, zero above the diagonal) as one product, for a mild chunk."""
    return jnp.tril(einsum("...ik,...jk->...ij", q / decays.to_end, k * decays.to_end))


def pairs_backward(q: Array, k: Array, decays: Decays, daqk: Array) -> tuple[Array, Array, Array]:
    """``(dq, dk, d_to_end)`` for the cotangent ``daqk`` of ``query_pairs`` (only its entries on and below the diagonal
    are read); ``d_to_end`` is the gradient of the exponents of ``decays.to_end``, ``[..., C, K]``.

    The diagonal carries no decay, so it is kept out of the exponents' gradients, where its terms would
    enter twice with opposite signs and leave their rounding in ``dg``.
    """
    diagonal = jnp.diagonal(daqk, axis1=-2, axis2=-1)[..., None]
    below = jnp.tril(daqk, -1)
    query, key = q / decays.to_end, k * decays.to_end
    d_query = einsum("...ij,...jk->...ik", below, key)
    d_key = einsum("...ij,...ik->...jk", below, query)
    dq = d_query / decays.to_end + diagonal * k
    dk = d_key * decays.to_end + diagonal * q
    return dq, dk, key * d_key - query * d_query


def decays_backward(d: DecayCotangents) -> Array:
    """``dg`` from the gradients of the exponents of ``decays``' results.

    Token ``t``'s gate is in ``b_i`` for ``i >= t`` (``to_token``), in ``b_C - b_j`` for ``j < t``
    (``to_end``) and in ``b_C``. Each is a running sum over exactly its own terms: a suffix sum taken as the
    total less a prefix (or a prefix as its inclusive sum less the token's own term) would carry the rounding
    of terms larger than the result.
    """
    suffix = jnp.flip(running(jnp.flip(d.to_token, axis=-2), operator.add), axis=-2)
    prefix = running(jnp.concatenate([jnp.zeros_like(d.to_end[..., :1, :]), d.to_end[..., :-1, :]], axis=-2), operator.add)
    return suffix + prefix + d.whole


def running(x: Array, combine) -> Array:
    """The inclusive running ``combine`` (``operator.mul`` or ``operator.add``) of ``x`` along its tokens (axis ``-2``):
    sequentially inside blocks of about ``sqrt(C)`` tokens, then across the blocks."""
    C, K = x.shape[-2:]
    size = 1 << (C.bit_length() // 2)
    blocks = x.reshape(*x.shape[:-2], C // size, size, K)
    inside = [blocks[..., 0, :]]
    for i in range(1, size):
        inside.append(combine(inside[-1], blocks[..., i, :]))
    across = [inside[-1][..., 0, :]]  # through the end of each block
    for i in range(1, C // size):
        across.append(combine(across[-1], inside[-1][..., i, :]))
    inside = jnp.stack(inside, axis=-2)  # [..., blocks, size, K]
    before = jnp.stack(across[:-1], axis=-2)[..., None, :]  # through the end of the previous block, for blocks 1 on
    return jnp.concatenate([inside[..., :1, :, :], combine(inside[..., 1:, :, :], before)], axis=-3).reshape(x.shape)
