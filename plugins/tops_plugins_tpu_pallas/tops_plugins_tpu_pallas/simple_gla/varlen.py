"""``tpu_pallas.varlen``: the simple_gla forward over packed sequences (``B == 1``, ``cu_seqlens``), in one ``pallas_call``.

Sequence boundaries may fall anywhere: inside a chunk, on a chunk or grid-step edge, at token 0; sequences may be
empty or one token long. The boundaries are traced under ``jit``: one compile serves every packing of the same ``T``
and ``N``.

Without states (no ``initial_state``, no final state, no pool) a packed call is the unpacked call with the state reset
where each sequence starts (``reset_gates``: ``g = -inf`` on its first token), and runs fused's kernel as it is.

With states it runs fused's kernel on the same reset gates (``forward_config``: fused's chunk and step for the chip),
and adds what the reset left out only where a sequence starts or ends. The boundaries are scalars in SMEM (scalar
prefetch): ``cu_seqlens`` and, per chunk, the first and last sequence it overlaps. For each sequence ``n`` with a
boundary inside a chunk (a loop over those alone, ``Boundary``), with ``b`` the chunk's cumulative log decays
(``LogDecays``: every exponent a difference of ``b`` with no reset between, masked before ``exp``):

- where it starts, at row ``r``: its initial state (one DMA from HBM, when given) enters its rows,
  ``o_i += scale * exp(b_i - b_r + g_r) q_i h0``, where ``g_r`` is its first token's own log decay, which the reset
  gate replaced (``first_gates``); when it goes on past the chunk, the carried state gains ``exp(b_C - b_r + g_r) h0``;
- where it ends, at row ``e``: its final state (one DMA to HBM) is the state entering the chunk decayed to ``e`` (when
  it started before the chunk), its keys' products decayed to ``e``, and its initial state's term (when it started in
  the chunk).

A grid step runs in three passes. First every chunk's loop (``_boundary_terms``), into VMEM: the initial states' terms
of the outputs and of the state leaving the chunk, and each final state, stored at once where its sequence started in
the chunk. Then fused's chain through the state (``fused.state_chain``), which adds those terms; a loop's traced
bounds and a DMA's branches cut the code into blocks the scheduler cannot overlap, so the chain has neither. Last, the
final state of each sequence carried into the chunk it ends in, whose term of the carried state the chain gave.

Empty sequences cover no token, so no chunk visits them: their final state (``initial_state[n]`` or zeros) is set
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

from tops_plugins_tpu_pallas import grid, launch
from tops_plugins_tpu_pallas.exponents import masked_exp
from tops_plugins_tpu_pallas.grid import (
    Work, pool_aliases, pool_states, sequence_states, start_sequence, state_buffers, state_rows, step_chunks,
)
from tops_plugins_tpu_pallas.mxu import COLUMNS_BY_COLUMNS, matmul
from tops_plugins_tpu_pallas.simple_gla.chunkwise import LogDecays, constant_gates, log_decays, step_gates
from tops_plugins_tpu_pallas.config import CHUNK_SIZES
from tops_plugins_tpu_pallas.simple_gla import fused
from tops_plugins_tpu_pallas.plan import Blocked, LaunchPlan, Scalars, Scratch
from tops_plugins_tpu_pallas.layout import Geometry

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class VarlenConfig(fused.FusedConfig):
    """The fused kernel's fields and defaults but ``chunk_size`` (64 or 128, 128 by default) and ``num_steps`` (8), the
    packed backward's with states (``backward_varlen``, which has not been checked at 256 nor modelled at fused's 32):
    ``num_steps`` chunks per grid step at most (fewer when VMEM is short), ``full_values`` (one value block of all of
    ``V``), ``interpret`` (None: compile where lowered for a TPU, interpret elsewhere). Every packed forward, and the
    backward without states, run fused's kernels at fused's own defaults for the fields left at varlen's
    (``unpacked_config``). ``attention_first`` must stay None (the packed forward has one schedule);
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
    """The (single) launch plan for one packed call of ``num_seqs`` sequences with states (``geometry.batch`` is 1, at
    ``forward_config``'s chunk): fused's, whose ``g`` is always given (``reset_gates``, float32, so ``gate_dtype`` is
    not used), with the boundaries, each sequence's first log decay (``first_gates``) and the per-sequence states moved
    by DMA; with ``pool_rows``, those are rows of a pool of that many rows (``state_rows``), written in place."""
    del gate_dtype
    (plan,) = fused.plans(geometry, dtype, gate_dtype=_F32)
    g = geometry
    state_block = (g.padded_key_dim, g.value_block)
    inputs, outputs = [*plan.inputs, first_gates_block(g, num_seqs)], list(plan.outputs)
    scratch = list(plan.scratch)
    n, C, K, Vb = g.chunks_per_step, g.chunk_size, g.padded_key_dim, g.value_block
    # Every chunk's boundary terms, computed ahead of the chain (``_boundary_terms``).
    if initial_state_dtype is not None:
        inputs.append(sequence_states("initial_state", g, num_seqs, initial_state_dtype, pool_rows=pool_rows))
        scratch += state_buffers("initial_state", state_block, initial_state_dtype)
        scratch += [Scratch("initial_outputs", (n, C, Vb), _F32), Scratch("initial_pieces", (n, K, Vb), _F32)]
    if output_final_state:
        outputs.append(sequence_states("final_state", g, num_seqs, _F32, pool_rows=pool_rows))
        scratch += [*state_buffers("final_state", state_block, _F32), Scratch("final_pieces", (n, K, Vb), _F32)]
    # Every sequence starts and ends once: its initial state's product with the chunk's queries, its keys' product into
    # its final state, and the decays of both (2 C + 1 exps).
    boundary = Work(flops=2 * 2 * C * K * Vb, transcendentals=2 * C + 1) * (g.heads * g.value_tiles * num_seqs)
    scalars = (*plan.scalars, *boundaries(g, num_seqs), *([state_rows(num_seqs)] if pool_rows is not None else []))
    return (dataclasses.replace(
        plan, name="simple_gla_varlen", scalars=scalars, inputs=tuple(inputs), outputs=tuple(outputs), scratch=tuple(scratch),
        flops=plan.flops + boundary.flops, transcendentals=plan.transcendentals + boundary.transcendentals,
        aliases=pool_aliases(pool_rows, output_final_state),
    ),)


