"""What one chunk of simple_gla does, written once for every simple_gla kernel of this plugin.

Inside a chunk of ``C`` tokens, with ``b_i`` the cumulative log decay from the chunk's start up
to and including token ``i`` and ``S`` the state entering the chunk::

    o_i   = scale * (exp(b_i) * q_i S + sum_{j <= i} exp(b_i - b_j) (q_i . k_j) v_j)
    S_out = exp(b_C) * S + sum_j exp(b_C - b_j) k_j^T v_j

Numerics (docs/architecture.md "Numerics"): only differences of cumulative gates are
exponentiated, never ``exp(-b)``; above the diagonal the exponent is replaced by ``exponents.MASKED_EXPONENT``
*before* ``exp`` (there ``b_i - b_j`` is positive and overflows for strong decays at chunk 128), and
``exp`` of it is exactly 0; every matmul
accumulates in float32, with operands in the dtype ``mxu_operand_dtype`` picks. Rows of a ragged
last chunk that lie past the end of the sequence are zeroed with ``where`` as they are read
(``Chunk.read``), and stop the constant decay, so they add nothing and decay nothing.

**Resets.** A gate of ``-inf`` is a legal way to cut a sequence: ``exp(-inf) = 0``. A ``g`` summed as
it is would put ``-inf`` in ``b`` and ``-inf - -inf = NaN`` in ``b_i - b_j``. So with ``g``, ``b`` is kept in
two exact parts (``LogDecays``): ``B``, the cumulative sum with every ``-inf`` gate counted as 0, and
``R``, how many ``-inf`` gates the sum has passed (0/1 indicators, exact in the same bf16 MXU pass as
``g``'s parts). ``exp(b_i - b_j)`` is then ``exp(B_i - B_j)`` where ``R_i == R_j`` and exactly 0 elsewhere,
the exponent masked before ``exp`` like the one above the diagonal; ``exp(b_i)`` needs ``R_i == 0``. A
``g_gamma`` of ``-inf`` (a reset at every token) needs no mask: it is taken as ``RESET_LOG_DECAY`` (``constant_decay``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from tops_plugins_tpu_pallas.exponents import RESET_LOG_DECAY, masked_exp
from tops_plugins_tpu_pallas.grid import Chunk, Work
from tops_plugins_tpu_pallas.layout import LANES, Geometry
from tops_plugins_tpu_pallas.mxu import (
    COLUMNS_BY_COLUMNS, ROWS_BY_COLUMNS, ROWS_BY_ROWS, bf16_parts, column_to_row, matmul, mxu_operand_dtype, row_and_column_iotas,
)

_F32 = jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def cumulative_sum(g: jax.Array, counts_resets: bool = True) -> tuple[jax.Array, jax.Array | None]:
    """The chunk-local cumulative sums ``(B, R)`` of ``g`` ``(C, 1)`` (float32) as one bf16 MXU pass, each exact as a float32
    HIGHEST product: ``B`` sums the gates with every ``-inf`` counted as 0, ``R`` counts the ``-inf`` gates (module docstring).
    Without ``counts_resets`` (every gate known finite) ``B`` alone, ``R`` None.

    Mosaic has no cumsum, so it is a lower-triangular 0/1 matrix times ``g``. The 0/1 matrix is exact
    in bf16, and ``g`` splits exactly into three bf16 parts (8 + 8 + 8 bits of its 24-bit
    significand); laid in lanes 0, 1, 2 of one ``(C, 128)`` operand with the resets' 0/1 indicators in
    lane 3, they go through the MXU in one bf16 pass (exact products, float32 accumulation), and a
    lane sum adds the three partial sums. A float32 operand at HIGHEST precision would take six
    passes of a ``(C, 1)`` column, which was most of a gated chunk's MXU pushes.
    """
    rows, cols = row_and_column_iotas(g.shape[0])
    partial_sums = matmul((rows >= cols).astype(jnp.bfloat16), _parts_and_resets_in_lanes(g, counts_resets), jnp.bfloat16)
    return _sums_of_parts_and_resets(partial_sums, counts_resets)


def _cumulative_sum_forward(g, counts_resets):
    return cumulative_sum(g, counts_resets), g == -jnp.inf if counts_resets else None


def _cumulative_sum_cotangents(counts_resets, resets, cotangents):
    """``dg_t = sum_{i >= t} dB_i`` (0 on a ``-inf`` gate, which ``B`` counts as 0), in the forward's exact bf16 parts:
    jax's own rule would round the cotangent to bf16 on its way through the parts (what kda's ``run_sums`` avoids too).
    The cotangent holds no ``-inf``, so its sums count none, whether or not the forward's did."""
    del counts_resets
    dsums, _ = cotangents  # R counts resets: no gradient
    rows, cols = row_and_column_iotas(dsums.shape[0])
    partial_sums = matmul((rows <= cols).astype(jnp.bfloat16), _parts_and_resets_in_lanes(dsums, False), jnp.bfloat16)
    dg, _ = _sums_of_parts_and_resets(partial_sums, False)
    return (dg if resets is None else jnp.where(resets, 0.0, dg),)


