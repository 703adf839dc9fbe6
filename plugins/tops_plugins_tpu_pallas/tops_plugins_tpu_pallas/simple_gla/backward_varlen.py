"""The backward of ``tpu_pallas.varlen``: the fused backward's two walks over packed sequences.

The grid, segments, blocks and reverse index maps of ``backward_fused`` over the packed ``T``
(``(1, head, 1, segment)``, all of ``V`` per block), with the boundaries of the forward: ``cu_seqlens``
and each chunk's first and last sequence as SMEM scalars, traced under ``jit`` (one compile for
every packing of the same ``T`` and ``N``). A chunk holds one or more *pieces*, the part of one sequence inside it.

1. **checkpoints** walks time forwards and writes the float32 state entering every chunk (so the gradients kernel
   recomputes none). With chunks of 128 or more it is fused's walk (gates along lanes) on the reset gates
   (``varlen.reset_gates``), which drop every state where a sequence starts, plus the initial state (one DMA, when
   given) of a sequence that starts inside a chunk and goes on past it, ``exp(b_C - b_r + g_r) h0``, as the packed
   forward adds it (``_entering_state``). With chunks of 64 (gates as columns) a chunk advances the state through its
   *last* piece alone, the only one whose state goes on: from the carried state if its sequence started before the
   chunk, else from ``initial_state[n]`` or zeros.
2. **gradients** is fused's gradients kernel on the same reset gates, its segments walked from the last to the first
   and each chunk's entering state read from the checkpoints: its ``dS`` chain stops where a sequence starts, and its
   decay matrix holds no pair of two sequences. What the reset gates leave out is added only where a sequence starts
   or ends inside a chunk (a loop over those sequences alone, ``varlen.Boundary``): where it starts, its initial state's
   reads (into ``dq``) and ``dinitial_state[n]`` (one DMA out); where it ends, ``dht[n]`` (one DMA in, when given)
   reaching its keys and values (into ``dk``, ``dv``); and the state carried across its piece (into ``dg``). The
   ``dS`` chain itself gains ``dht[n]`` where a sequence that started before the chunk ends in it. The loop runs in the
   chain's pass, before its step through each chunk, over the sequences from the last to the first, so that every
   state is loaded in descending order and each load reads the next one ahead (``SequenceStates``). ``dg`` sums a
   token's products only within its own piece (the decay matrix, and ``_boundary_terms``' token masks), so its sums
   restart at every sequence start; a sequence's first token, whose reset gate scales nothing, gets its initial state's terms alone.

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
from tops_core.packing import sequence_starts

from tops_plugins_tpu_pallas import blocks, grid, launch
from tops_plugins_tpu_pallas.exponents import masked_exp
from tops_plugins_tpu_pallas.simple_gla import backward_fused, fused, gradients, varlen
from tops_plugins_tpu_pallas.grid import Work, step_chunks
from tops_plugins_tpu_pallas.simple_gla.chunkwise import (
    ChunkGates, LogDecays, advance_state, advance_state_work, constant_decay, gates_work, log_decays, step_gates, unreset,
)
from tops_plugins_tpu_pallas.plan import LaunchPlan, Scratch
from tops_plugins_tpu_pallas.layout import Geometry, kernel_operands

_F32 = jnp.float32

SEGMENT_TOKENS = 2048
"""Tokens per segment of the packed backward with states when ``backward_num_steps`` is None (the fused backward's
``SEGMENT_TOKENS`` is 4096). Its walk checkpoints every chunk, so a longer segment spares it nothing: at 4096 its kernels
issue 0.6% fewer cycles on v6e and 3% fewer on v5e (16 sequences in T=8192, ``g``, both states: 784442 -> 779561,
890304 -> 862830) for twice the compile (13 -> 27 s)."""

geometry_of = functools.partial(backward_fused.geometry_of, segment_tokens=SEGMENT_TOKENS)


@dataclasses.dataclass(frozen=True)
class Piece:
    """The last piece of a chunk (the part of sequence ``sequence`` inside it) in the checkpoints walk at chunks of 64, and
    the decays that advance the state through it: ``key`` and ``chunk`` are ``ChunkGates``' fields for the piece alone,
    so ``chunkwise.advance_state`` takes a piece where it takes a chunk's gates. Exponents are masked to the piece's rows
    before ``exp``."""

    sequence: jax.Array
    continuing: jax.Array  # the sequence started before the chunk: its state is carried in
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
            key = jnp.where(inside, jnp.exp(jnp.where(inside, last - log.column, 0.0)), 0.0)
            chunk = jnp.exp(last - before)
        else:
            resets_before, resets_last = (varlen.value_at(log.resets_column, row, 0) for row in (start - 1, end - 1))
            key = masked_exp(last - log.column, inside & unreset(log.resets_column, resets_last))
            chunk = masked_exp(last - before, unreset(resets_last, resets_before))
        return cls(sequence=sequence, continuing=begins < first, key=key, chunk=chunk)


def fitted_plans(geometry: Geometry, dtype, num_seqs: int, *, target: launch.Target = launch.UNKNOWN, **inputs) -> tuple[LaunchPlan, LaunchPlan]:
    """``plans`` at the geometry ``backward`` launches (fewer chunks per segment while ``target``'s VMEM is short)."""
    return launch.fit(functools.partial(plans, num_seqs=num_seqs), geometry, dtype, target, **inputs)[1]


def _boundary_work(geometry: Geometry) -> Work:
    """A sequence's start or end in the gradients kernel: its initial state's reads and gradient, its final state's
    gradient into keys and values (four ``C x K x V`` products), the exps of its key decays and of the state carried."""
    C, K, V = geometry.chunk_size, geometry.padded_key_dim, geometry.padded_value_dim
    return Work(flops=4 * 2 * C * K * V, transcendentals=C + 3)


def plans(
    geometry: Geometry, dtype, num_seqs: int, *, gate_dtype=None, initial_state_dtype=None, output_final_state: bool = False, decayed: bool = True,
) -> tuple[LaunchPlan, LaunchPlan]:
    """The checkpoints and gradients plans for ``num_seqs`` packed sequences; the other arguments as ``backward_fused.plans``
    (``gate_dtype``: the caller's ``g``, which the checkpoints walk reads at chunks of 64; else both kernels read the
    float32 reset gates)."""
    g = geometry = grid.backward_geometry(geometry)
    K, V, C = g.padded_key_dim, g.padded_value_dim, g.chunk_size
    scalars = (blocks.decay(g), *varlen.boundaries(g, num_seqs))
    heads_chunks = g.heads * g.num_chunks
    along_lanes = walks_along_lanes(C)
    first_gates = [varlen.first_gates_block(g, num_seqs)] if initial_state_dtype is not None else []

    # The checkpoints walk writes the state entering every chunk (_checkpoints_kernel).
    walk_gates = _F32 if along_lanes else gate_dtype
    checkpoint_inputs = list(gradients.token_inputs(g, dtype, walk_gates, ("k", "v"), along_lanes))
    checkpoint_scratch = [blocks.running_state(g)]
    entering = Work()
    if initial_state_dtype is not None:
        checkpoint_inputs += first_gates if along_lanes else []
        checkpoint_inputs.append(grid.sequence_states("initial_state", g, num_seqs, initial_state_dtype))
        checkpoint_scratch += grid.state_buffers("initial_state", (K, V), initial_state_dtype)
        entering = Work(flops=2 * K * V, transcendentals=1) * (g.heads * num_seqs)
    checkpoint_work = (advance_state_work(g) + gates_work(g, walk_gates is not None, attention=False)) * heads_chunks + entering
    checkpoints = grid.grid_plan(
        "simple_gla_varlen_backward_checkpoints", g, scalars, checkpoint_inputs, (grid.state_checkpoints(g),),
        checkpoint_work, 4 * (3 * K * V + C * K), scratch=checkpoint_scratch,
    )

    steps = functools.partial(grid.reversed_in_time, geometry=g)
    inputs = [steps(x) for x in gradients.token_inputs(g, dtype, _F32, ("q", "k", "v", "do"), along_lanes)]
    inputs.append(steps(grid.state_checkpoints(g)))
    outputs = [steps(blocks.key_rows("dq", g, dtype)), steps(blocks.key_rows("dk", g, dtype)), steps(blocks.value_rows("dv", g, dtype))]
    if decayed:
        outputs.append(steps(gradients.decay_gradients(g)))
    scratch = [grid.state_gradient(g), *_boundary_scratch(g, decayed)]
    if initial_state_dtype is not None:
        inputs += [*first_gates, grid.sequence_states("initial_state", g, num_seqs, initial_state_dtype)]
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
    )
    # Every sequence starts and ends once: at most two boundaries each.
    work = per_chunk * heads_chunks + _boundary_work(g) * (2 * g.heads * num_seqs) + gradients.gating_work(g, True)
    # The body: fused's segment, what the boundary loop carries (dq, dk: C x K, dv: C x V, with reads and writes) and
    # the dS chain's products of every chunk of the segment (K x V each).
    body = backward_fused.segment_vmem(g) + 4 * (4 * C * K + C * V + g.chunks_per_step * K * V)
    return checkpoints, grid.grid_plan(
        "simple_gla_varlen_backward", g, scalars, inputs, outputs, work, body,
        scratch=scratch,
    )