def chunk_sequences(refs: dict, number: jax.Array, geometry: Geometry) -> tuple[jax.Array, jax.Array]:
    """Chunk ``number``'s first and last sequence (``boundaries``). A chunk of a padded grid past the end of ``T`` (which
    the scalars do not reach) reads as the middle of the last real chunk's last sequence, which ``first_sequence_of``
    says goes on through it: a chunk with no boundary, its rows zeros."""
    if not geometry.chunks_past_end:
        return refs["first_sequence"][number], refs["last_sequence"][number]
    index = geometry.real_chunk(number)
    last = refs["last_sequence"][index]
    return jnp.where(geometry.past_end(number), last, refs["first_sequence"][index]), last


def first_sequence_of(refs: dict, number: jax.Array, geometry: Geometry) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Chunk ``number``'s first sequence (``chunk_sequences``), whether it started before the chunk (its state is carried
    in), and whether it goes on past the chunk (then it has no boundary in it; as a chunk past the end has none)."""
    sequence, _ = chunk_sequences(refs, number, geometry)
    cu, first, C = refs["cu_seqlens"], number * geometry.chunk_size, geometry.chunk_size
    return sequence, cu[sequence] < first, (cu[sequence + 1] > first + C) | geometry.past_end(number)


def first_gates_block(geometry: Geometry, num_seqs: int) -> Blocked:
    """``first_gates`` ``[H, 1, N]``: the grid head's row (fetched again only when the head changes)."""

    def head_row(b, h, tile, t, *_):
        return (h, 0, 0)

    return Blocked("first_gates", (geometry.heads, 1, num_seqs), _F32, (None, 1, num_seqs), head_row)