cumulative_sum.defvjp(_cumulative_sum_forward, _cumulative_sum_cotangents)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def cumulative_sums_along_lanes(g: jax.Array, counts_resets: bool = True) -> tuple[jax.Array, jax.Array | None]:
    """``cumulative_sum`` of every chunk of a grid step at once, ``g`` ``(n, C)`` with one chunk per row: the rows'
    three bf16 parts and their resets stacked along sublanes times an upper-triangular 0/1 matrix, one bf16 MXU
    pass whose weights (the triangle) load once per step instead of once per chunk, then the parts' sums added.
    The four stacks start on whole 8-row tiles (``_tiled_stack``), so the sums are aligned sublane slices. Without
    ``counts_resets`` (every gate known finite) the sums alone, the resets None."""
    resets = g == -jnp.inf if counts_resets else None
    parts = bf16_parts(g if resets is None else jnp.where(resets, 0.0, g), 3)
    sums = _lane_sums_of_stacked(parts if resets is None else [*parts, resets.astype(_F32)], upper=True)
    return sums[0] + sums[1] + sums[2], None if resets is None else sums[3]


def _lane_sums_of_stacked(pieces: list[jax.Array], upper: bool) -> list[jax.Array]:
    """Each of ``pieces`` (``(n, C)``, each exact in bf16) times the upper (``upper``: running sums along lanes) or lower
    (the sums from each lane to the last) triangular 0/1 matrix, as one bf16 MXU product of their stack."""
    n, size = pieces[0].shape
    stack, tile = _tiled_stack(pieces)
    rows, cols = row_and_column_iotas(size)
    triangle = rows <= cols if upper else rows >= cols
    sums = matmul(stack, triangle.astype(jnp.bfloat16), jnp.bfloat16)
    return [sums[i * tile : i * tile + n] for i in range(len(pieces))]


def _cumulative_sums_along_lanes_forward(g, counts_resets):
    return cumulative_sums_along_lanes(g, counts_resets), g == -jnp.inf if counts_resets else None


def _cumulative_sums_along_lanes_cotangents(counts_resets, resets, cotangents):
    """``dg_t = sum_{i >= t} dB_i`` along each row, in exact bf16 parts as ``cumulative_sum``'s VJP (0 on a ``-inf``
    gate, which ``B`` counts as 0)."""
    del counts_resets
    dsums, _ = cotangents  # R counts resets: no gradient
    high, middle, low = _lane_sums_of_stacked(bf16_parts(dsums, 3), upper=False)
    dg = high + middle + low
    return (dg if resets is None else jnp.where(resets, 0.0, dg),)


cumulative_sums_along_lanes.defvjp(_cumulative_sums_along_lanes_forward, _cumulative_sums_along_lanes_cotangents)


