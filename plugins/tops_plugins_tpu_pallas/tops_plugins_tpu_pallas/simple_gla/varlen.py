"""``tpu_pallas.varlen``: the simple_gla forward over packed sequences (``B == 1``, ``cu_seqlens``), in one ``pallas_call``.

The fused kernel's grid, layout and launch (``grid.run``) over the packed ``T``: ``(1, head,
value block, time step)``, the float32 state carried along the sequential time axis. Sequence boundaries may fall
anywhere, so a chunk holds one or more *segments* (the pieces of the sequences it overlaps). The
boundaries are scalars in SMEM (scalar prefetch), traced under ``jit``: one compile serves every
packing of the same ``T`` and ``N``. Besides ``cu_seqlens`` the kernel reads, per chunk, the first
and last sequence it overlaps (computed from ``cu_seqlens`` before the launch, two int32 per chunk).

Per chunk, with ``b_i`` the chunk-local cumulative log decay (``LogDecays``, the one place its
log-domain values are computed), and for each segment ``[a, e)`` of
sequence ``n`` (in order):

- the state entering the segment is the carried state if ``n`` started before the chunk, else
  ``initial_state[n]`` (copied from HBM by a DMA, only when given) or zeros;
- its rows get ``q_i S exp(b_i - b_{a-1})``;
- it leaves ``S exp(b_{e-1} - b_{a-1}) + sum_{j in [a, e)} exp(b_{e-1} - b_j) k_j^T v_j``: the
  carried state when it is the chunk's last segment, and ``final_state[n]`` (a DMA to HBM) when
  ``n`` ends inside the chunk.

The intra-chunk attention runs once for the whole chunk, masked causal *and* same-sequence. Only
differences of cumulative gates are exponentiated, masked before ``exp``. Empty sequences cover
no token, so no chunk visits them: their final state (``initial_state[n]`` or zeros) is set
around the kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from tops_core.packing import sequence_of, sequence_starts

from tops_plugins_tpu_pallas import blocks, grid, launch
from tops_plugins_tpu_pallas.exponents import masked_exp
from tops_plugins_tpu_pallas.grid import Work, chunks_of_the_grid, pool_aliases, pool_states, sequence_states, state_rows, step_chunks
from tops_plugins_tpu_pallas.mxu import ROWS_BY_ROWS, matmul, mxu_operand_dtype
from tops_plugins_tpu_pallas.simple_gla.chunkwise import (
    LogDecays, advance_state, advance_state_work, chunk_body_vmem, chunk_gates, chunk_output_work, constant_decay,
    constant_gates, gate_computations, gates_work, log_decays, unreset,
)
from tops_plugins_tpu_pallas.config import CHUNK_SIZES
from tops_plugins_tpu_pallas.simple_gla import fused
from tops_plugins_tpu_pallas.plan import DmaSemaphores, InHbm, LaunchPlan, Relayout, Scalars, Scratch
from tops_plugins_tpu_pallas.layout import Geometry

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class VarlenConfig(fused.FusedConfig):
    """The fused kernel's fields and defaults but ``chunk_size`` (64 or 128, 128 by default: the packed kernel
    has not been checked at 256) and ``num_steps`` (8: the packed kernel's step has not been
    modelled at fused's 32): ``num_steps`` chunks per
    grid step at most (fewer when VMEM is short), ``full_values`` (one value block of all of ``V``),
    ``interpret`` (None: compile where lowered for a TPU, interpret elsewhere). ``attention_first`` must
    stay None: the packed kernel has one schedule (the boundaries' state resets sit inside its chain);
    ``float32_precision`` stays ``"highest"``."""

    ACCEPTED_CHUNK_SIZES: ClassVar[tuple] = CHUNK_SIZES

    chunk_size: int = 128
    num_steps: int = 8

    def __post_init__(self):
        super().__post_init__()
        if self.attention_first is not None:
            raise ValueError(f"VarlenConfig.attention_first must be None (the packed kernel has one schedule), got {self.attention_first!r}")
        if self.float32_precision != "highest":
            raise ValueError(f"VarlenConfig.float32_precision must be 'highest' (the packed kernel has no other yet), got {self.float32_precision!r}")


def boundaries(geometry: Geometry, num_seqs: int) -> tuple[Scalars, Scalars, Scalars]:
    """The SMEM scalars of a packed call: ``cu_seqlens`` and the first and last sequence of every chunk (``boundary_operands``)."""
    return (
        Scalars("cu_seqlens", (num_seqs + 1,), jnp.int32),
        Scalars("first_sequence", (geometry.num_chunks,), jnp.int32), Scalars("last_sequence", (geometry.num_chunks,), jnp.int32),
    )


def boundary_operands(cu_seqlens: jax.Array, seq_len: int, chunk_size: int) -> dict[str, jax.Array]:
    """The arrays of ``boundaries``, by operand name."""
    first_sequence, last_sequence = sequences_of_chunks(cu_seqlens, seq_len, chunk_size)
    return dict(cu_seqlens=cu_seqlens, first_sequence=first_sequence, last_sequence=last_sequence)


def plans(
    geometry: Geometry, dtype, num_seqs: int, *, gate_dtype=None, initial_state_dtype=None, output_final_state: bool = False,
    pool_rows: int | None = None,
) -> tuple[LaunchPlan]:
    """The (single) launch plan for one packed call of ``num_seqs`` sequences (``geometry.batch`` is 1); with
    ``pool_rows``, the states are a pool of that many rows (``state_rows``), the final states written into it in place."""
    g = geometry
    inputs = [blocks.key_rows("q", g, dtype), blocks.key_rows("k", g, dtype), blocks.value_rows("v", g, dtype)]
    if gate_dtype is not None:
        inputs.append(blocks.gates(g, gate_dtype))
    state_block = (g.padded_key_dim, g.value_block)
    scratch = [blocks.running_state(g), Scratch("leaving", state_block, _F32), DmaSemaphores("copies", 2)]
    if initial_state_dtype is not None:
        inputs.append(sequence_states("initial_state", g, num_seqs, initial_state_dtype, pool_rows=pool_rows))
        scratch.append(Scratch("loaded", state_block, initial_state_dtype))
    outputs = [blocks.value_rows("o", g, dtype)]
    if output_final_state:
        outputs.append(sequence_states("final_state", g, num_seqs, _F32, pool_rows=pool_rows))
    # Every segment runs the from-state and state-update matmuls of a whole chunk, masked, and
    # exponentiates its own decays (2 C + 1). Segments: one per chunk plus one per sequence starting
    # inside a chunk, at most N - 1 (the packing is traced, so this bound is what XLA is told).
    C, K, Vb = g.chunk_size, g.padded_key_dim, g.value_block
    segment_exps = Work(transcendentals=2 * C + 1)
    extra_segment = Work(flops=2 * C * K * Vb) + advance_state_work(g) + segment_exps
    gated = gate_dtype is not None
    work = (chunk_output_work(g) + advance_state_work(g) + segment_exps) * chunks_of_the_grid(g)
    work = work + gates_work(g, gated) * gate_computations(g, gated) + extra_segment * (g.heads * g.value_tiles * (num_seqs - 1))
    scalars = (blocks.decay(g), *boundaries(g, num_seqs), *([state_rows(num_seqs)] if pool_rows is not None else []))
    return (grid.grid_plan(
        "simple_gla_varlen", g, scalars, inputs, outputs, work, chunk_body_vmem(g), scratch, aliases=pool_aliases(pool_rows, output_final_state),
    ),)


def fitted_plans(geometry: Geometry, dtype, num_seqs: int, *, target: launch.Target = launch.UNKNOWN, **inputs) -> tuple[LaunchPlan]:
    """``plans`` at the geometry ``forward`` launches (fewer chunks per step while ``target``'s VMEM is short)."""
    return grid.fitted_plans(functools.partial(plans, num_seqs=num_seqs), geometry, dtype, target=target, **inputs)


def _at_row(column: jax.Array, rows: jax.Array, row: jax.Array) -> jax.Array:
    """``column[row]`` as ``(1, 1)`` by a masked sum (exact: one term), 0 when ``row`` is outside the chunk."""
    return jnp.sum(jnp.where(rows == row, column, 0.0), axis=0, keepdims=True)


@dataclasses.dataclass(frozen=True)
class Piece:
    """The rows ``[start, end)`` of one chunk that packed sequence ``sequence`` covers, and the decays they apply.

    ``query``, ``key`` and ``chunk`` are what ``ChunkGates``' fields are for a whole chunk, for the
    piece alone, so ``chunkwise.advance_state`` and the ``gradients`` state terms take a piece where
    they take a chunk's gates. Exponents are masked to the piece's rows before ``exp``.
    """

    sequence: jax.Array
    start: jax.Array  # first row (0 when the sequence started before the chunk)
    end: jax.Array  # end row (the chunk size when the sequence goes on past the chunk)
    continuing: jax.Array  # the sequence started before the chunk: its state is carried in
    ending: jax.Array  # the sequence ends inside the chunk (at its last row at the latest): its final state leaves here
    inside: jax.Array  # (C, 1): the piece's rows
    query: jax.Array  # (C, 1): exp(b_i - b_{start-1}) on the piece's rows, 0 elsewhere (and after a reset)
    key: jax.Array  # (C, 1): exp(b_{end-1} - b_j) on the piece's rows, 0 elsewhere (and before a reset)
    chunk: jax.Array  # (1, 1): exp(b_{end-1} - b_{start-1}), the decay over the whole piece

    @classmethod
    def of(cls, cu_seqlens, sequence: jax.Array, first: jax.Array, log: LogDecays) -> Piece:
        """Sequence ``sequence``'s piece of the chunk whose first token is ``first`` (``log``: the chunk's log decays)."""
        C = log.column.shape[0]
        rows = lax.broadcasted_iota(jnp.int32, (C, 1), 0)
        begins, ends = cu_seqlens[sequence], cu_seqlens[sequence + 1]
        start, end = jnp.clip(begins - first, 0, C), jnp.clip(ends - first, 0, C)
        inside = (rows >= start) & (rows < end)
        before, last = (_at_row(log.column, rows, row) for row in (start - 1, end - 1))
        if log.resets_column is None:
            # No gate can be -inf (no g): masked before and after exp, the form this kernel schedules best without resets.
            query, key = (jnp.where(inside, jnp.exp(jnp.where(inside, x, 0.0)), 0.0) for x in (log.column - before, last - log.column))
            chunk = jnp.exp(last - before)
        else:
            resets_before, resets_last = (_at_row(log.resets_column, rows, row) for row in (start - 1, end - 1))
            query = masked_exp(log.column - before, inside & unreset(log.resets_column, resets_before))
            key = masked_exp(last - log.column, inside & unreset(log.resets_column, resets_last))
            chunk = masked_exp(last - before, unreset(resets_last, resets_before))
        return cls(
            sequence=sequence, start=start, end=end, continuing=begins < first, ending=ends <= first + C,
            inside=inside, query=query, key=key, chunk=chunk,
        )

    @property
    def is_empty(self) -> jax.Array:
        return self.end <= self.start


def _kernel(*refs, plan: LaunchPlan, geometry: Geometry, scale: float):
    refs = plan.bind(refs)
    head, block, step = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    C, Vb = geometry.chunk_size, geometry.value_block
    cu = refs["cu_seqlens"]
    rows = lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    columns = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    states = grid.SequenceStates(refs, head, block, Vb, refs["state"].shape)

    constant, decay = constant_gates(refs, head, geometry), constant_decay(refs, head)
    state = refs["state"][...]  # unset at step 0, where the first sequence starts and never reads it
    for chunk in step_chunks(geometry, step):
        number = step * geometry.chunks_per_step + chunk.index
        first = number * C  # the chunk's first token in the packed sequence
        log = log_decays(chunk, refs, head, decay)
        gates = chunk_gates(chunk, refs, head, constant, log)
        q, k, v = chunk.read(refs["q"]), chunk.read(refs["k"]), chunk.read(refs["v"])
        operands = mxu_operand_dtype(q.dtype)

        def segment(n, carry, q=q, k=k, v=v, log=log, first=first, operands=operands):
            from_states, segment_start, carried = carry
            piece = Piece.of(cu, n, first, log)
            entering = jnp.where(piece.continuing, carried, states.load("initial_state", "loaded", n, ~piece.continuing))
            from_states = from_states + jnp.where(piece.inside, matmul(q, entering, operands) * piece.query, 0.0)
            leaving = advance_state(entering, k, v, piece)
            states.store("final_state", "leaving", n, leaving, piece.ending & ~piece.is_empty)
            return from_states, jnp.where(rows >= piece.start, piece.start, segment_start), leaving

        # The last segment's leaving state is the chunk's last sequence's, carried into the next chunk.
        from_states, segment_start, state = lax.fori_loop(
            refs["first_sequence"][number], refs["last_sequence"][number] + 1, segment,
            (jnp.zeros((C, Vb), _F32), jnp.zeros((C, 1), jnp.int32), state),
        )
        same_sequence = (rows >= columns) & (columns >= segment_start)
        attention = jnp.where(same_sequence, matmul(q, k, operands, ROWS_BY_ROWS) * gates.decays, 0.0)
        o = scale * (matmul(attention, v, operands) + from_states)
        refs["o"][chunk.rows, :] = o.astype(refs["o"].dtype)
    refs["state"][...] = state


def sequences_of_chunks(cu_seqlens: jax.Array, seq_len: int, chunk_size: int) -> tuple[jax.Array, jax.Array]:
    """The first and last sequence each chunk overlaps (int32 ``[chunks]`` each); empty sequences never are either."""
    starts = jnp.arange(0, seq_len, chunk_size, dtype=jnp.int32)
    last_tokens = jnp.minimum(starts + chunk_size, seq_len) - 1
    return sequence_of(cu_seqlens, starts), sequence_of(cu_seqlens, last_tokens)


def without_states(initial_state, output_final_state, ssm_state_indices=None) -> bool:
    """Whether a packed call has no per-sequence state to read or write: then it is the unpacked call with the state
    reset where each sequence starts (``reset_gates``), which the fused kernels take exactly and faster."""
    return initial_state is None and not output_final_state and ssm_state_indices is None


def reset_gates(g, cu_seqlens: jax.Array, shape: tuple[int, int, int]) -> jax.Array:
    """``g`` (zeros when None) as float32 ``[1, T, H]`` (``shape``) with ``-inf`` on every sequence's first token:
    ``exp(-inf) = 0`` resets the state before that token writes, as a packed sequence starts from zeros."""
    _, T, H = shape
    gates = jnp.zeros((1, T, H), jnp.float32) if g is None else g.astype(jnp.float32)
    return jnp.where(sequence_starts(cu_seqlens, T)[None, :, None], -jnp.inf, gates)


def unpacked_config(config: VarlenConfig) -> fused.FusedConfig:
    """The fused kernels' config for a packed call without states: the fields set away from varlen's defaults, and
    fused's own defaults for the rest (its chunk and step per chip, where varlen's are the packed kernel's: at B=2
    T=4096 H=8 with g, fused's defaults issue 52 us on v6e, varlen's chunk of 128 and 8 chunks per step 82 us)."""
    defaults = VarlenConfig()
    fields = dataclasses.fields(fused.FusedConfig)
    return fused.FusedConfig(**{f.name: getattr(config, f.name) for f in fields if getattr(config, f.name) != getattr(defaults, f.name)})


def forward(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, config: VarlenConfig, ssm_state_indices=None):
    """The ``Forward`` protocol of ``tops_core.ops.simple_gla`` for packed input (``B == 1``, ``cu_seqlens`` given),
    a state pool served in place (``Implementation.serves_pools``). Without states, ``fused.forward`` on ``reset_gates``:
    the packed kernel's loop over each chunk's sequences costs it 2.3x its HBM floor on v5e (modelled), fused 1.0x."""
    if without_states(initial_state, output_final_state, ssm_state_indices):
        return fused.forward(
            q, k, v, g=reset_gates(g, cu_seqlens, q.shape[:3]), g_gamma=g_gamma, scale=scale, initial_state=None,
            output_final_state=False, cu_seqlens=None, config=unpacked_config(config),
        )
    return pool_states(_forward, q, k, v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, config=config, ssm_state_indices=ssm_state_indices)


def _forward(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, config: VarlenConfig, ssm_state_indices):
    o, final_state = grid.run(
        _kernel, functools.partial(plans, num_seqs=cu_seqlens.shape[0] - 1), q, k, v, g=g, g_gamma=g_gamma, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, config=config,
        operands=boundary_operands(cu_seqlens, q.shape[1], config.chunk_size), ssm_state_indices=ssm_state_indices,
    )
    if final_state is None or ssm_state_indices is not None:  # a pool: an empty sequence's row is as it was
        return o, final_state
    return o, with_empty_sequences(final_state, cu_seqlens, initial_state)


def with_empty_sequences(per_sequence: jax.Array, cu_seqlens: jax.Array, passed_through: jax.Array | None) -> jax.Array:
    """A packed kernel's per-sequence result ``[N, H, K, V]`` (a final state, or ``dinitial_state``) with the rows of
    empty sequences set to ``passed_through``'s (None: zeros). A kernel writes the rows of the sequences that cover a
    token; an empty one passes its state (forward: ``initial_state[n]``) or its state's gradient (``dht[n]``) through."""
    empty = (cu_seqlens[1:] == cu_seqlens[:-1])[:, None, None, None]
    value = jnp.zeros((), per_sequence.dtype) if passed_through is None else passed_through.astype(per_sequence.dtype)
    return jnp.where(empty, value, per_sequence)