def first_gates(g, g_gamma, cu_seqlens: jax.Array, shape: tuple[int, int, int]) -> jax.Array:
    """Each sequence's log decay at its first token, float32 ``[H, 1, N]``: what its initial state decays by there, which
    ``reset_gates`` puts ``-inf`` in place of (``g`` there plus ``g_gamma``; an empty sequence's is never read)."""
    _, T, H = shape
    gates = jnp.zeros((cu_seqlens.shape[0] - 1, H), _F32)
    if g is not None:
        gates = gates + g[0, jnp.clip(cu_seqlens[:-1], 0, T - 1), :].astype(_F32)
    if g_gamma is not None:
        gates = gates + jnp.broadcast_to(g_gamma.astype(_F32), (H,))
    return gates.T[:, None, :]


def fitted_plans(geometry: Geometry, dtype, num_seqs: int, *, target: launch.Target = launch.UNKNOWN, **inputs) -> tuple[LaunchPlan]:
    """``plans`` at the geometry ``forward`` launches (fewer chunks per step while ``target``'s VMEM is short)."""
    return grid.fitted_plans(functools.partial(plans, num_seqs=num_seqs), geometry, dtype, target=target, **inputs)


def value_at(x: jax.Array, index: jax.Array, axis: int) -> jax.Array:
    """``x``'s slice at a traced ``index`` along ``axis``, kept as a size-1 axis (a row's or a column's entry as ``(1, 1)``,
    a matrix's column as ``(C, 1)``), by a masked sum: exact (one term), and 0 where ``index`` is outside ``x``."""
    return jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, x.shape, axis) == index, x, 0.0), axis=axis, keepdims=True)