def _tiled_stack(pieces: list[jax.Array]) -> tuple[jax.Array, int]:
    """``pieces`` (each ``(n, C)``) stacked along sublanes, each padded with zero rows to whole 8-row tiles, and that
    padded height: piece ``i``'s rows start at ``i * tile``."""
    n, size = pieces[0].shape
    tile = -(-n // 8) * 8
    padding = [jnp.zeros((tile - n, size), _F32)] if tile > n else []
    return jnp.concatenate([part for piece in pieces for part in (piece, *padding)], axis=0), tile


_RESETS = 3
"""The lane where ``_parts_and_resets_in_lanes`` puts the resets' indicators, after ``g``'s three parts."""


def _parts_and_resets_in_lanes(g: jax.Array, counts_resets: bool = True) -> jax.Array:
    """``g`` ``(C, 1)``'s three exact bf16 parts (``bf16_parts``, every ``-inf`` as 0) in lanes 0, 1, 2 of a ``(C, 128)``
    operand and, with ``counts_resets``, its ``-inf`` gates as 1 in lane ``_RESETS``; zeros elsewhere."""
    index = lax.broadcasted_iota(jnp.int32, (g.shape[0], LANES), 1)
    resets = g == -jnp.inf if counts_resets else None
    high, middle, low = bf16_parts(g if resets is None else jnp.where(resets, 0.0, g), 3)
    parts = jnp.where(index == 0, high, jnp.where(index == 1, middle, jnp.where(index == 2, low, 0.0)))
    return parts if resets is None else jnp.where(index == _RESETS, resets.astype(_F32), parts)


def _sums_of_parts_and_resets(partial_sums: jax.Array, counts_resets: bool = True) -> tuple[jax.Array, jax.Array | None]:
    """``(B, R)`` from the partial sums of ``_parts_and_resets_in_lanes``'s operand: its three parts added, and its resets
    (None without ``counts_resets``, whose every other lane is 0: ``B`` is then the whole lane sum, the same value).
    Both are masked sums (reading the resets' lane where it lies costs the backward's kernels about 15% more cycles)."""
    if not counts_resets:
        return jnp.sum(partial_sums, axis=1, keepdims=True), None
    index = lax.broadcasted_iota(jnp.int32, partial_sums.shape, 1)
    finite = jnp.sum(jnp.where(index < _RESETS, partial_sums, 0.0), axis=1, keepdims=True)
    resets = jnp.sum(jnp.where(index == _RESETS, partial_sums, 0.0), axis=1, keepdims=True)
    return finite, resets


def _positions(chunk_size: int, axis: int, valid_rows: jax.Array | None) -> jax.Array:
    """Tokens' 1-based positions in the chunk along ``axis`` (0: a ``(C, 1)`` column, 1: a ``(1, C)`` row), float32,
    held at ``valid_rows`` past the end of the sequence (None: all real)."""
    shape = (chunk_size, 1) if axis == 0 else (1, chunk_size)
    positions = lax.broadcasted_iota(jnp.int32, shape, axis) + 1
    if valid_rows is not None:
        positions = jnp.minimum(positions, valid_rows)
    return positions.astype(_F32)


@dataclasses.dataclass(frozen=True)
class LogDecays:
    """A chunk's cumulative log decays ``b`` (float32) in two exact parts, ``B`` and ``R`` (module docstring), each in the two
    layouts the chunk needs: ``b_i - b_j`` is ``B_i - B_j`` where ``R_i == R_j``, and ``-inf`` elsewhere.

    Kept apart from ``ChunkGates`` for a kernel whose decays start somewhere inside the chunk
    (a packed sequence's boundary), which exponentiates its own differences of ``b``.
    """

    column: jax.Array  # (C, 1): B_i along sublanes, scales rows
    row: jax.Array  # (1, C): the same values along lanes, for the (i, j) decay matrix
    resets_column: jax.Array | None  # (C, 1): R_i, the -inf gates up to and including token i, float32; None without g
    resets_row: jax.Array | None  # (1, C)

    @classmethod
    def compute(
        cls, decay: jax.Array, g: jax.Array | None, valid_rows: jax.Array | None, chunk_size: int, counts_resets: bool = True,
    ) -> LogDecays:
        """From the per-head constant ``decay`` (0 without g_gamma; finite: ``constant_decay``) and per-token ``g`` ``(C, 1)``.

        ``valid_rows`` (None: all) stops the constant decay at the last real token, so the rows past
        the end of the sequence leave the final state exact; their ``g`` must already be 0. A ``decay`` of a static
        0 with ``g`` (an op without a constant decay: gated_delta_rule) adds no positions at all. Without
        ``counts_resets`` (every ``g`` known finite) no ``R``: ``resets_column`` and ``resets_row`` None.
        """
        without_decay = isinstance(decay, (int, float)) and decay == 0 and g is not None
        # Same float32 products in both layouts, so B_i - B_i is exactly 0 on the diagonal.
        column = 0.0 if without_decay else decay * _positions(chunk_size, 0, valid_rows)
        row = 0.0 if without_decay else decay * _positions(chunk_size, 1, valid_rows)
        if g is None:
            return cls(column=column, row=row, resets_column=None, resets_row=None)
        cumulative, resets = cumulative_sum(g, counts_resets)
        return cls(
            column=column + cumulative, row=row + column_to_row(cumulative), resets_column=resets,
            resets_row=None if resets is None else column_to_row(resets),
        )

    @classmethod
    def of_rows(cls, g: jax.Array, counts_resets: bool = True) -> list[LogDecays]:
        """The log decays of a grid step's chunks from their ``g`` as rows ``(n, C)``, one chunk per row, without a
        constant decay (``compute``'s of each row): every chunk's cumulative sums in one MXU pass
        (``cumulative_sums_along_lanes``), their rows as they come, and each chunk's column from one transpose of them
        by a masked lane sum, laid out as a lane reduction leaves it: every use broadcasts it along lanes for free.

        A lane slice of the transpose (``along_lanes``' columns) takes a lane broadcast on the cross-lane unit at each
        of its uses, and each chunk's ``C x C`` decays use its column: gated_delta_rule's forward kernel on v6e (cycles,
        finite gates), every chunk's own cumulative sum and columns 286448 -> sliced columns 326450, this 262914. simple_gla's
        kernels, whose keys are transposed and take fewer uses of a column, keep the slices: picked this way, its fused
        forward with ``g`` went 66659 -> 82371 cycles on v6e, 84228 -> 94350 on v5e."""
        cumulative, resets = cumulative_sums_along_lanes(g, counts_resets)
        columns = cumulative.T
        reset_columns = None if resets is None else resets.T
        lanes = lax.broadcasted_iota(jnp.int32, columns.shape, 1)

        def column(of: jax.Array, chunk: int) -> jax.Array:  # one nonzero term per row: exact
            return jnp.sum(jnp.where(lanes == chunk, of, 0.0), axis=1, keepdims=True)

        return [
            cls(column=column(columns, chunk), row=cumulative[chunk : chunk + 1],
                resets_column=None if resets is None else column(reset_columns, chunk),
                resets_row=None if resets is None else resets[chunk : chunk + 1])
            for chunk in range(g.shape[0])
        ]

    @property
    def total(self) -> tuple[jax.Array, jax.Array | None]:
        """``(B_C, R_C)`` of the whole chunk, ``(1, 1)`` each (``R_C`` None without g; ``B_C`` a row of it where the column is
        broadcast along lanes)."""
        return self.column[-1:, :], None if self.resets_column is None else self.resets_column[-1:, :]


def unreset(resets: jax.Array | None, since) -> jax.Array | None:
    """Where no reset lies between two tokens, ``resets == since`` (their ``R``), or None (no mask) without resets."""
    return None if resets is None else resets == since


@dataclasses.dataclass(frozen=True)
class ChunkGates:
    """The decays one chunk applies, already exponentiated, from its cumulative log decays ``b``.

    Every exponent is a difference of cumulative gates inside the chunk (``b_i - b_j`` with
    ``j <= i``, ``b_C - b_j``) or ``b`` itself, masked before ``exp``; nothing here depends on the
    state, so a constant decay's gates are the same for every whole chunk and a kernel computes
    them once per grid step.
    """

    decays: jax.Array | None  # (C, C): exp(b_i - b_j) for j <= i, exactly 0 above the diagonal and across a reset; None without attention or until with_decays
    query: jax.Array | None  # (C, 1): exp(b_i), how the state entering the chunk decays up to row i; None in a walk's gates along lanes
    key: jax.Array | None  # (C, 1): exp(b_C - b_j), how row j's key-value product decays to the chunk's end; None: use key_row
    chunk: jax.Array  # (1, 1): exp(b_C), how the state decays over the whole chunk
    log: LogDecays | None = None  # what with_decays builds the decays from, while they wait (along_lanes)
    walk_keys: jax.Array | None = None  # (1, C): key_row itself, in a walk's gates along lanes (no decays to read it from)
    cuts: jax.Array | None = None  # (1, C) int32: where cut_at's sequence starts cut the decays, while they wait (with_decays)

    @classmethod
    def compute(
        cls, decay: jax.Array, g: jax.Array | None, valid_rows: jax.Array | None, chunk_size: int, attention: bool = True,
        counts_resets: bool = True,
    ) -> ChunkGates:
        """Gates of one chunk from its ``decay``, ``g``, ``valid_rows`` and ``counts_resets``, as ``LogDecays.compute``
        takes them."""
        return cls.of(LogDecays.compute(decay, g, valid_rows, chunk_size, counts_resets), attention)

    @classmethod
    def of(cls, log: LogDecays, attention: bool = True) -> ChunkGates:
        """The gates from ``log``; ``attention=False`` (a kernel that only advances the state) leaves out
        the ``C x C`` decays, a ``C x C`` exp the kernel would not use."""
        total, total_resets = log.total
        return cls(
            decays=causal_decays(log) if attention else None,
            query=masked_exp(log.column, unreset(log.resets_column, 0.0)),
            key=masked_exp(total - log.column, unreset(log.resets_column, total_resets)),
            chunk=masked_exp(total[:, :1], unreset(total_resets, 0.0)),
        )

    @classmethod
    def along_lanes(
        cls, decay: jax.Array, g: jax.Array, valid_rows: list[jax.Array | None], resets_dtype=jnp.float32,
        attention: bool = True, key_column: bool = False,
    ) -> list[ChunkGates]:
        """The gates of every chunk of a grid step from their ``g`` as rows ``(n, C)``, one chunk per row (``g`` laid
        out ``[B, H, T]``), ``key`` left to ``key_row`` unless ``key_column``.

        ``LogDecays.compute`` and ``of`` work on ``(C, 1)`` columns, which take one vector register per
        8 rows for every operation, and a single chunk's ``(1, C)`` row fills one sublane of its registers;
        here the cumulative sums (``cumulative_sums_along_lanes``) and ``exp(b)`` run on the step's
        ``(n, C)`` rows, 8 chunks to a register, and one transpose makes every chunk's columns
        (``exp(b)``, ``B`` and ``R``). Cycles one TensorCore issues for a 4096-row grid step (bf16 K=V=128
        with ``g``, v6e, 16 chunks of 256), one chunk at a time -> the step's chunks at once: 5028 -> 4220.
        ``valid_rows``: the real tokens of each chunk (None: all real; ``Chunk.valid_rows``); ``g`` must be 0 past them. ``resets_dtype``: what ``R``'s column is held in for the decays' masks,
        whose lane broadcasts bfloat16 halves (exact: ``R`` is a count of at most 256 tokens).
        The ``C x C`` decays are left to ``with_decays``, which a kernel calls where it uses them.
        With ``key_column`` (the backward, whose gradient terms take ``exp(b_C - b_j)`` per row) that is exponentiated on
        the rows and becomes ``key``'s column in the same transpose. ``attention=False`` (a walk that only advances the
        state, with its keys transposed): no decays, no columns and no transpose at all, only ``chunk`` and ``key_row``
        (``walk_keys``) from the rows. Cycles one TensorCore issues for the backward's checkpoints walk (B=2 T=4096 H=8
        K=V=128 bf16 with ``g``, 2048-token segments), key columns -> rows: v6e 60494 -> 34382, v5e 66096 -> 41874.
        """
        n, size = g.shape
        cumulative, resets = cumulative_sums_along_lanes(g, True)
        positions = lax.broadcasted_iota(jnp.int32, (n, size), 1) + 1
        if any(valid is not None for valid in valid_rows):
            chunk, limits = lax.broadcasted_iota(jnp.int32, (n, 1), 0), jnp.full((n, 1), size, jnp.int32)
            for index, valid in enumerate(valid_rows):
                if valid is not None:
                    limits = jnp.where(chunk == index, valid, limits)
            positions = jnp.minimum(positions, limits)
        rows = decay * positions.astype(_F32) + cumulative
        keys = masked_exp(rows[:, -1:] - rows, unreset(resets, resets[:, -1:])) if key_column or not attention else None
        if not attention:
            # exp(b_C), the last token's query decay: one lane of each row.
            whole = masked_exp(rows[:, -1:], resets[:, -1:] == 0)
            # The log decays as rows alone, for a walk that adds terms of its own (the packed backward's checkpoints).
            return [
                cls(decays=None, query=None, key=None, chunk=whole[i : i + 1], walk_keys=keys[i : i + 1],
                    log=LogDecays(column=None, row=rows[i : i + 1], resets_column=None, resets_row=resets[i : i + 1]))
                for i in range(n)
            ]
        pieces = {"query": masked_exp(rows, resets == 0), "log": rows, "resets": resets}
        if key_column:
            pieces["key"] = keys
        stack, tile = _tiled_stack(list(pieces.values()))
        columns = stack.T
        lane = {name: index * tile for index, name in enumerate(pieces)}

        def column(name: str, chunk: int) -> jax.Array:
            return columns[:, lane[name] + chunk : lane[name] + chunk + 1]

        every = []
        for chunk in range(n):
            query = column("query", chunk)
            key = column("key", chunk) if "key" in pieces else None
            log = LogDecays(
                column=column("log", chunk), row=rows[chunk : chunk + 1], resets_column=column("resets", chunk).astype(resets_dtype),
                resets_row=resets[chunk : chunk + 1],
            )
            # exp(b_C) is the last query decay: one value of one lane, no lanes of two columns to bring together.
            every.append(cls(decays=None, query=query, key=key, chunk=query[-1:, :], log=log))
        return every

    def cut_at(self, first: jax.Array, last: jax.Array, next_starts: jax.Array | None = None) -> ChunkGates:
        """These gates (a constant decay's) cut where packed sequences start: what ``g``'s reset gates (``-inf`` at every
        sequence's first token, 0 elsewhere) give, without a cumulative sum or an ``exp`` of them. ``first`` and ``last``:
        int32 scalars, where the chunk's first and last sequence start lie (``C`` and 0: none); ``next_starts``: ``(1, C)``
        int32, where the first sequence start after each token lies in the chunk (``C``: none; None for gates without
        decays, a walk's); ``varlen.sequence_cuts``.

        Row ``i`` reads the entering state before the first start, key ``j`` reaches the chunk's end from the last start
        on, the state crosses a chunk where none starts, and pair ``(i, j)`` keeps its decay while ``i`` lies before the
        first start after ``j``; that last mask waits for ``with_decays`` with the decays. Each is a compare with a
        position, and the chunk's decay, which the step's state and ``dS`` chains multiply by, is a select on a scalar:
        the same gates exponentiated from the reset gates (``along_lanes``) come from every chunk's cumulative sums
        together, which the chains wait on (the plugin README's "Packed without ``g``")."""
        size = self.key.shape[0]
        tokens = lax.broadcasted_iota(jnp.int32, (size, 1), 0)
        return dataclasses.replace(
            self, query=jnp.where(tokens < first, self.query, 0.0), key=jnp.where(tokens >= last, self.key, 0.0),
            chunk=jnp.where(first == size, self.chunk, 0.0), cuts=next_starts,
        )

    def with_decays(self) -> ChunkGates:
        """These gates with their ``C x C`` decays, built from ``log`` where ``along_lanes`` left them to be, or cut where
        ``cut_at`` left them to be (else as they are).

        A kernel calls it where it first uses a chunk's decays: built there rather than with the step's other gates, the
        scheduler holds fewer of them at once. Cycles one TensorCore issues for a grid step (bf16 K=V=128 with ``g``),
        built with the step's gates -> where used: the fused forward v6e 4220 -> 4166, v5e 5893 -> 5264; the backward's
        gradients kernel v6e 4776 -> 4694, v5e 5906 -> 5674.
        """
        if self.cuts is not None:
            rows = lax.broadcasted_iota(jnp.int32, self.decays.shape, 0)
            return dataclasses.replace(self, decays=jnp.where(rows < self.cuts, self.decays, 0.0), cuts=None)
        if self.log is None or self.walk_keys is not None:  # built, or a walk's gates, which have no decays
            return self
        return dataclasses.replace(self, decays=causal_decays(self.log), log=None)

    @property
    def key_row(self) -> jax.Array:
        """``key`` along lanes, ``(1, C)``: the decay matrix's last row, ``exp(b_C - b_j)`` bit for bit, with no exp of its own
        (a walk's gates along lanes, which have no decays, hold it as ``walk_keys``)."""
        return self.decays[-1:, :] if self.walk_keys is None else self.walk_keys


def causal_decays(log: LogDecays) -> jax.Array:
    """``exp(b_i - b_j)`` for ``j <= i`` and no reset between them (``R_i == R_j``), exactly 0 elsewhere, ``(C, C)`` float32.

    Built in 128 x 128 blocks: a block above the diagonal is a constant 0 and one below it needs no
    causal mask, so only the diagonal blocks select on it; at chunk 256 that is a quarter of the exps
    fewer (on v6e, with ``g``, about 2% of the forward's cycles). With ``g``, every block masks its resets.
    """
    size = log.column.shape[0]
    block = min(size, LANES)
    rows, cols = row_and_column_iotas(block)
    causal = rows >= cols
    strips = []
    for i in range(0, size, block):
        strip = []
        for j in range(0, size, block):
            exponent = log.column[i : i + block] - log.row[:, j : j + block]
            kept = None
            if log.resets_column is not None:  # broadcast in the column's own dtype (ChunkGates.along_lanes), compared in float32
                resets = jnp.broadcast_to(log.resets_column[i : i + block], (block, block)).astype(_F32)
                kept = resets == log.resets_row[:, j : j + block]
            if j < i:
                strip.append(masked_exp(exponent, kept))
            elif j == i:
                strip.append(masked_exp(exponent, causal if kept is None else causal & kept))
            else:
                strip.append(jnp.zeros((block, block), _F32))
        strips.append(jnp.concatenate(strip, axis=1) if len(strip) > 1 else strip[0])
    return jnp.concatenate(strips, axis=0) if len(strips) > 1 else strips[0]


def chunk_output(q: jax.Array, k: jax.Array, v: jax.Array, state: jax.Array, gates: ChunkGates, scale: float) -> jax.Array:
    """``o`` for the chunk's rows (float32, ``(C, value block)``), from the state entering it."""
    return output_from_state(intra_chunk_output(q, k, v, gates), q, state, gates, scale)


def intra_chunk_output(q: jax.Array, k: jax.Array, v: jax.Array, gates: ChunkGates, operands=None, keys_transposed: bool = False) -> jax.Array:
    """The chunk's own part of ``o`` (float32, unscaled): its causal, decayed attention over its rows; no state.
    ``operands``: ``matmul``'s (None: ``mxu_operand_dtype``); ``keys_transposed`` as ``decayed_scores``."""
    return attend(decayed_scores(q, k, gates, operands, keys_transposed), v, operands)


def decayed_scores(q: jax.Array, k: jax.Array, gates: ChunkGates, operands=None, keys_transposed: bool = False) -> jax.Array:
    """The chunk's causal attention weights ``(q k^T) * decays`` (float32 ``(C, C)``), the first half of ``intra_chunk_output``.
    ``keys_transposed``: ``k`` is given as ``k^T``, ``(K_pad, C)`` (``advance_state``'s)."""
    operands = mxu_operand_dtype(q.dtype) if operands is None else operands
    return matmul(q, k, operands, ROWS_BY_COLUMNS if keys_transposed else ROWS_BY_ROWS) * gates.decays


def attend(scores: jax.Array, v: jax.Array, operands=None) -> jax.Array:
    """``decayed_scores`` against the chunk's values, the second half of ``intra_chunk_output``."""
    return matmul(scores, v, mxu_operand_dtype(v.dtype) if operands is None else operands)


def output_from_state(intra: jax.Array, q: jax.Array, state: jax.Array, gates: ChunkGates, scale: float, operands=None) -> jax.Array:
    """``o`` from the chunk's ``intra_chunk_output`` and the state entering the chunk; ``operands`` as there."""
    operands = mxu_operand_dtype(q.dtype) if operands is None else operands
    return scale * (intra + matmul(q, state, operands) * gates.query)


def advance_state(state: jax.Array, k: jax.Array, v: jax.Array, gates: ChunkGates, operands=None, keys_transposed: bool = False) -> jax.Array:
    """The state leaving the chunk, float32 ``(K_pad, value block)``; the decayed keys go into the MXU as
    ``operands`` (``matmul``'s; None: the forward's ``mxu_operand_dtype``).

    ``keys_transposed``: ``k`` is given as ``k^T``, ``(K_pad, C)``, and its columns decay by
    ``gates.key_row``, so the gates need their decays but no ``(C, 1)`` exp of the keys' own
    (``fused.gates_along_lanes``).
    """
    operands = mxu_operand_dtype(k.dtype) if operands is None else operands
    if keys_transposed:
        return state * gates.chunk + matmul(k.astype(_F32) * gates.key_row, v, operands)
    return state * gates.chunk + matmul(k.astype(_F32) * gates.key, v, operands, COLUMNS_BY_COLUMNS)


def gates_work(geometry: Geometry, gated: bool, attention: bool = True) -> Work:
    """``ChunkGates.compute`` once: with ``g``, the cumulative sum as a (C x C) @ (C x 128) matmul (``cumulative_sum``);
    exp of the C x C decays (with ``attention``), of the C query and C key decays and of the chunk's decay."""
    C = geometry.chunk_size
    return Work(flops=2 * C * C * LANES if gated else 0, transcendentals=C * C * attention + 2 * C + 1)


def gate_computations(geometry: Geometry, gated: bool) -> int:
    """How many times a grid computes ``ChunkGates``: every chunk with ``g``; without, once per grid step
    (the gates of a constant decay are the same for every whole chunk), and once more for each chunk of a step
    that may hold rows past the end (``Geometry.first_short_chunk``: every step computes their own)."""
    sequences = geometry.batch * geometry.heads * geometry.value_tiles
    if gated:
        return sequences * geometry.grid_chunks
    return sequences * geometry.time_steps * (1 + geometry.chunks_per_step - geometry.first_short_chunk)


def chunk_output_work(geometry: Geometry) -> Work:
    """``chunk_output``: scores (C x K) @ (K x C), from the state (C x K) @ (K x Vb), attention (C x C) @ (C x Vb)."""
    C, K, Vb = geometry.chunk_size, geometry.padded_key_dim, geometry.value_block
    return Work(flops=2 * C * C * K + 2 * C * K * Vb + 2 * C * C * Vb)


def advance_state_work(geometry: Geometry) -> Work:
    """``advance_state``: decayed keys (K x C) @ values (C x Vb)."""
    C, K, Vb = geometry.chunk_size, geometry.padded_key_dim, geometry.value_block
    return Work(flops=2 * C * K * Vb)


def chunk_body_vmem(geometry: Geometry) -> int:
    """Bytes of the float32 values one grid step holds at once, an upper estimate for every kernel here.

    A float32 copy of q and the decayed keys (C x K_pad each); scores, attention and the gates'
    decays (C x C each, the gates twice when a constant decay's are kept for the step); the
    state entering and leaving (K_pad x Vb each); two partial outputs (C x Vb).
    """
    C, K, Vb = geometry.chunk_size, geometry.padded_key_dim, geometry.value_block
    return 4 * (2 * C * K + 4 * C * C + 2 * K * Vb + 2 * C * Vb)


def constant_decay(refs: dict, head: jax.Array) -> jax.Array:
    """Head ``head``'s constant log decay, a scalar from SMEM (``g_gamma``, or 0), ``-inf`` (or below) as ``RESET_LOG_DECAY``.

    ``decay * positions`` is then exact, so each position's difference with itself is exactly 0 in both
    layouts, even where the backend fuses the product into the subtraction (a decay like ``-1e30`` rounds
    differently there, and ``exp`` of the rounding is inf), and every other difference is at most
    ``-2**100``: a ``g_gamma`` of ``-inf`` needs nothing else, and costs nothing.
    """
    return jnp.maximum(refs["decay"][head], RESET_LOG_DECAY)


def constant_gates(refs: dict, head: jax.Array, geometry: Geometry, attention: bool = True) -> ChunkGates | None:
    """A whole chunk's gates when the decay is constant (no ``g``), computed once for the grid step; None with ``g``."""
    if "g" in refs:
        return None
    return ChunkGates.compute(constant_decay(refs, head), None, None, geometry.chunk_size, attention)


def chunk_gates(chunk: Chunk, refs: dict, head: jax.Array, constant: ChunkGates | None, log: LogDecays | None = None, attention: bool = True) -> ChunkGates:
    """``chunk``'s gates: ``constant`` (the step's, without ``g``) for a whole chunk; else exponentiated from ``log``
    (``log_decays``, computed here when not given); ``attention`` as ``ChunkGates.of``'s."""
    if constant is not None and chunk.valid_rows is None:
        return constant
    return ChunkGates.of(log_decays(chunk, refs, head) if log is None else log, attention)


def step_gates(
    chunks: list[Chunk], refs: dict, head: jax.Array, constant: ChunkGates | None, *, attention: bool = True, along_lanes: bool = False,
    resets_dtype=jnp.float32, key_column: bool = False, step: jax.Array | None = None,
) -> list[ChunkGates]:
    """The gates of a grid step's ``chunks``, in order: with a packed call's sequence starts among the refs
    (``blocks.sequence_cuts``; ``step``: the time step whose chunks these are), ``constant``'s cut at them
    (``ChunkGates.cut_at``); with ``along_lanes`` (``g`` laid out ``[B, H, T]``), all at once from the head's rows
    (``ChunkGates.along_lanes``, ``resets_dtype`` and ``key_column`` as there); else chunk by chunk (``chunk_gates``).
    ``attention`` as ``ChunkGates.of``'s."""
    if "first_starts" in refs:
        first_chunk = step * len(chunks)
        return [
            chunk_gates(chunk, refs, head, constant, attention=attention).cut_at(
                refs["first_starts"][first_chunk + chunk.index], refs["last_starts"][first_chunk + chunk.index],
                refs["next_starts"][:, chunk.rows] if "next_starts" in refs else None,
            )
            for chunk in chunks
        ]
    if along_lanes:
        rows = jnp.concatenate([chunk.head_row(refs["g"], head) for chunk in chunks], axis=0)
        return ChunkGates.along_lanes(constant_decay(refs, head), rows, [chunk.valid_rows for chunk in chunks], resets_dtype, attention, key_column)
    return [chunk_gates(chunk, refs, head, constant, attention=attention) for chunk in chunks]


def log_decays(chunk: Chunk, refs: dict, head: jax.Array, decay: jax.Array | None = None) -> LogDecays:
    """``chunk``'s cumulative log decays from a kernel's refs: ``decay`` in SMEM and, when given, the all-heads ``g`` block.

    ``decay``: the head's ``constant_decay`` when the kernel reads it once per grid step (None: read here); a
    kernel that takes every chunk's log decays without ``g`` (varlen's) issues 1.7% fewer cycles so (v5e backward).
    """
    g = chunk.head_column(refs["g"], head) if "g" in refs else None
    return LogDecays.compute(constant_decay(refs, head) if decay is None else decay, g, chunk.valid_rows, chunk.rows.size)