def _sequence_states(refs: dict, head, step, geometry: Geometry, read_ahead: int) -> grid.SequenceStates:
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
    states = _sequence_states(refs, head, step, geometry, read_ahead=1)  # walking forward: the sequences ascending

    @pl.when(step == 0)
    def _start():  # the first sequence starts at token 0: zeros keep the first checkpoint finite
        refs["state"][...] = jnp.zeros(refs["state"].shape, _F32)

    C = geometry.chunk_size
    chunks = step_chunks(geometry, step)
    state = refs["state"][...]
    if walks_along_lanes(C):
        every_gates = step_gates(chunks, refs, head, None, attention=False, along_lanes=True)
        # Every chunk's initial states before the chain: their loads' branches would cut it into one block per chunk.
        entering = [
            _entering_state(refs, states, step * geometry.chunks_per_step + chunk.index, geometry, gates.log) if states.has("initial_state") else None
            for chunk, gates in zip(chunks, every_gates)
        ]
        for chunk, gates in zip(chunks, every_gates):
            refs["checkpoints"][chunk.index] = state
            k = chunk.read(refs["k"])
            state = advance_state(state, k.T, chunk.read(refs["v"]), gates, gradients.decay_gradient_operands(k.dtype), True)
            if entering[chunk.index] is not None:
                state = state + entering[chunk.index]
    else:
        decay = constant_decay(refs, head)
        for chunk in chunks:
            refs["checkpoints"][chunk.index] = state
            number = step * geometry.chunks_per_step + chunk.index
            # Only the chunk's last piece leaves a state that goes on: its sequence's carried state or initial state.
            piece = Piece.of(refs["cu_seqlens"], varlen.chunk_sequences(refs, number, geometry)[1], number * C, log_decays(chunk, refs, head, decay))
            entering = jnp.where(piece.continuing, state, states.load("initial_state", piece.sequence, ~piece.continuing))
            k = chunk.read(refs["k"])
            state = advance_state(entering, k, chunk.read(refs["v"]), piece, gradients.decay_gradient_operands(k.dtype))
    refs["state"][...] = state
    states.finish(step == geometry.time_steps - 1)