def since_start(log: LogDecays, first_gate: jax.Array, start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(g_r - b_r, R_r)`` of a sequence whose first token is row ``start`` of a chunk with log decays ``log`` (rows), its
    own log decay there ``first_gate`` (``first_gates``; the reset gate put ``-inf`` in its place): added to ``b_i`` with
    no reset between (``R_i == R_r``), the log decay from just before its first token to row ``i``."""
    return first_gate - value_at(log.row, start, 1), value_at(log.resets_row, start, 1)


def to_chunk_end(log: LogDecays, since: jax.Array, start_resets: jax.Array, when: jax.Array) -> jax.Array:
    """``exp(b_C - b_r + g_r)`` (``since_start``'s terms) where ``when``: how a sequence's initial state decays from before its
    first token to the end of the chunk, where it goes on past it (the carried state's share)."""
    return masked_exp(log.row[:, -1:] + since, when & (log.resets_row[:, -1:] == start_resets))


@dataclasses.dataclass(frozen=True)
class Boundary:
    """Sequence ``sequence``'s piece of a chunk it starts or ends in, and the decays of its state terms, from the chunk's
    reset gates (``reset_gates``: the state dropped where every sequence starts).

    ``query``, ``key`` and ``chunk`` are what ``ChunkGates``' fields are for a whole chunk, for the piece's own state
    terms, which the reset gates leave out, so the ``gradients`` state terms take a boundary where they take a chunk's
    gates: ``query`` is how its initial state decays to each of its rows (from before its first token, whose own log
    decay ``g_r`` the reset replaced: ``exp(b_i - b_r + g_r)``; 0 where it started before the chunk), ``key`` how each
    of its rows' products decays to its last row (``exp(b_e - b_j)``; 0 where it goes on past the chunk; a ``(1, C)`` row
    for keys along lanes, the forward's at chunks of 128 and more), ``chunk`` how the state entering the piece decays to
    the state leaving it.
    """

    start: jax.Array  # first row (0 when the sequence started before the chunk)
    end: jax.Array  # end row (the chunk size when the sequence goes on past the chunk)
    starts: jax.Array  # the sequence starts in the chunk: its initial state enters here
    ends: jax.Array  # the sequence ends in the chunk: its final state's gradient enters here
    query: jax.Array  # (C, 1)
    key: jax.Array  # (C, 1), or (1, C) along lanes
    chunk: jax.Array  # (1, 1)

    @classmethod
    def of(
        cls, cu_seqlens, sequence: jax.Array, first: jax.Array, log: LogDecays, first_gate: jax.Array, keys_along_lanes: bool = False,
    ) -> Boundary:
        """Sequence ``sequence``'s boundary in the chunk whose first token is ``first`` and log decays ``log`` (of the reset
        gates); ``first_gate``: the sequence's first log decay (``first_gates``)."""
        C = log.column.shape[0]
        begins, ends = cu_seqlens[sequence] - first, cu_seqlens[sequence + 1] - first
        starts, ends_here = (begins >= 0) & (ends > begins), (ends <= C) & (ends > begins)
        since, start_resets = since_start(log, first_gate, begins)
        last = jnp.minimum(ends, C) - 1
        last_log, last_resets = value_at(log.row, last, 1), value_at(log.resets_row, last, 1)
        rows, resets = lax.broadcasted_iota(jnp.int32, (C, 1), 0), log.resets_column.astype(_F32)
        query = masked_exp(log.column + since, starts & (resets == start_resets))
        if keys_along_lanes:
            lanes = lax.broadcasted_iota(jnp.int32, (1, C), 1)
            key = masked_exp(last_log - log.row, ends_here & (log.resets_row.astype(_F32) == last_resets) & (lanes <= last))
        else:
            key = masked_exp(last_log - log.column, ends_here & (resets == last_resets) & (rows <= last))
        whole = jnp.where(
            starts, masked_exp(last_log + since, last_resets == start_resets), masked_exp(last_log, last_resets == 0),
        )
        return cls(
            start=jnp.maximum(begins, 0), end=jnp.minimum(ends, C), starts=starts, ends=ends_here,
            query=query, key=key, chunk=whole,
        )


def _kernel(*refs, plan: LaunchPlan, geometry: Geometry, scale: float, attention_first: bool, operands, resets_dtype):
    refs = plan.bind(refs)
    head, block, step = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    start_sequence(refs, step, from_initial_state=False)  # every sequence's own initial state enters where it starts
    states = grid.SequenceStates(refs, head, block, geometry.value_block, refs["state"].shape, read_ahead=1)
    states.begin(step == 0)
    along_lanes = fused.gates_along_lanes(True, geometry.chunk_size)
    chunks = step_chunks(geometry, step)
    every_gates = step_gates(
        chunks, refs, head, constant_gates(refs, head, geometry), along_lanes=along_lanes, resets_dtype=resets_dtype,
    )
    numbers = [step * geometry.chunks_per_step + chunk.index for chunk in chunks]
    # Every chunk's boundary terms first: a loop with traced bounds, and each DMA's branches, cut the code around them
    # into blocks the scheduler cannot overlap, so inside the chain they would stop it at every chunk.
    carried = [
        _boundary_terms(refs, states, chunk, number, gates.log if along_lanes else log_decays(chunk, refs, head),
                        geometry=geometry, scale=scale, operands=operands, along_lanes=along_lanes)
        for chunk, number, gates in zip(chunks, numbers, every_gates)
    ]
    with_initial, with_final = states.has("initial_state"), states.has("final_state")

    def state_terms(index, entering):
        if with_final:  # the chunk's first sequence, carried in, ends in it (else its decay is 0)
            refs["final_pieces"][index] = refs["final_pieces"][index] + carried[index] * entering
        return refs["initial_pieces"][index] if with_initial else None

    fused.state_chain(
        refs, chunks, every_gates, scale=scale, attention_first=attention_first, operands=operands, along_lanes=along_lanes,
        output_terms=lambda index: refs["initial_outputs"][index] if with_initial else None, state_terms=state_terms,
    )
    if with_final:  # the final states of the sequences carried into the chunk they end in, now that the chain gave them
        for chunk, number in zip(chunks, numbers):
            sequence, carried_in, goes_on = first_sequence_of(refs, number, geometry)
            states.store("final_state", sequence, refs["final_pieces"][chunk.index], carried_in & ~goes_on)
    states.finish(step == geometry.time_steps - 1)


def _boundary_terms(refs, states, chunk, number, log: LogDecays, *, geometry: Geometry, scale, operands, along_lanes: bool) -> jax.Array:
    """What the reset gates leave out of chunk ``number``, for each sequence with a boundary inside it (a loop over those
    alone, ``Boundary``), into VMEM for the chain (``_kernel``): where a sequence starts, its initial state's share of
    the chunk's outputs (``initial_outputs``) and, where it goes on past the chunk, of the state leaving it
    (``initial_pieces``); where it ends, its final state, stored when it started in the chunk, else kept without the
    carried state's term (``final_pieces``), whose decay ``exp(b_e)`` this returns ((1, 1), 0 where no sequence is
    carried into the chunk and ends in it)."""
    C = chunk.rows.size
    cu, first = refs["cu_seqlens"], number * C
    q, k, v = chunk.read(refs["q"]), chunk.read(refs["k"]), chunk.read(refs["v"])
    keys = k.T.astype(_F32) if along_lanes else k.astype(_F32)
    first_gates = refs["first_gates"][...]  # (1, N)
    with_initial, with_final = states.has("initial_state"), states.has("final_state")
    K, Vb = states.shape
    index = chunk.index
    # The initial states' terms add up in VMEM, not in the loop's carries: C x Vb + K x Vb float32 would take most of
    # the vector registers.
    if with_initial:
        refs["initial_outputs"][index] = jnp.zeros((C, Vb), _F32)
        refs["initial_pieces"][index] = jnp.zeros((K, Vb), _F32)

    def boundary(n, terms):
        final_piece, carried = terms
        edge = Boundary.of(cu, n, first, log, value_at(first_gates, n, 1), keys_along_lanes=along_lanes)
        initial = states.load("initial_state", n, edge.starts)
        if with_initial:
            refs["initial_outputs"][index] += scale * matmul(q, initial, operands) * edge.query
            refs["initial_pieces"][index] += jnp.where(edge.starts & ~edge.ends, edge.chunk, 0.0) * initial
        if with_final:
            written = matmul(keys * edge.key, v, operands) if along_lanes else matmul(keys * edge.key, v, operands, COLUMNS_BY_COLUMNS)
            states.store("final_state", n, edge.chunk * initial + written if with_initial else written, edge.starts & edge.ends)
            carried_in = edge.ends & ~edge.starts
            final_piece = jnp.where(carried_in, written, final_piece)
            carried = jnp.where(carried_in, edge.chunk, carried)
        return final_piece, carried

    # The chunk's first sequence when it starts here, or ends here and its final state is wanted; every later one (each
    # starts here).
    first_sequence, carried_in, goes_on = first_sequence_of(refs, number, geometry)
    skipped = carried_in & goes_on if with_final else carried_in
    final_piece, carried = lax.fori_loop(
        first_sequence + skipped.astype(jnp.int32), chunk_sequences(refs, number, geometry)[1] + 1, boundary,
        (jnp.zeros((K, Vb), _F32), jnp.zeros((1, 1), _F32)),
    )
    if with_final:
        refs["final_pieces"][index] = final_piece
    return carried


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


def sequence_cuts(starts: jax.Array, chunk_size: int, num_chunks: int) -> dict[str, jax.Array]:
    """What ``ChunkGates.cut_at`` takes of every chunk of ``chunk_size`` from ``starts`` (``[T]`` bool,
    ``sequence_starts``), int32, by operand name (``blocks.sequence_cuts``): ``first_starts`` and ``last_starts``
    ``[num_chunks]`` (``num_chunks * chunk_size >= T``), where each chunk's first and last start lie (``chunk_size`` and
    0: none); ``next_starts`` ``[1, T]``, where the first start after each token lies in its chunk (``chunk_size``: none)."""
    T = starts.shape[0]
    tokens = jnp.arange(T, dtype=jnp.int32)
    beyond = jnp.int32(T + chunk_size)
    at_or_after = lax.cummin(jnp.where(starts, tokens, beyond), reverse=True)
    after = jnp.concatenate([at_or_after[1:], beyond[None]])
    next_starts = jnp.minimum(after - tokens // chunk_size * chunk_size, chunk_size)
    by_chunk = jnp.pad(starts, (0, num_chunks * chunk_size - T)).reshape(num_chunks, chunk_size)
    positions = jnp.arange(chunk_size, dtype=jnp.int32)
    return dict(
        first_starts=jnp.min(jnp.where(by_chunk, positions, chunk_size), axis=1),
        last_starts=jnp.max(jnp.where(by_chunk, positions, 0), axis=1),
        next_starts=next_starts[None, :],
    )


def unpacked_config(config: VarlenConfig) -> fused.FusedConfig:
    """The fused kernels' config for a packed forward, and a packed backward without states: the fields set away from
    varlen's defaults, and fused's own defaults for the rest (its chunk and step per chip, where varlen's are the packed
    backward's: at B=2 T=4096 H=8 with g, fused's defaults issue 52 us on v6e, varlen's chunk of 128 and 8 chunks per
    step 82 us)."""
    defaults = VarlenConfig()
    fields = dataclasses.fields(fused.FusedConfig)
    return fused.FusedConfig(**{f.name: getattr(config, f.name) for f in fields if getattr(config, f.name) != getattr(defaults, f.name)})


def forward(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, config: VarlenConfig, ssm_state_indices=None):
    """The ``Forward`` protocol of ``tops_core.ops.simple_gla`` for packed input (``B == 1``, ``cu_seqlens`` given),
    a state pool served in place (``Implementation.serves_pools``). Without states, ``fused.forward`` on ``reset_gates``;
    with them, fused's kernel on the same gates with each sequence's start and end added (``_kernel``)."""
    if without_states(initial_state, output_final_state, ssm_state_indices):
        return fused.forward(
            q, k, v, g=reset_gates(g, cu_seqlens, q.shape[:3]), g_gamma=g_gamma, scale=scale, initial_state=None,
            output_final_state=False, cu_seqlens=None, config=unpacked_config(config),
        )
    return pool_states(_forward, q, k, v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, config=config, ssm_state_indices=ssm_state_indices)


def forward_config(config: VarlenConfig, key_dim: int, chip: str | None) -> fused.FusedConfig:
    """The config a packed forward runs at, with states or without: fused's (``unpacked_config``), resolved for the
    chip it is lowered for (``fused.resolved``)."""
    return fused.resolved(unpacked_config(config), key_dim, chip)


def _forward(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, config: VarlenConfig, ssm_state_indices):
    chip = launch.Target.lowered_for().chip
    unpacked = forward_config(config, q.shape[-1], chip)
    gates = reset_gates(g, cu_seqlens, q.shape[:3])
    operands = {
        **fused.gates_as_rows(gates, unpacked.chunk_size), **boundary_operands(cu_seqlens, q.shape[1], unpacked.chunk_size),
        "first_gates": first_gates(g, g_gamma, cu_seqlens, q.shape[:3]),
    }
    kernel = functools.partial(
        _kernel, attention_first=fused.attention_first(unpacked, q.dtype, q.shape[-1], chip),
        operands=fused.operands_of(unpacked, q.dtype), resets_dtype=fused.resets_dtype(chip),
    )
    o, final_state = grid.run(
        kernel, functools.partial(plans, num_seqs=cu_seqlens.shape[0] - 1), q, k, v, g=gates, g_gamma=g_gamma, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, config=unpacked, operands=operands,
        ssm_state_indices=ssm_state_indices,
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
