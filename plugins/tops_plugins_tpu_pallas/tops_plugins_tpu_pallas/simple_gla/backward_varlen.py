"""The backward of ``tpu_pallas.varlen``: the fused backward's two walks over packed sequences.

The grid, segments, blocks and reverse index maps of ``backward_fused`` over the packed ``T``
(``(1, head, 1, segment)``, all of ``V`` per block), with the boundaries of the forward: ``cu_seqlens``
and each chunk's first and last sequence as SMEM scalars, traced under ``jit`` (one compile for
every packing of the same ``T`` and ``N``). A chunk holds one or more *pieces* (``Piece``,
the part of one sequence inside it).

1. **checkpoints** walks time forwards and writes the float32 state entering every chunk (so the gradients kernel
   recomputes none). With chunks of 128 or more it is fused's walk (gates along lanes) on the reset gates
   (``varlen.reset_gates``), which drop every state where a sequence starts, plus the initial state (one DMA, when
   given) of a sequence that starts inside a chunk and goes on past it, ``exp(b_C - b_r + g_r) h0``, as the packed
   forward adds it (``_entering_state``). With chunks of 64 (gates as columns) a chunk advances the state through its
   *last* piece alone, the only one whose state goes on: from the carried state if its sequence started before the
   chunk, else from ``initial_state[n]`` or zeros.
2. **gradients** walks the segments from the last to the first, its chunks backwards (each entering state read from
   the checkpoints) and each chunk's pieces backwards, carrying the float32 ``dS`` in VMEM. A piece's ``dS`` leaving is
   ``dht[n]`` (one DMA, when given; else zeros) when its sequence ends inside the chunk, else the
   ``dS`` carried from the next chunk; the ``dS`` entering a piece whose sequence starts inside the
   chunk is ``dinitial_state[n]`` (one DMA), else it is carried to the previous chunk. A piece adds
   its state terms (``gradients.state_reads``, ``state_writes``, ``state_value_gradient``) to its
   own rows; the intra-chunk terms run once per chunk, with fused's decay matrix masked to pairs
   of one sequence; ``dg`` sums a token's products only within its own piece, so the cumulative
   sums restart at every sequence start (``gradients.query_key_gradients_of``).

Empty sequences cover no token: their ``dinitial_state`` (``dht[n]`` or zeros: their final state
is their initial state) is set around the kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tops_plugins_tpu_pallas import blocks, grid, launch
from tops_plugins_tpu_pallas.exponents import masked_exp
from tops_plugins_tpu_pallas.simple_gla import backward_fused, fused, gradients, varlen
from tops_plugins_tpu_pallas.grid import Work, step_chunks
from tops_plugins_tpu_pallas.simple_gla.chunkwise import (
    LogDecays, advance_state, advance_state_work, chunk_gates, constant_decay, constant_gates, gates_work, log_decays,
    step_gates, unreset,
)
from tops_plugins_tpu_pallas.plan import LaunchPlan
from tops_plugins_tpu_pallas.layout import Geometry, kernel_operands

_F32 = jnp.float32

geometry_of = backward_fused.geometry_of  # the fused backward's segment (backward_num_steps, or backward_fused.SEGMENT_TOKENS' worth)


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
        before, last = (varlen.value_at(log.column, row, 0) for row in (start - 1, end - 1))
        if log.resets_column is None:
            # No gate can be -inf (no g): masked before and after exp, the form this kernel schedules best without resets.
            query, key = (jnp.where(inside, jnp.exp(jnp.where(inside, x, 0.0)), 0.0) for x in (log.column - before, last - log.column))
            chunk = jnp.exp(last - before)
        else:
            resets_before, resets_last = (varlen.value_at(log.resets_column, row, 0) for row in (start - 1, end - 1))
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


def fitted_plans(geometry: Geometry, dtype, num_seqs: int, *, target: launch.Target = launch.UNKNOWN, **inputs) -> tuple[LaunchPlan, LaunchPlan]:
    """``plans`` at the geometry ``backward`` launches (fewer chunks per segment while ``target``'s VMEM is short)."""
    return launch.fit(functools.partial(plans, num_seqs=num_seqs), geometry, dtype, target, **inputs)[1]


def _piece_work(geometry: Geometry) -> Work:
    """A piece's own state terms in the gradients kernel: reads, writes, dv's state part and dS entering, and its 2 C + 1 exps."""
    C, K, V = geometry.chunk_size, geometry.padded_key_dim, geometry.padded_value_dim
    return Work(flops=4 * 2 * C * K * V, transcendentals=2 * C + 1)


def plans(
    geometry: Geometry, dtype, num_seqs: int, *, gate_dtype=None, initial_state_dtype=None, output_final_state: bool = False, decayed: bool = True,
) -> tuple[LaunchPlan, LaunchPlan]:
    """The checkpoints and gradients plans for ``num_seqs`` packed sequences; the other arguments as ``backward_fused.plans``."""
    g = geometry = grid.backward_geometry(geometry)
    K, V, C = g.padded_key_dim, g.padded_value_dim, g.chunk_size
    scalars = (blocks.decay(g), *varlen.boundaries(g, num_seqs))
    gated = gate_dtype is not None
    heads_chunks = g.heads * g.num_chunks
    # A chunk's log decays in the gradients kernel: its g's cumulative sum (the flops of gates_work, none of its exps).
    cumulative_decays = Work(flops=gates_work(g, gated).flops)

    # The checkpoints walk writes the state entering every chunk (_checkpoints_kernel).
    along_lanes = walks_along_lanes(C)
    checkpoint_inputs = list(gradients.token_inputs(g, dtype, _F32 if along_lanes else gate_dtype, ("k", "v"), along_lanes))
    checkpoint_scratch = [blocks.running_state(g)]
    entering = Work()
    if initial_state_dtype is not None:
        checkpoint_inputs += [varlen.first_gates_block(g, num_seqs)] if along_lanes else []
        checkpoint_inputs.append(grid.sequence_states("initial_state", g, num_seqs, initial_state_dtype))
        checkpoint_scratch += grid.state_buffers("initial_state", (K, V), initial_state_dtype)
        entering = Work(flops=2 * K * V, transcendentals=1) * (g.heads * num_seqs)
    checkpoint_work = (advance_state_work(g) + gates_work(g, True, attention=False)) * heads_chunks + entering
    checkpoints = grid.grid_plan(
        "simple_gla_varlen_backward_checkpoints", g, scalars, checkpoint_inputs, (grid.state_checkpoints(g, every_chunk=True),),
        checkpoint_work, 4 * (3 * K * V + C * K), scratch=checkpoint_scratch,
    )

    steps = functools.partial(grid.reversed_in_time, geometry=g)
    inputs = [steps(x) for x in gradients.token_inputs(g, dtype, gate_dtype, ("q", "k", "v", "do"))]
    inputs.append(steps(grid.state_checkpoints(g, every_chunk=True)))
    outputs = [steps(blocks.key_rows("dq", g, dtype)), steps(blocks.key_rows("dk", g, dtype)), steps(blocks.value_rows("dv", g, dtype))]
    if decayed:
        outputs.append(steps(gradients.decay_gradients(g)))
    scratch = [grid.state_gradient(g)]
    if initial_state_dtype is not None:
        inputs.append(grid.sequence_states("initial_state", g, num_seqs, initial_state_dtype))
        outputs.append(grid.sequence_states("dinitial_state", g, num_seqs, initial_state_dtype))
        scratch += [*grid.state_buffers("initial_state", (K, V), initial_state_dtype),
                    *grid.state_buffers("dinitial_state", (K, V), initial_state_dtype)]
    if output_final_state:
        inputs.append(grid.sequence_states("dht", g, num_seqs, _F32))
        scratch += grid.state_buffers("dht", (K, V), _F32)
    per_chunk = (
        gradients.attention_work(g)
        + gradients.value_gradient_work(g)
        + gradients.query_key_gradients_work(g, decayed)
        + gradients.state_gradient_work(g)
        + Work(transcendentals=2 * C + 1)  # the exps of a chunk's first piece; its products are the four counted above
    )
    # Pieces beyond one per chunk: one per sequence starting inside a chunk, at most N - 1 per head.
    work = per_chunk * heads_chunks + _piece_work(g) * (g.heads * (num_seqs - 1))
    work = work + gradients.gating_work(g, gated) + cumulative_decays * heads_chunks
    # The body: the backward chunk's values, plus what the piece loop carries: reads, writes (C x K), dv's state part (C x V).
    return checkpoints, grid.grid_plan(
        "simple_gla_varlen_backward", g, scalars, inputs, outputs, work, gradients.body_vmem(g) + 4 * (2 * C * K + C * V),
        scratch=scratch,
    )


def _sequence_states(refs: dict, head, step, geometry: Geometry, read_ahead: bool) -> grid.SequenceStates:
    """The kernel's per-sequence states (``SequenceStates``), every buffer free at its first step."""
    shape = (geometry.padded_key_dim, geometry.padded_value_dim)
    states = grid.SequenceStates(refs, head, 0, geometry.padded_value_dim, shape, read_ahead)
    states.begin(step == 0)
    return states


def walks_along_lanes(chunk_size: int) -> bool:
    """Whether the checkpoints walk is fused's on the reset gates, along lanes (``fused.gates_along_lanes``: chunks of
    128 and more), with each sequence's initial state added where it starts; else it advances each chunk's last piece
    from its columns of ``g`` (chunks of 64, whose rows would not fill 128 lanes; fused's walk on columns of the reset
    gates, tried, left the CPU interpreter's gradients one ulp apart between segment lengths)."""
    return fused.gates_along_lanes(True, chunk_size)


def _checkpoints_kernel(*refs, plan: LaunchPlan, geometry: Geometry):
    refs = plan.bind(refs)
    head, step = pl.program_id(1), pl.program_id(3)
    states = _sequence_states(refs, head, step, geometry, read_ahead=True)  # walking forward: read ahead

    @pl.when(step == 0)
    def _start():  # the first sequence starts at token 0: zeros keep the first checkpoint finite
        refs["state"][...] = jnp.zeros(refs["state"].shape, _F32)

    C = geometry.chunk_size
    chunks = step_chunks(geometry, step)
    state = refs["state"][...]
    if walks_along_lanes(C):
        every_gates = step_gates(chunks, refs, head, None, attention=False, along_lanes=True)
        for chunk, gates in zip(chunks, every_gates):
            refs["checkpoints"][chunk.index] = state
            k = chunk.read(refs["k"])
            state = advance_state(state, k.T, chunk.read(refs["v"]), gates, gradients.decay_gradient_operands(k.dtype), True)
            if states.has("initial_state"):
                state = state + _entering_state(refs, states, step * geometry.chunks_per_step + chunk.index, C, gates.log)
    else:
        decay = constant_decay(refs, head)
        for chunk in chunks:
            refs["checkpoints"][chunk.index] = state
            number = step * geometry.chunks_per_step + chunk.index
            # Only the chunk's last piece leaves a state that goes on: its sequence's carried state or initial state.
            piece = Piece.of(refs["cu_seqlens"], refs["last_sequence"][number], number * C, log_decays(chunk, refs, head, decay))
            entering = jnp.where(piece.continuing, state, states.load("initial_state", piece.sequence, ~piece.continuing))
            k = chunk.read(refs["k"])
            state = advance_state(entering, k, chunk.read(refs["v"]), piece, gradients.decay_gradient_operands(k.dtype))
    refs["state"][...] = state
    states.finish(step == geometry.time_steps - 1)


def _entering_state(refs: dict, states: grid.SequenceStates, number: jax.Array, chunk_size: int, log: LogDecays) -> jax.Array:
    """What the initial state of chunk ``number``'s last sequence adds to the state leaving the chunk, where that sequence
    starts inside the chunk (at row ``r``, whose reset gate dropped it) and goes on past it: ``exp(b_C - b_r + g_r) h0``,
    ``g_r`` its first token's own log decay (``varlen.first_gates``)."""
    cu, last = refs["cu_seqlens"], refs["last_sequence"][number]
    start, end = cu[last] - number * chunk_size, cu[last + 1] - number * chunk_size
    enters = (start >= 0) & (end > chunk_size)
    initial = states.load("initial_state", last, enters)
    since, start_resets = varlen.since_start(log, varlen.value_at(refs["first_gates"][...], last, 1), start)
    return varlen.to_chunk_end(log, since, start_resets, enters) * initial


def _gradients_kernel(*refs, plan: LaunchPlan, geometry: Geometry, scale: float):
    refs = plan.bind(refs)
    head, step = pl.program_id(1), pl.program_id(3)
    C, K, V = geometry.chunk_size, geometry.padded_key_dim, geometry.padded_value_dim
    cu = refs["cu_seqlens"]
    states = _sequence_states(refs, head, step, geometry, read_ahead=False)  # walked both ways in a step
    with_decay = "da" in refs
    rows = lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    columns = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    lanes = lax.broadcasted_iota(jnp.int32, (1, C), 1)

    forward_step = geometry.time_steps - 1 - step
    constant, decay = constant_gates(refs, head, geometry), constant_decay(refs, head)
    chunks = step_chunks(geometry, forward_step)

    def number_of(chunk) -> jax.Array:
        return forward_step * geometry.chunks_per_step + chunk.index

    # dS entering the next segment's first piece: unset at the first reverse step, whose last piece ends at T and takes dht.
    dstate = refs["dstate"][...]
    for chunk in reversed(chunks):
        number = number_of(chunk)
        first = number * C  # the chunk's first token in the packed sequence
        log = log_decays(chunk, refs, head, decay)
        gates = chunk_gates(chunk, refs, head, constant, log)
        q, k, v, do = (chunk.read(refs[name]) for name in ("q", "k", "v", "do"))
        last = refs["last_sequence"][number]

        def piece_gradients(i, carry, q=q, k=k, v=v, do=do, log=log, first=first, last=last, entering_chunk=refs["checkpoints"][chunk.index]):
            reads, writes, values, across, piece_start, piece_end, dleaving = carry
            piece = Piece.of(cu, last - i, first, log)
            n = piece.sequence
            entering = jnp.where(piece.continuing, entering_chunk, states.load("initial_state", n, ~piece.continuing))
            dleaving = jnp.where(piece.ending, states.load("dht", n, piece.ending), dleaving)
            reads = reads + jnp.where(piece.inside, gradients.state_reads(piece, do, entering), 0.0)
            writes = writes + jnp.where(piece.inside, gradients.state_writes(piece, v, dleaving), 0.0)
            values = values + jnp.where(piece.inside, gradients.state_value_gradient(piece, k, dleaving), 0.0)
            if with_decay:  # the state carried across the piece: every token of the piece decays it
                across = across + jnp.where((lanes >= piece.start) & (lanes < piece.end), piece.chunk * jnp.sum(entering * dleaving), 0.0)
            dentering = gradients.state_gradient_entering(piece, q, do, dleaving, scale)
            states.store("dinitial_state", n, dentering, ~piece.continuing & ~piece.is_empty)
            piece_start = jnp.where(piece.inside, piece.start, piece_start)
            piece_end = jnp.where(piece.inside, piece.end, piece_end)
            return reads, writes, values, across, piece_start, piece_end, dentering

        start = (
            jnp.zeros((C, K), _F32), jnp.zeros((C, K), _F32), jnp.zeros((C, V), _F32), jnp.zeros((1, C), _F32),
            jnp.zeros((C, 1), jnp.int32), jnp.full((C, 1), C, jnp.int32), dstate,
        )
        # The pieces from the chunk's last sequence back to its first; the last dS is the first piece's entering one.
        reads, writes, values, across, piece_start, piece_end, dstate = lax.fori_loop(
            0, last - refs["first_sequence"][number] + 1, piece_gradients, start,
        )
        same_sequence = (rows >= columns) & (columns >= piece_start)
        decays = jnp.where(same_sequence, gates.decays, 0.0)
        attention = gradients.attention(decays, q, k)
        dv = gradients.attention_value_gradient(attention, do, scale) + values
        dq, dk, da = gradients.query_key_gradients_of(
            decays, attention, gradients.output_by_value(do, v), q, k, reads, writes, across if with_decay else None, scale, (piece_start, piece_end),
        )
        refs["dv"][chunk.rows, :] = dv.astype(refs["dv"].dtype)
        refs["dq"][chunk.rows, :] = dq.astype(refs["dq"].dtype)
        refs["dk"][chunk.rows, :] = dk.astype(refs["dk"].dtype)
        if da is not None:
            refs["da"][chunk.index : chunk.index + 1, :] = da
    refs["dstate"][...] = dstate
    states.finish(step == geometry.time_steps - 1)


def backward(q, k, v, do, *, g, g_gamma, scale, initial_state, dht, cu_seqlens, config):
    """The ``Backward`` protocol of ``tops_core.ops.simple_gla`` for packed input (``B == 1``, ``cu_seqlens`` given).
    Without states, ``backward_fused`` on ``varlen.reset_gates``, as the forward: the gradient of a reset token's gate
    is exactly 0 there, as a sequence's first gate scales a zero state."""
    if varlen.without_states(initial_state, dht is not None):
        grads = backward_fused.backward(
            q, k, v, do, g=varlen.reset_gates(g, cu_seqlens, q.shape[:3]), g_gamma=g_gamma, scale=scale,
            initial_state=None, dht=None, cu_seqlens=None, config=varlen.unpacked_config(config),
        )
        return dataclasses.replace(grads, dg=None if g is None else grads.dg.astype(g.dtype))
    B, T, H, K = q.shape
    num_seqs = cu_seqlens.shape[0] - 1
    inputs = gradients.plan_inputs(q, g, g_gamma, initial_state, dht)
    geometry, (checkpoints_plan, gradients_plan), run = launch.prepare(
        functools.partial(plans, num_seqs=num_seqs), geometry_of(B, T, H, K, v.shape[-1], config), q.dtype, config.interpret, **inputs,
    )
    arrays = {
        **gradients.operands(q, k, v, do, g, g_gamma, initial_state, dht, geometry),
        **varlen.boundary_operands(cu_seqlens, T, config.chunk_size),
    }
    walk_arrays = arrays
    if walks_along_lanes(geometry.chunk_size):  # the gates with each sequence's first one -inf, as the forward takes them
        reset = varlen.reset_gates(g, cu_seqlens, q.shape[:3])
        walk_arrays = {**arrays, **gradients.with_gate_rows(kernel_operands(q, k, v, reset, g_gamma, None, geometry), reset, geometry)}
        if initial_state is not None:
            walk_arrays["first_gates"] = varlen.first_gates(g, g_gamma, cu_seqlens, q.shape[:3])
    checkpoints = run(checkpoints_plan, _checkpoints_kernel, walk_arrays)
    results = run(gradients_plan, _gradients_kernel, {**arrays, **checkpoints}, scale=scale)
    grads = gradients.caller_gradients(results, q, k, v, g, g_gamma, initial_state, geometry)
    if initial_state is None:
        return grads
    return dataclasses.replace(grads, dinitial_state=varlen.with_empty_sequences(grads.dinitial_state, cu_seqlens, dht))
