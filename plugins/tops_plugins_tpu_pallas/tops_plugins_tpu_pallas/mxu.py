"""The MXU products every kernel of this plugin takes: operand dtypes, float32 accumulation, and the
contractions by name. Op-independent; each op's chunk math (``simple_gla.chunkwise``, ``kda.chunkwise``) builds on it."""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32
ROWS_BY_COLUMNS = ((1,), (0,))
ROWS_BY_ROWS = ((1,), (1,))  # a @ b.T
COLUMNS_BY_COLUMNS = ((0,), (0,))  # a.T @ b


def mxu_operand_dtype(input_dtype) -> jnp.dtype:
    """The dtype the float32 intermediates (attention matrix, state, decayed keys) take into the forward's MXU products.

    bf16 inputs: bf16, as flash-linear-attention does: one MXU pass per matmul, float32
    accumulation. float32 inputs: float32 at HIGHEST precision, or the float32 tolerance (docs/ops.md) would
    not hold on a TPU. README.md "Numerics" gives the measured errors behind this choice.
    """
    return jnp.dtype(input_dtype)


SPLIT_BFLOAT16 = "bfloat16 high + low"
"""``matmul``'s operands for a product of a bf16 input and a float32 intermediate that must keep ~16 bits:
the float32 operand splits into two bf16 parts (``bf16_parts``), two native passes instead of six at HIGHEST."""


SPLIT_BFLOAT16_STACKED = "bfloat16 high + low, stacked"
"""``SPLIT_BFLOAT16``'s products as one: the parts stacked along the contraction, so a 256-deep MXU (v6e) takes the two
128-deep halves in one pass instead of two, and sums them before its one result."""


def bf16_parts(x: jax.Array, count: int) -> list[jax.Array]:
    """``x`` (float32) as ``count`` float32 arrays that sum to it exactly, each but the last exact in bf16.

    Each part is the bf16 rounding of what the previous ones leave, the last part the rest: 8 more
    bits of the significand per part, so three parts hold all 24 exactly and two hold about 16.
    """
    parts, rest = [], x
    for _ in range(count - 1):
        part = rest.astype(jnp.bfloat16).astype(_F32)
        parts.append(part)
        rest = rest - part
    return [*parts, rest]


def matmul(a: jax.Array, b: jax.Array, operands, contracting=ROWS_BY_COLUMNS) -> jax.Array:
    """A float32-accumulating matmul whose operands are rounded to ``operands`` (a dtype, ``SPLIT_BFLOAT16`` or
    ``SPLIT_BFLOAT16_STACKED``) for the MXU.

    A bf16 x bf16 product is exact in float32, so bf16 operands need one native pass. float32
    operands ask for HIGHEST precision: at the default a TPU rounds them to bf16. ``SPLIT_BFLOAT16``
    splits each float32 operand into a high and a low bf16 part and sums the products of the parts
    but low x low (2 passes with one float32 operand, 3 with two); a bf16 operand goes in whole.
    """
    if isinstance(operands, str) and operands in (SPLIT_BFLOAT16, SPLIT_BFLOAT16_STACKED):
        a_parts, b_parts = (bf16_parts(x, 2) if x.dtype == _F32 else [x] for x in (a, b))
        pairs = [(a_part, b_part) for i, a_part in enumerate(a_parts) for j, b_part in enumerate(b_parts) if i + j < 2]
        if operands == SPLIT_BFLOAT16_STACKED:
            stacked = (jnp.concatenate([pair[side] for pair in pairs], axis=contracting[side][0]) for side in (0, 1))
            return matmul(*stacked, jnp.bfloat16, contracting)
        return functools.reduce(operator.add, (matmul(a_part, b_part, jnp.bfloat16, contracting) for a_part, b_part in pairs))
    return _product(a, b, jnp.dtype(operands), contracting)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _product(a: jax.Array, b: jax.Array, operands: jnp.dtype, contracting) -> jax.Array:
    """One MXU product of ``a`` and ``b`` rounded to ``operands``, float32 accumulation.

    Differentiable with products of the same kind (``_product_cotangents``): float32 cotangents, each
    contraction one Mosaic takes as it is (no transpose of an operand), where jax's own rule would
    round the cotangents to the operands' dtype and transpose.
    """
    precision = lax.Precision.HIGHEST if operands == _F32 else lax.Precision.DEFAULT
    return lax.dot_general(
        a.astype(operands), b.astype(operands), (contracting, ((), ())), precision=precision, preferred_element_type=_F32
    )


def _product_forward(a, b, operands, contracting):
    return _product(a, b, operands, contracting), (a, b)


def _product_cotangents(operands, contracting, residuals, cotangent):
    a, b = residuals
    if contracting == ROWS_BY_COLUMNS:  # a @ b
        da, db = _product(cotangent, b, operands, ROWS_BY_ROWS), _product(a, cotangent, operands, COLUMNS_BY_COLUMNS)
    elif contracting == ROWS_BY_ROWS:  # a @ b.T
        da, db = _product(cotangent, b, operands, ROWS_BY_COLUMNS), _product(cotangent, a, operands, COLUMNS_BY_COLUMNS)
    else:  # a.T @ b
        da, db = _product(b, cotangent, operands, ROWS_BY_ROWS), _product(a, cotangent, operands, ROWS_BY_COLUMNS)
    return da.astype(a.dtype), db.astype(b.dtype)


_product.defvjp(_product_forward, _product_cotangents)


def known_product(known: jax.Array, a: jax.Array, b: jax.Array, operands, contracting=ROWS_BY_COLUMNS) -> jax.Array:
    """``matmul(a, b, operands, contracting)`` whose value is ``known``, computed from the same ``a`` and ``b`` earlier in the
    kernel, with the product's cotangents: a VJP whose primal would compute the product again takes it as it is.
    ``operands`` a dtype (one ``_product``)."""
    return _known_product(known, a, b, jnp.dtype(operands), contracting)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _known_product(known, a, b, operands, contracting):
    del a, b, operands, contracting
    return known


def _known_product_forward(known, a, b, operands, contracting):
    del operands, contracting
    return known, (a, b)


def _known_product_cotangents(operands, contracting, residuals, cotangent):
    return (jnp.zeros_like(cotangent), *_product_cotangents(operands, contracting, residuals, cotangent))


_known_product.defvjp(_known_product_forward, _known_product_cotangents)


def row_and_column_iotas(size: int) -> tuple[jax.Array, jax.Array]:
    return lax.broadcasted_iota(jnp.int32, (size, size), 0), lax.broadcasted_iota(jnp.int32, (size, size), 1)


def row_to_column(row: jax.Array) -> jax.Array:
    """``(1, n)`` -> ``(n, 1)``, ``column_to_row``'s way: a masked sum over the lanes, exact."""
    rows, columns = row_and_column_iotas(row.shape[1])
    return jnp.sum(jnp.where(rows == columns, row, 0.0), axis=1, keepdims=True)


def column_to_row(column: jax.Array) -> jax.Array:
    """``(n, 1)`` -> ``(1, n)`` by a masked sum over the rows: exact (one term per column is nonzero), no transpose
    support needed. A product with the identity at HIGHEST is exact too, but six MXU passes: for gated_delta_rule's
    ``dg`` and ``dbeta`` rows, after the step's other work, its backward's gradients kernel took 812649 cycles on v6e
    that way, 746681 this way."""
    rows, columns = row_and_column_iotas(column.shape[0])
    return jnp.sum(jnp.where(rows == columns, column, 0.0), axis=0, keepdims=True)