def _entering_state(refs: dict, states: grid.SequenceStates, number: jax.Array, geometry: Geometry, log: LogDecays) -> jax.Array:
    """What the initial state of chunk ``number``'s last sequence adds to the state leaving the chunk, where that sequence
    starts inside the chunk (at row ``r``, whose reset gate dropped it) and goes on past it: ``exp(b_C - b_r + g_r) h0``,
    ``g_r`` its first token's own log decay (``varlen.first_gates``)."""
    cu, (_, last), chunk_size = refs["cu_seqlens"], varlen.chunk_sequences(refs, number, geometry), geometry.chunk_size
    start, end = cu[last] - number * chunk_size, cu[last + 1] - number * chunk_size
    enters = (start >= 0) & (end > chunk_size)
    initial = states.load("initial_state", last, enters)
    since, start_resets = varlen.since_start(log, varlen.value_at(refs["first_gates"][...], last, 1), start)
    return varlen.to_chunk_end(log, since, start_resets, enters) * initial


def _gradients_kernel(*refs, plan: LaunchPlan, geometry: Geometry, scale: float, form: gradients.ChunkForm):
    refs = plan.bind(refs)
    head, step = pl.program_id(1), pl.program_id(3)
    C = geometry.chunk_size
    cu = refs["cu_seqlens"]
    grid.start_state_gradient(refs, step, from_final_state=False)  # the last sequence's dht enters where it ends
    states = _sequence_states(refs, head, step, geometry, read_ahead=-1)  # walking backward: the sequences descending
    with_decay = "da" in refs

    forward_step = geometry.time_steps - 1 - step
    chunks = step_chunks(geometry, forward_step)
    if walks_along_lanes(C):
        every_gates = step_gates(chunks, refs, head, None, along_lanes=True, key_column=True)
        every_log = [gates.log for gates in every_gates]
    else:
        decay = constant_decay(refs, head)
        every_log = [log_decays(chunk, refs, head, decay) for chunk in chunks]
        every_gates = [ChunkGates.of(log) for log in every_log]

    def number_of(chunk) -> jax.Array:
        return forward_step * geometry.chunks_per_step + chunk.index

    K, V = geometry.padded_key_dim, geometry.padded_value_dim
    # The dS chain's products first: between the loops below, each would have waited on its own.
    reads = [
        gradients.state_gradient_of_reads(every_gates[chunk.index], chunk.read(refs["q"]), chunk.read(refs["do"]), scale, form.passes.chain)
        for chunk in chunks
    ]
    # The dS chain, as fused's (the reset gates stop it where a sequence starts), and before each chunk's step what the
    # reset gates leave out where a sequence starts or ends inside it (a loop, into VMEM; the sequences from the last
    # to the first, so every state is loaded in the order read ahead). The chain gains the dht of a chunk's first
    # sequence where it started before the chunk and ends in it: the one boundary it carries past.
    dstate, leaving = refs["dstate"][...], [None] * len(chunks)
    for chunk in reversed(chunks):
        leaving[chunk.index] = dstate
        number = number_of(chunk)
        first, (_, last_sequence) = number * C, varlen.chunk_sequences(refs, number, geometry)
        first_sequence, carried_in, goes_on = varlen.first_sequence_of(refs, number, geometry)
        boundary_terms = functools.partial(
            _boundary_terms, refs=refs, states=states, chunk=chunk, log=every_log[chunk.index], first=first,
            last_sequence=last_sequence, first_sequence=first_sequence, entering=refs["checkpoints"][chunk.index],
            dleaving=dstate, scale=scale,
        )
        # The terms of dq, dk and dv add up in VMEM, not in the loop's carries: 3 C x K float32 would take most of the
        # vector registers.
        refs["boundary_dq"][chunk.index] = jnp.zeros((C, K), _F32)
        refs["boundary_dk"][chunk.index] = jnp.zeros((C, K), _F32)
        refs["boundary_dv"][chunk.index] = jnp.zeros((C, V), _F32)
        # Only the sequences with a boundary inside the chunk: the first one when it starts or ends here, and every later
        # one (each starts here).
        dg, first_dht = lax.fori_loop(
            0, last_sequence - first_sequence + 1 - (carried_in & goes_on).astype(jnp.int32), boundary_terms,
            (jnp.zeros((1, C), _F32), jnp.zeros((K, V), _F32)),
        )
        if with_decay:
            refs["boundary_dg"][chunk.index : chunk.index + 1, :] = dg

        gates = every_gates[chunk.index]
        dstate = gates.chunk * dstate + reads[chunk.index]
        if states.has("dht"):
            end = cu[first_sequence + 1] - first
            dstate = dstate + jnp.where(carried_in & ~goes_on, varlen.value_at(gates.query, end - 1, 0), 0.0) * first_dht
    refs["dstate"][...] = dstate

    # Fused's gradients of every chunk, with the boundaries' terms added.
    every_gradients = gradients.reversed_gradients(
        chunks, every_gates, refs, lambda chunk: refs["checkpoints"][chunk.index], leaving, scale, with_decay, form,
    )
    for chunk, (dq, dk, dv, da) in every_gradients:
        refs["dv"][chunk.rows, :] = (dv + refs["boundary_dv"][chunk.index]).astype(refs["dv"].dtype)
        refs["dq"][chunk.rows, :] = (dq + refs["boundary_dq"][chunk.index]).astype(refs["dq"].dtype)
        refs["dk"][chunk.rows, :] = (dk + refs["boundary_dk"][chunk.index]).astype(refs["dk"].dtype)
        if da is not None:
            refs["da"][chunk.index : chunk.index + 1, :] = da + refs["boundary_dg"][chunk.index : chunk.index + 1, :]
    states.finish(step == geometry.time_steps - 1)


