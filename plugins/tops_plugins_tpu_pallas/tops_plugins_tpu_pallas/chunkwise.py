"""What one chunk of simple_gla does, written once for every kernel of this plugin.

Inside a chunk of ``C`` tokens, with ``b_i`` the cumulative log decay from the chunk's start up
to and including token ``i`` and ``S`` the state entering the chunk::

    o_i   = scale * (exp(b_i) * q_i S + sum_{j <= i} exp(b_i - b_j) (q_i . k_j) v_j)
    S_out = exp(b_C) * S + sum_j exp(b_C - b_j) k_j^T v_j

Numerics (docs/architecture.md "Numerics"): only differences of cumulative gates are
exponentiated, never ``exp(-b)``; the exponent is masked to 0 above the diagonal *before* ``exp``
(there ``b_i - b_j`` is positive and overflows for strong decays at chunk 128); every matmul
accumulates in float32, with operands in the dtype ``mxu_operand_dtype`` picks. Rows of a ragged
last chunk that lie past the end of the sequence are zeroed with ``where`` as they are read
(``Chunk.read``), and stop the constant decay, so they add nothing and decay nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tops_plugins_tpu_pallas.layout import LANES, Geometry

_F32 = jnp.float32
_ROWS_BY_COLUMNS = ((1,), (0,))
_ROWS_BY_ROWS = ((1,), (1,))  # a @ b.T
_COLUMNS_BY_COLUMNS = ((0,), (0,))  # a.T @ b


def mxu_operand_dtype(input_dtype) -> jnp.dtype:
    """The dtype the float32 intermediates (attention matrix, state, decayed keys) take into the MXU.

    bf16 inputs: bf16, as flash-linear-attention does: one MXU pass per matmul, float32
    accumulation. float32 inputs: float32 at HIGHEST precision, or the float32 tolerance (docs/ops.md) would
    not hold on a TPU. README.md "Numerics" gives the measured errors behind this choice.
    """
    return jnp.dtype(input_dtype)


def matmul(a: jax.Array, b: jax.Array, operands, contracting=_ROWS_BY_COLUMNS) -> jax.Array:
    """A float32-accumulating matmul whose operands are rounded to ``operands`` (a dtype) for the MXU.

    A bf16 x bf16 product is exact in float32, so bf16 operands need one native pass. float32
    operands ask for HIGHEST precision: at the default a TPU rounds them to bf16.
    """
    operands = jnp.dtype(operands)
    precision = lax.Precision.HIGHEST if operands == _F32 else lax.Precision.DEFAULT
    return lax.dot_general(
        a.astype(operands), b.astype(operands), (contracting, ((), ())), precision=precision, preferred_element_type=_F32
    )


def _row_and_column_iotas(size: int) -> tuple[jax.Array, jax.Array]:
    return lax.broadcasted_iota(jnp.int32, (size, size), 0), lax.broadcasted_iota(jnp.int32, (size, size), 1)


def _column_to_row(column: jax.Array) -> jax.Array:
    """``(n, 1)`` -> ``(1, n)`` by a masked sublane sum: exact (one term is nonzero), and needs no transpose support."""
    rows, cols = _row_and_column_iotas(column.shape[0])
    return jnp.sum(jnp.where(rows == cols, column, 0.0), axis=0, keepdims=True)


@dataclasses.dataclass(frozen=True)
class ChunkGates:
    """Cumulative log decays ``b`` inside one chunk, in the two layouts the chunk needs."""

    column: jax.Array  # (C, 1): b_i along sublanes, scales rows
    row: jax.Array  # (1, C): the same values along lanes, for the (i, j) decay matrix
    total: jax.Array  # (1, 1): b_C, the whole chunk's decay

    @classmethod
    def compute(cls, decay: jax.Array, g: jax.Array | None, valid_rows: jax.Array | None, chunk_size: int) -> ChunkGates:
        """Gates of one chunk from the per-head constant ``decay`` (0 without g_gamma) and per-token ``g`` ``(C, 1)``.

        ``valid_rows`` (None: all) stops the constant decay at the last real token, so the rows past
        the end of the sequence leave the final state exact; their ``g`` must already be 0.
        """
        positions = lax.broadcasted_iota(jnp.int32, (chunk_size, 1), 0) + 1
        lane_positions = lax.broadcasted_iota(jnp.int32, (1, chunk_size), 1) + 1
        if valid_rows is not None:
            positions = jnp.minimum(positions, valid_rows)
            lane_positions = jnp.minimum(lane_positions, valid_rows)
        # Same float32 products in both layouts, so b_i - b_i is exactly 0 on the diagonal.
        column = decay * positions.astype(_F32)
        row = decay * lane_positions.astype(_F32)
        if g is not None:
            # Chunk-local cumulative sum as a lower-triangular matmul: Mosaic has no cumsum.
            rows, cols = _row_and_column_iotas(chunk_size)
            cumulative = matmul((rows >= cols).astype(_F32), g, _F32)
            column = column + cumulative
            row = row + _column_to_row(cumulative)
        return cls(column=column, row=row, total=column[chunk_size - 1 :, :])


def chunk_output(q: jax.Array, k: jax.Array, v: jax.Array, state: jax.Array, gates: ChunkGates, scale: float) -> jax.Array:
    """``o`` for the chunk's rows (float32, ``(C, value tile)``), from the state entering it."""
    operands = mxu_operand_dtype(q.dtype)
    rows, cols = _row_and_column_iotas(q.shape[0])
    causal = rows >= cols
    scores = matmul(q, k, operands, _ROWS_BY_ROWS)
    decays = jnp.exp(jnp.where(causal, gates.column - gates.row, 0.0))
    attention = jnp.where(causal, scores * decays, 0.0)
    from_state = matmul(q, state, operands) * jnp.exp(gates.column)
    return scale * (matmul(attention, v, operands) + from_state)