def _boundary_scratch(geometry: Geometry, decayed: bool) -> list[Scratch]:
    """The gradients kernel's float32 VMEM of every chunk's boundary terms in a grid step (``_boundary_terms``)."""
    n, C, K, V = geometry.chunks_per_step, geometry.chunk_size, geometry.padded_key_dim, geometry.padded_value_dim
    scratch = [Scratch("boundary_dq", (n, C, K), _F32), Scratch("boundary_dk", (n, C, K), _F32), Scratch("boundary_dv", (n, C, V), _F32)]
    return scratch + [Scratch("boundary_dg", (n, C), _F32)] if decayed else scratch


def _boundary_terms(i, terms, *, refs, states, chunk, log, first, last_sequence, first_sequence, entering, dleaving, scale):
    """The ``i``-th sequence from ``last_sequence`` down, ``n``: its terms that the reset gates leave out of ``chunk``
    (``varlen.Boundary``), added to the chunk's ``boundary_dq``, ``boundary_dk`` and ``boundary_dv`` in VMEM and to
    ``terms`` (``dg``, then ``dht``): its initial state's reads and gradient where it starts, its final state's gradient
    reaching its keys and values where it ends, and the decay gradient of these and of the state carried across its
    piece; and its ``dht`` where it is ``first_sequence`` and started before the chunk (for the ``dS`` chain).
    ``entering``, ``dleaving``: the chunk's state entering and ``dS`` leaving."""
    n = last_sequence - i
    dg, first_dht = terms
    index = chunk.index
    q, k, v, do = (chunk.read(refs[name]) for name in ("q", "k", "v", "do"))
    first_gate = varlen.value_at(refs["first_gates"][...], n, 1) if "first_gates" in refs else jnp.zeros((1, 1), _F32)
    edge = varlen.Boundary.of(refs["cu_seqlens"], n, first, log, first_gate)
    # Both loads first and the store last: each DMA's branches end a block of code the scheduler overlaps within.
    initial = states.load("initial_state", n, edge.starts)
    dht = states.load("dht", n, edge.ends) if states.has("dht") else None
    dpiece = dleaving  # dS leaving the piece
    reads = writes = jnp.zeros((q.shape[0], k.shape[1]), _F32)
    if states.has("initial_state"):
        reads = gradients.state_reads(edge, do, initial)
        refs["boundary_dq"][index] += scale * reads
    if dht is not None:
        first_dht = jnp.where((n == first_sequence) & ~edge.starts, dht, first_dht)
        dpiece = jnp.where(edge.ends, dht, dleaving)
        writes = gradients.state_writes(edge, v, dht)
        refs["boundary_dk"][index] += writes
        refs["boundary_dv"][index] += gradients.state_value_gradient(edge, k, dht)
    dinitial = gradients.state_gradient_entering(edge, q, do, dpiece, scale)
    if "boundary_dg" in refs:  # the decay gradient is wanted
        C = q.shape[0]
        rows, tokens = (lax.broadcasted_iota(jnp.int32, (C, C), axis) for axis in (0, 1))
        later, earlier = gradients.state_decay_gradients(
            q, k, reads, writes, scale, (rows >= tokens) & (tokens >= edge.start), (rows < tokens) & (tokens < edge.end),
        )
        carried = edge.chunk * jnp.sum(jnp.where(edge.starts, initial, entering) * dpiece)
        dg = dg + later + earlier + jnp.where((tokens[:1] >= edge.start) & (tokens[:1] < edge.end), carried, 0.0)
    states.store("dinitial_state", n, dinitial, edge.starts)
    return dg, first_dht


def backward(q, k, v, do, *, g, g_gamma, scale, initial_state, dht, cu_seqlens, config):
    """The ``Backward`` protocol of ``tops_core.ops.simple_gla`` for packed input (``B == 1``, ``cu_seqlens`` given).
    Without states, ``backward_fused`` on ``varlen.reset_gates``, as the forward: the gradient of a reset token's gate
    is exactly 0 there, as a sequence's first gate scales a zero state; without ``g`` too, on the sequence starts
    themselves, which cut ``g_gamma``'s gates (``backward_fused.backward``'s ``sequence_starts``)."""
    if varlen.without_states(initial_state, dht is not None):
        fused_config = varlen.unpacked_config(config)
        if g is None:
            return backward_fused.backward(
                q, k, v, do, g=None, g_gamma=g_gamma, scale=scale, initial_state=None, dht=None, cu_seqlens=None,
                config=fused_config, sequence_starts=sequence_starts(cu_seqlens, q.shape[1]),
            )
        grads = backward_fused.backward(
            q, k, v, do, g=varlen.reset_gates(g, cu_seqlens, q.shape[:3]), g_gamma=g_gamma, scale=scale,
            initial_state=None, dht=None, cu_seqlens=None, config=fused_config,
        )
        return dataclasses.replace(grads, dg=grads.dg.astype(g.dtype))
    B, T, H, K = q.shape
    num_seqs = cu_seqlens.shape[0] - 1
    inputs = gradients.plan_inputs(q, g, g_gamma, initial_state, dht)
    geometry, (checkpoints_plan, gradients_plan), run = launch.prepare(
        functools.partial(plans, num_seqs=num_seqs), geometry_of(B, T, H, K, v.shape[-1], config), q.dtype, config.interpret, **inputs,
    )
    boundaries = varlen.boundary_operands(cu_seqlens, T, config.chunk_size)
    # Both kernels take the gates with each sequence's first one -inf, as the forward does, and that first one apart.
    reset = varlen.reset_gates(g, cu_seqlens, q.shape[:3])
    arrays = {**gradients.with_gate_rows(gradients.operands(q, k, v, do, reset, g_gamma, initial_state, dht, geometry), reset, geometry), **boundaries}
    if initial_state is not None:
        arrays["first_gates"] = varlen.first_gates(g, g_gamma, cu_seqlens, q.shape[:3])
    walk_arrays = arrays if walks_along_lanes(geometry.chunk_size) else {**kernel_operands(q, k, v, g, g_gamma, initial_state, geometry), **boundaries}
    checkpoints = run(checkpoints_plan, _checkpoints_kernel, walk_arrays)
    chip = launch.Target.lowered_for().chip
    form = gradients.chunk_form(q.dtype, chip, g is not None, g_gamma is not None)
    results = run(gradients_plan, _gradients_kernel, {**arrays, **checkpoints}, scale=scale, form=form)
    grads = gradients.caller_gradients(results, q, k, v, g, g_gamma, initial_state, geometry)
    if initial_state is None:
        return grads
    return dataclasses.replace(grads, dinitial_state=varlen.with_empty_sequences(grads.dinitial_state, cu_seqlens, dht))