def advance_state(state: jax.Array, k: jax.Array, v: jax.Array, gates: ChunkGates) -> jax.Array:
    """The state leaving the chunk, float32 ``(K_pad, value tile)``."""
    weighted_keys = k.astype(_F32) * jnp.exp(gates.total - gates.column)
    return state * jnp.exp(gates.total) + matmul(weighted_keys, v, mxu_operand_dtype(k.dtype), _COLUMNS_BY_COLUMNS)


@dataclasses.dataclass(frozen=True)
class Work:
    """Matmul flops (2 per multiply-add) and transcendentals (``exp``) of a piece of kernel code.

    Counted op by op from the code above, per value tile (128 lanes), as the kernels run it: a
    ragged last chunk computes whole, and ``scores`` is recomputed for every value tile.
    Elementwise arithmetic is left out: it is small beside the matmuls and runs on other units.
    """

    flops: int = 0
    transcendentals: int = 0

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.transcendentals + other.transcendentals)

    def __mul__(self, times: int) -> Work:
        return Work(self.flops * times, self.transcendentals * times)


def gates_work(geometry: Geometry, gated: bool) -> Work:
    """``ChunkGates.compute``: with ``g``, the cumulative sum as a (C x C) @ (C x 1) matmul."""
    C = geometry.chunk_size
    return Work(flops=2 * C * C) if gated else Work()


def chunk_output_work(geometry: Geometry) -> Work:
    """``chunk_output``: scores (C x K) @ (K x C), from the state (C x K) @ (K x 128), attention (C x C) @ (C x 128); exp of the C x C decays and of C gates."""
    C, K = geometry.chunk_size, geometry.padded_key_dim
    return Work(flops=2 * C * C * K + 2 * C * K * LANES + 2 * C * C * LANES, transcendentals=C * C + C)


def advance_state_work(geometry: Geometry) -> Work:
    """``advance_state``: decayed keys (K x C) @ values (C x 128); exp of C key decays and of the chunk's decay."""
    C, K = geometry.chunk_size, geometry.padded_key_dim
    return Work(flops=2 * C * K * LANES, transcendentals=C + 1)


def chunks_of_the_grid(geometry: Geometry) -> int:
    """How many times a grid runs the chunk body: every chunk of every (batch, head, value tile)."""
    return geometry.batch * geometry.heads * geometry.value_tiles * geometry.num_chunks


def chunk_body_vmem(geometry: Geometry) -> int:
    """Bytes of the float32 values one chunk holds at once, an upper estimate for every kernel here.

    A float32 copy of q and the decayed keys (C x K_pad each), scores, decays and attention
    (C x C each), the state entering and leaving (K_pad x 128 each), two partial outputs (C x 128).
    """
    C, K = geometry.chunk_size, geometry.padded_key_dim
    return 4 * (2 * C * K + 3 * C * C + 2 * K * LANES + 2 * C * LANES)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One chunk of a grid step: where its rows sit in the step's blocks, and how many are real tokens."""

    index: jax.Array  # within the step
    rows: pl.Slice
    valid_rows: jax.Array | None  # None when no chunk of the call runs past the end of the sequence

    def _row_is_real(self) -> jax.Array:
        return lax.broadcasted_iota(jnp.int32, (self.rows.size, 1), 0) < self.valid_rows

    def read(self, ref) -> jax.Array:
        """The chunk's rows of a token block, rows past the end of the sequence as exact zeros.

        Those rows of a ragged block hold unspecified values (NaN in the interpreters), and NaN * 0
        is NaN, so they are replaced with ``where`` before any arithmetic touches them.
        """
        x = ref[self.rows, :]
        if self.valid_rows is None:
            return x
        return jnp.where(self._row_is_real(), x, jnp.zeros((), x.dtype))

    def gates(self, refs: dict, head: jax.Array) -> ChunkGates:
        """The chunk's gates from a kernel's refs: ``decay`` in SMEM and, when given, the all-heads ``g`` block."""
        g = None
        if "g" in refs:
            every_head = refs["g"][self.rows, :]
            take = lax.broadcasted_iota(jnp.int32, every_head.shape, 1) == head
            if self.valid_rows is not None:
                take = take & self._row_is_real()
            # One selected term per row, so the lane sum is exact.
            g = jnp.sum(jnp.where(take, every_head, jnp.zeros((), every_head.dtype)).astype(_F32), axis=1, keepdims=True)
        return ChunkGates.compute(refs["decay"][head], g, self.valid_rows, self.rows.size)


def for_each_chunk(geometry: Geometry, step: jax.Array, body) -> None:
    """Run ``body(chunk)`` for the chunks of grid step ``step`` in order.

    A loop, not Python unrolling: every chunk runs the one traced body whatever the step size (so
    no result depends on ``num_steps``) and the kernel stays small to compile.
    """
    size = geometry.chunk_size

    def one_chunk(index, carry):
        rows = pl.ds(pl.multiple_of(index * size, size), size)
        body(Chunk(index, rows, geometry.valid_rows(step * geometry.chunks_per_step + index)))
        return carry

    lax.fori_loop(0, geometry.chunks_per_step, one_chunk, None)


def start_sequence(refs: dict, step: jax.Array) -> None:
    """Load ``initial_state`` (or zeros) into the VMEM ``state`` at the first time step of each (batch, head, value tile).

    Parallel grid points run on either core in any order, so the scratch never carries anything
    from one (batch, head, value tile) to the next.
    """

    @pl.when(step == 0)
    def _start():
        state = refs["state"]
        if "initial_state" in refs:
            state[...] = refs["initial_state"][...].astype(_F32)
        else:
            state[...] = jnp.zeros(state.shape, _F32)


def finish_sequence(refs: dict, step: jax.Array, geometry: Geometry) -> None:
    """Write the state to ``final_state`` (when requested) after the last time step."""
    if "final_state" not in refs:
        return

    @pl.when(step == geometry.time_steps - 1)
    def _finish():
        refs["final_state"][...] = refs["state"][...]
