"""The backward of kda's ``tpu_pallas.fused`` and, packed, ``tpu_pallas.varlen``: every gradient in two ``pallas_call``s
on the fused grid (one where there is no walk).

1. **checkpoints**: the forward kernel itself (``fused.kernel``) walking time, writing float32 states instead of
   ``o``, and reading no ``q``: without the queries it computes the states alone (no ``Aqk``, no ``o``;
   ``chunkwise.chunk_steps``), with the delta rule in the WY form (``chunkwise.ahead_of_walk``: two dependent products
   per link where the forward's solve takes three; the forward's states to the rounding of its bf16 operands). Which
   states (``walks_every_chunk``): for kda, and with the delta rule over more than one segment (grid step) or packed,
   the state entering every chunk and the chunk's inverse, which the gradients kernel then need not
   compute; otherwise the state leaving every segment but the last, walking those alone (as simple_gla's fused
   backward), and no walk at all where one segment is the whole sequence: the gradients kernel walks each segment's
   chunks for their states from the one entering it. Under ``grad`` or ``vjp`` the forward kernel has written what this
   walk would (``residuals``, ``grid.handed_on``: the forward's own states and inverses, ``Implementation.residuals``),
   and no walk runs: one segment reads the forward's inverses, more read its states too.
2. **gradients**: the grid's time axis reversed (``grid.reversed_in_time``; nothing flipped or
   copied). A step's gradients are the VJPs of the forward's own chunk functions, taken by ``jax.vjp`` inside
   the kernel at the chunks' inputs and entering states (``_step_gradients``), in three passes: every chunk's
   inputs (``fused.activated_gate_and_strength``, ``chunkwise.prepared_queries_keys``: the activations,
   ``use_qk_l2norm``) and factors (the recurrence's ``factors``: decays, pairs, the exact inverse), recomputed;
   then the chain of ``through_state``'s VJPs from the step's last chunk to its first, with ``do`` and the state
   gradient ``dS`` carried in VMEM from the step after (without the delta rule, each chunk's part from ``do``
   first, off the chain); then every chunk's factors' and inputs' VJPs. So the backward differentiates the function
   the forward computes (with the delta rule in the WY form where ``KdaFusedConfig.wy_gradients`` says so: the same
   function, its writes ``u - W S``), both paths (exact and bounded gates), every option, and an op's fast path (gla's, chosen
   around the step's factors and everything after them), and a change to the chunk math changes both. Packed,
   each sequence's terms (``kda.sequences``) add their VJPs on the chain: ``dht[n]`` where a sequence ends,
   ``dinitial_state[n]`` where it starts.

Two things keep the VJP as exact as the forward, both in the forward's own building blocks:
``mxu.matmul`` differentiates into products of the same kind with float32 cotangents (jax's rule
would round each cotangent to the operands' dtype), and the run sums of ``g`` (``chunkwise.run_sums``,
``column_sums``) into the same three exact bf16 passes over the cotangent (jax's rule would round it to
bf16: ``dg`` off by 1e-3 in float32). No ``exp`` is taken that the forward does not take: the VJP of
``exp`` reuses its value, so strong decays give no Inf or NaN here either.

Outputs per value head: ``dv``, ``dg`` (of the gate as given), ``dbeta`` (as given: of the logits with
``use_beta_sigmoid``), one row ``(1, C)`` per chunk like simple_gla's decay gradient; ``dq`` and ``dk``
per query/key head, with grouped value heads summed over the group in VMEM (``_over_the_group``);
``dA_log`` and ``ddt_bias`` summed over the chunks in blocks that stay in VMEM along the time axis, then
over the batch after the kernel; ``dinitial_state`` from ``dS`` after the first chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from tops_core.ops.kda import Activations, KDAGrads

from tops_plugins_tpu_pallas import blocks, grid, launch
from tops_plugins_tpu_pallas.grid import (
    Chunk, backward_geometry, by_step, chunk_inverses, entering_segment, finish_state_gradient, reversed_in_time, segment_ends,
    segment_entering_state, segments_but_the_last, start_state_gradient, state_checkpoints, state_gradient, step_chunks,
    walks_every_chunk,
)
from tops_plugins_tpu_pallas.kda import fused
from tops_plugins_tpu_pallas.kda.chunkwise import KDA, fine_block_size, prepared_queries_keys, with_wy
from tops_plugins_tpu_pallas.kda.fused import KdaFusedConfig, activated_gate_and_strength, geometry_of, read_chunk
from tops_plugins_tpu_pallas.kda.sequences import PackedChunk, sequence_work
from tops_plugins_tpu_pallas.mxu import column_to_row, mxu_operand_dtype
from tops_plugins_tpu_pallas.layout import Geometry, caller_output, caller_state, heads_flattened, kernel_operands, padded_state
from tops_plugins_tpu_pallas.plan import Blocked, LaunchPlan, Scratch
from tops_plugins_tpu_pallas.recurrence import Recurrence
from tops_plugins_tpu_pallas.grid import SequenceStates, sequence_states, state_buffers
from tops_plugins_tpu_pallas.simple_gla.varlen import with_empty_sequences

__all__ = ["backward", "geometry_of", "gradients", "plans"]

_F32 = jnp.float32

VJP_WORK_FACTOR = 3
"""The gradients kernel's work per chunk, in units of the forward chunk's (``chunk_work``): the VJP recomputes the
forward and transposes each product twice (both operands' cotangents). Declared to XLA as the cost estimate."""

VJP_VMEM_FACTOR = 3
"""The gradients kernel's body values, in units of the forward's: one chunk's working values (``chunk_body_vmem``), and
what each other chunk of the step keeps (``kept_vmem``), its factors being the VJP's residuals,
held with their cotangents through the step's chain."""


def _per_head_sums(name: str, geometry: Geometry, width: int) -> Blocked:
    """A float32 ``[B, HV, 1, width]`` sum over the chunks of one (batch, head): a block that stays in VMEM along the
    time axis (its index does not change with the time step), accumulated there."""
    g = geometry

    def head_block(b, h, tile, t, *_):
        return (b, h, 0, 0)

    return Blocked(name, (g.batch, g.heads, 1, width), _F32, (None, None, 1, width), head_block)


def plans(
    geometry: Geometry, dtype, *, gate_dtype=None, beta_dtype=None, initial_state_dtype=None, output_final_state: bool = False,
    use_qk_l2norm: bool = False, activations: Activations = Activations(), with_A_log: bool = False, dt_bias_dtype=None,
    num_seqs: int | None = None, recurrence: Recurrence = KDA, handed_on: frozenset[str] = frozenset(),
) -> tuple[LaunchPlan, ...]:
    """The checkpoints and gradients plans of one call, or the gradients plan alone where there is no walk
    (``walks_every_chunk``, or the forward handed on what it would write: ``handed_on``, ``"checkpoints"`` and
    ``"inverses"``, read by the gradients kernel as the walk's); ``output_final_state``: a ``dht`` is given;
    ``num_seqs``: a packed call (``B == 1``) of that many sequences, whose per-sequence ``initial_state``, ``dht`` and
    ``dinitial_state`` sit in HBM and move by DMA where each sequence starts or ends; the other arguments as
    ``fused.plans``'."""
    geometry = backward_geometry(geometry)
    packed = num_seqs is not None
    every_chunk = walks_every_chunk(recurrence, geometry, packed)
    forward_inputs = dict(
        gate_dtype=gate_dtype, beta_dtype=beta_dtype, use_qk_l2norm=use_qk_l2norm, activations=activations,
        with_A_log=with_A_log, dt_bias_dtype=dt_bias_dtype, num_seqs=num_seqs, recurrence=recurrence,
    )
    (forward,) = fused.plans(geometry, dtype, initial_state_dtype=initial_state_dtype, **forward_inputs)
    # The forward's kernel walking for the states alone: no queries read, no Aqk, no o (kda.chunkwise.chunk_steps). It
    # writes the state entering every chunk, and with the delta rule each chunk's inverse too; or else the state leaving
    # every segment but the last, walking those alone, and none where one segment is the whole sequence.
    steps = functools.partial(reversed_in_time, geometry=geometry)
    walk = dataclasses.replace(
        forward, name=f"{recurrence.op}_backward_checkpoints", inputs=tuple(x for x in forward.inputs if x.name != "q"),
    )
    inverses = (chunk_inverses(geometry, dtype),) if recurrence.delta_rule else ()
    if every_chunk:
        walked = (state_checkpoints(geometry), *inverses)
        walk, read = dataclasses.replace(walk, outputs=walked), [steps(x) for x in walked]
        if {x.name for x in walked} <= handed_on:
            walked = ()
    elif geometry.time_steps > 1:
        walked = (segment_ends(geometry),)
        walk = dataclasses.replace(walk, outputs=walked, grid=blocks.grid(segments_but_the_last(geometry)))
        read = [steps(entering_segment(geometry))]
    else:  # one segment, its states walked in the gradients kernel: the forward's inverses read, if it handed them on
        walked, read = (), [steps(x) for x in inverses if x.name in handed_on]
    # The forward's inputs (but the initial state where the checkpoints hold it); dt_bias's block ignores the time step.
    inputs = [steps(x) for x in forward.inputs if x.name != "initial_state" or not (every_chunk or packed)]
    inputs += [steps(blocks.value_rows("do", geometry, dtype)), *read]
    # Per query/key head: grouped value heads sum dq and dk over their group in the kernel (_over_the_group).
    outputs = [
        steps(blocks.key_rows("dq", geometry, dtype)),
        steps(blocks.key_rows("dk", geometry, dtype)),
        steps(blocks.value_rows("dv", geometry, dtype)),
        steps(blocks.key_rows("dg", geometry, gate_dtype or _F32, per_value_head=True) if recurrence.gate_per_key
              else blocks.token_rows("dg", geometry)),
    ]
    if recurrence.delta_rule:
        outputs.append(steps(blocks.token_rows("dbeta", geometry)))
    scratch = [state_gradient(geometry)]
    if num_seqs is None:
        if output_final_state:
            inputs.append(blocks.state("dht", geometry, _F32))
        if initial_state_dtype is not None:
            outputs.append(blocks.state("dinitial_state", geometry, initial_state_dtype))
    else:
        state_block = (geometry.padded_key_dim, geometry.value_block)
        # initial_state: read by the recomputed forward and by its VJP; dht: by the leaving and the entering VJPs.
        if initial_state_dtype is not None:
            inputs.append(sequence_states("initial_state", geometry, num_seqs, initial_state_dtype, moves=2))
            outputs.append(sequence_states("dinitial_state", geometry, num_seqs, initial_state_dtype))
            scratch += [*state_buffers("initial_state", state_block, initial_state_dtype),
                        *state_buffers("dinitial_state", state_block, initial_state_dtype)]
        if output_final_state:
            inputs.append(sequence_states("dht", geometry, num_seqs, _F32, moves=2))
            scratch += state_buffers("dht", state_block, _F32)
    if with_A_log:
        outputs.append(_per_head_sums("dA_log", geometry, 1))
    if dt_bias_dtype is not None:
        outputs.append(_per_head_sums("ddt_bias", geometry, geometry.padded_key_dim))
    bound = activations.decay_lower_bound
    chunk = recurrence.chunk_work(geometry, use_qk_l2norm, bound, packed) + fused.activation_work(activations, geometry)
    work = chunk * (VJP_WORK_FACTOR * grid.chunks_of_the_grid(geometry))
    kept = recurrence.kept_vmem(geometry, bound)
    body = VJP_VMEM_FACTOR * (recurrence.chunk_body_vmem(geometry, bound) + (geometry.chunks_per_step - 1) * kept)
    if not every_chunk:  # the states entering its chunks, walked from the segment's
        body += 4 * geometry.chunks_per_step * geometry.padded_key_dim * geometry.value_block
    if packed:  # each sequence's terms recomputed and differentiated; the loops carry three (C, K) sums
        states = sequence_work(geometry, initial_state_dtype is not None, output_final_state)
        work = work + states * ((1 + VJP_WORK_FACTOR) * geometry.heads * geometry.value_tiles * num_seqs)
        body += 4 * 3 * geometry.chunk_size * geometry.padded_key_dim
    name = f"{recurrence.op}_{'fused' if num_seqs is None else 'varlen'}_backward"
    gradients = grid.grid_plan(name, geometry, forward.scalars, inputs, outputs, work, body, scratch=scratch)
    gradients = gradients if geometry.groups == 1 else _over_the_group(gradients, geometry)
    return (walk, gradients) if walked else (gradients,)


GROUP_WIDE = ("dinitial_state", "dA_log", "ddt_bias")
"""The gradients kernel's outputs of one value head that stay in VMEM along the time axis (``dinitial_state``, written at
the last step; ``dA_log`` and ``ddt_bias``, summed over every step): over a group, each block holds the whole group's
value heads, so that its index does not change while the kernel walks them (an output block left and visited again
would be written back unfinished). ``dht``, an input read at the first step, keeps one value head's block, read again
as the group's heads alternate (``K V`` floats a step), rather than ``2 (G - 1) K V`` floats more of VMEM."""


def _over_the_group(plan: LaunchPlan, geometry: Geometry) -> LaunchPlan:
    """The gradients plan of grouped value heads: the grid's head axis over query/key heads, and a fifth axis, innermost
    and sequential, over the value heads of the group (value head ``h * groups + group``), so that each time step
    walks the group before the next. ``q`` and ``k`` are then read once per step for the group, and ``dq`` and ``dk``
    (one block per query/key head and step, which the group's value heads share) are summed over the group in VMEM
    and written once in the caller's dtype; each value head carries its own ``dS``."""
    G = geometry.groups

    def over(operand):
        if not isinstance(operand, Blocked):
            return operand
        if operand.name in GROUP_WIDE:
            def group_block(b, h, tile, t, group, *scalars):
                return operand.index_map(b, h, tile, t, *scalars)

            block = (operand.block_shape[0], G, *operand.block_shape[2:])
            return dataclasses.replace(operand, block_shape=block, index_map=group_block)

        def value_head(b, h, tile, t, group, *scalars):
            return operand.index_map(b, h * G + group, tile, t, *scalars)

        return dataclasses.replace(operand, index_map=value_head)

    def scratch(buffer):
        return dataclasses.replace(buffer, shape=(G, *buffer.shape)) if buffer.name == "dstate" else buffer

    # float32 dq and dk are summed in their own output blocks; narrower ones in float32 scratch, written once.
    narrow = next(x for x in plan.outputs if x.name == "dq").dtype != _F32
    sums = [Scratch(f"{name}_sum", (geometry.rows_per_step, geometry.padded_key_dim), _F32) for name in ("dq", "dk") if narrow]
    batch, _, value_blocks, time_steps = plan.grid
    return dataclasses.replace(
        plan, grid=(batch, geometry.key_heads, value_blocks, time_steps, G),
        dimension_semantics=(*plan.dimension_semantics, "arbitrary"),
        inputs=tuple(map(over, plan.inputs)), outputs=tuple(map(over, plan.outputs)),
        scratch=(*map(scratch, plan.scratch), *sums),
    )


def _step_gradients(chunks: list[Chunk], refs: dict, head, A_log, dt_bias, dstate, packed: list[PackedChunk] | None, *,
                    scale: float, use_qk_l2norm: bool, activations: Activations, recurrence: Recurrence, wy: bool,
                    entering_state: jax.Array | None):
    """A grid step's gradients, ``(dq, dk, dv, dg, dbeta, dA_log, ddt_bias)`` of each chunk (``dbeta`` None without the
    delta rule), and ``dS`` entering the first: the VJPs of the forward's pieces in reverse, ``dS`` leaving the last
    chunk (``dstate``) and ``do`` given. ``packed``: each chunk's sequences, or None; ``wy``: the WY form (``_from_factors``);
    ``entering_state``: the state entering the step, from which its chunks' are walked, or None: the walk's checkpoints.

    In three passes, as the forward (``chunk_steps``) computes: every chunk's inputs (the activations and
    ``prepared_queries_keys``) and factors, recomputed with their VJPs; then the chain of ``through_state``'s VJPs from
    the last chunk to the first, which carries ``dS`` (a packed chunk's sequences add the VJPs of their final states,
    to the writes from ``dht``, and of their initial states' terms, ``dinitial_state``, through the gate as those terms
    take it: ``Recurrence.per_key_log_decays``); then every chunk's factors' and inputs' VJPs, which depend on no other
    chunk's. Apart from the chain, the factors' products (the inverse's levels) fill its waits."""
    read = [read_chunk(refs, chunk, head, recurrence) for chunk in chunks]
    operands = mxu_operand_dtype(read[0][0].dtype)
    prepared, inputs_vjps = [], []
    for chunk, (q, k, _, g, beta) in zip(chunks, read):
        def chunk_inputs(q, k, g, beta, A_log, dt_bias, chunk=chunk):
            g, beta = activated_gate_and_strength(chunk, g, beta, A_log, dt_bias, activations)
            q, k = prepared_queries_keys(q, k, scale=scale, use_qk_l2norm=use_qk_l2norm)
            return q, k, g, beta

        inputs, inputs_vjp = jax.vjp(chunk_inputs, q, k, g, beta, A_log, dt_bias)
        prepared.append(inputs)
        inputs_vjps.append(inputs_vjp)
    resets = [None] * len(chunks) if packed is None else [sequences.resets for sequences in packed]

    # The walk's inverses (float32 again: their cotangents stay float32), which the factors' VJP takes as they are.
    inverses = [refs["inverses"][chunk.index].astype(_F32) for chunk in chunks] if "inverses" in refs else None

    # The narrow sub-chunks, whatever the forward's (chunkwise.wide_sub_chunks): over 32 tokens the VJP of e's runs
    # cancels more of what bf16 rounds, ddt_bias's error up by half, over its tolerance on one input in twelve (README
    # "Wider sub-chunks in bf16").
    fine_size = fine_block_size(chunks[0].rows.size, activations.decay_lower_bound)

    def from_factors(fine_size):
        return _from_factors(chunks, refs, read, prepared, inputs_vjps, resets, inverses, dstate, packed, operands=operands,
                             fine_size=fine_size, recurrence=recurrence, wy=wy, entering_state=entering_state)

    # The choice around the whole step, each arm with its own VJPs: chosen around the factors alone, the backward would
    # take it again and linearise the chosen arm afresh, its factors computed twice (tops_core.tpu.fast_paths).
    return recurrence.arms([g for _, _, g, _ in prepared], from_factors, fine_size, recurrence.fast_gradients, resets)


def _from_factors(chunks, refs, read, prepared, inputs_vjps, resets, inverses, dstate, packed, *, operands,
                  fine_size: int | None, recurrence: Recurrence, wy: bool, entering_state: jax.Array | None):
    """``_step_gradients`` from the chunks' prepared inputs on: the factors at ``fine_size`` and their VJP, the states
    entering the chunks (the walk's checkpoints, or walked from ``entering_state``), the chain of ``through_state``'s
    VJPs, then the factors' and inputs' VJPs. ``wy``: the factors hold the WY form's ``W`` and ``u``
    (``kda.chunkwise.with_wy``, differentiated with them, ``v`` among their inputs), so each link of the chain's VJP is
    two dependent products (``W^T ddelta`` after ``(k exp(b_C - b)) dS``) where the solve's takes three."""

    # What a chunk's link takes that does not depend on the state, computed with the factors (and differentiated with
    # them, v among their inputs) rather than inside each link's VJP, whose primal computed it again: the WY form's W
    # and u, gla's writes and Aqk v (Recurrence.ahead; gla's fast path on v6e 326487 -> 275655 cycles, with the states
    # walked in the step). The delta rule's solve has nothing ahead of the state.
    if wy:
        def ahead(q, k, v, beta, own):
            return with_wy(k, v, beta, own, operands)
    elif not recurrence.delta_rule:
        def ahead(q, k, v, beta, own):
            return recurrence.ahead(q, k, v, beta, own, operands)
    else:
        ahead = None

    def factors(prepared, values=None):
        chunk_rows = [(q, k, g, beta, chunk_resets) for (q, k, g, beta), chunk_resets in zip(prepared, resets)]
        every = recurrence.factors(chunk_rows, operands=operands, fine_size=fine_size, inverses=inverses)
        if values is None:
            return every
        return [ahead(q, k, v, beta, own) for (q, k, _, beta), v, own in zip(prepared, values, every)]

    values = None if ahead is None else [v.astype(_F32) for _, _, v, _, _ in read]
    every_factors, factors_vjp = jax.vjp(factors, *((prepared,) if values is None else (prepared, values)))

    def through_state(q, k, v, beta, state, entering, factors, known=None):
        if known is None:
            return recurrence.through_state(q, k, v, beta, state, entering, factors, operands)
        return recurrence.through_state(q, k, v, beta, state, entering, factors, operands, known=known)

    # Without the delta rule a link of the chain is elementwise (dS entering a chunk is its decay times dS leaving it,
    # plus do's part), so each chunk's VJP splits in two: from do, which no other chunk's depends on, for every chunk
    # first; then from dS, the chain. As one VJP per chunk, each link waited for the products of do's part, the MXU
    # taking its products in the order they are written (gla's fast path on v6e: 310345 -> 264921 cycles). The delta
    # rule's links are products themselves, and split, each part recomputes the chunk's writes (kda's 1215853 ->
    # 1319697): they stay whole.
    split = not recurrence.delta_rule
    # A packed chunk's sequence gates and initial states' terms, once (they move the initial states by DMA): the states'
    # walk and the VJPs take them.
    sequence_terms = []
    for n, (q, k, g, _) in enumerate(prepared):
        if packed is None:
            sequence_terms.append((None, None, None))
            continue
        sequence_gates, sequence_gates_vjp = jax.vjp(lambda g: recurrence.per_key_log_decays(g, k.shape[1]), g)
        sequence_terms.append((packed[n].entering(q, k, sequence_gates, operands), sequence_gates, sequence_gates_vjp))
    # Walked here, the delta rule's links keep their products with the state for their VJPs (Recurrence.walked_link).
    known = [None] * len(chunks)
    if entering_state is None:
        carried_states = [refs["checkpoints"][chunk.index] for chunk in chunks]
    else:
        carried_states = []
        for n, ((_, k, _, beta), (_, _, v, _, _), factors, (entering, *_)) in enumerate(
            zip(prepared, read, every_factors, sequence_terms)
        ):
            carried_states.append(entering_state)
            if recurrence.walked_link is None:
                entering_state = through_state(None, k, v, beta, entering_state, entering, factors)[1]
            else:
                entering_state, known[n] = recurrence.walked_link(k, v, beta, entering_state, entering, factors, operands)
    arguments, by_outputs = [], []
    for n, (chunk, (q, k, g, beta), (_, _, v, _, _), factors) in enumerate(zip(chunks, prepared, read, every_factors)):
        entering, sequence_gates, sequence_gates_vjp = sequence_terms[n]
        arguments.append(((q, k, v, beta, carried_states[n], entering, factors), sequence_gates, sequence_gates_vjp))
        if split:
            _, outputs_vjp = jax.vjp(lambda *a: through_state(*a)[0], *arguments[n][0])
            by_outputs.append(outputs_vjp(chunk.read(refs["do"]).astype(_F32)))
    cotangents = [None] * len(chunks)
    for n in reversed(range(len(chunks))):
        chunk, g, sequences = chunks[n], prepared[n][2], None if packed is None else packed[n]
        (q, k, v, beta, carried, entering, factors), sequence_gates, sequence_gates_vjp = arguments[n]
        if split:
            (_, writes), state_vjp = jax.vjp(lambda *a: through_state(*a)[1:], *arguments[n][0])
        else:
            (_, _, writes), state_vjp = jax.vjp(functools.partial(through_state, known=known[n]), *arguments[n][0])
        leaving = None if sequences is None else sequences.leave_gradients(k, sequence_gates, writes, carried, operands)
        dwrites = jnp.zeros(writes.shape, _F32) if leaving is None else leaving[2]
        if split:
            every_cotangent = jax.tree.map(operator.add, state_vjp((dstate, dwrites)), by_outputs[n])
        else:
            every_cotangent = state_vjp((chunk.read(refs["do"]).astype(_F32), dstate, dwrites))
        dq, dk, dv, dbeta, dcarried, dentering, dfactors = every_cotangent
        dg = jnp.zeros(g.shape, _F32)
        if sequences is not None:
            dsequence_gates = jnp.zeros(sequence_gates.shape, _F32)
            if leaving is not None:
                dk, dsequence_gates, dcarried = dk + leaving[0], dsequence_gates + leaving[1], dcarried + leaving[3]
            if entering is not None:
                dq_entering, dk_entering, dg_entering = sequences.entering_gradients(q, k, sequence_gates, dentering, operands)
                dq, dk, dsequence_gates = dq + dq_entering, dk + dk_entering, dsequence_gates + dg_entering
            (dg,) = sequence_gates_vjp(dsequence_gates)
        cotangents[n] = (dq, dk, dv, dg, dbeta, dfactors)
        dstate = dcarried
    dprepared, *dvalues = factors_vjp([dfactors for *_, dfactors in cotangents])
    gradients = []
    for n, ((dq, dk, dv, dg, dbeta, _), (dq_factors, dk_factors, dg_factors, dbeta_factors), inputs_vjp) in enumerate(zip(
        cotangents, dprepared, inputs_vjps,
    )):
        if values is not None:  # v reaches the factors too
            dv = dv + dvalues[0][n]
        dbeta = None if dbeta is None else dbeta + dbeta_factors
        dq, dk, dg, dbeta, dA_log, ddt_bias = inputs_vjp((dq + dq_factors, dk + dk_factors, dg + dg_factors, dbeta))
        gradients.append((dq, dk, dv, dg, dbeta, dA_log, ddt_bias))
    return gradients, dstate


def _kernel(*refs, plan: LaunchPlan, geometry: Geometry, scale: float, use_qk_l2norm: bool, activations: Activations,
            recurrence: Recurrence, wy: bool):
    refs = plan.bind(refs)
    G = geometry.groups
    group = pl.program_id(4) if G > 1 else 0  # the value head of the query/key head's group (_over_the_group)
    head = pl.program_id(1) * G + group if G > 1 else pl.program_id(1)
    block, step = pl.program_id(2), pl.program_id(3)
    if G > 1:  # this value head's dS and its slice of the blocks that hold the whole group
        wide = [x.name for x in plan.outputs if isinstance(x, Blocked) and x.name in GROUP_WIDE]  # packed, dinitial_state moves by DMA
        refs = {**refs, **{name: refs[name].at[group] for name in ("dstate", *wide)}}
    packed = "cu_seqlens" in refs
    # Packed, dS starts at zeros (what the carried state reaches past T): each sequence's dht enters where it ends.
    start_state_gradient(refs, step, from_final_state=not packed)
    state_block = (geometry.padded_key_dim, geometry.value_block)
    states = SequenceStates(refs, head, block, geometry.value_block, state_block) if packed else None
    # A group's value heads take turns at every time step (the innermost grid axis): their copies settle at each.
    first, last = (True, True) if G > 1 else (step == 0, step == geometry.time_steps - 1)
    if packed:
        states.begin(first)
    sums = [name for name in ("dA_log", "ddt_bias") if name in refs]

    @pl.when(step == 0)
    def _start_sums():
        for name in sums:
            refs[name][...] = jnp.zeros(refs[name].shape, _F32)

    A_log = jnp.full((1, 1), refs["A_log"][head], _F32) if "A_log" in refs else None
    dt_bias = refs["dt_bias"][...] if "dt_bias" in refs else None
    dstate = refs["dstate"][...]
    forward_step = geometry.time_steps - 1 - step
    chunks = step_chunks(geometry, forward_step)
    packed_chunks = None
    if packed:
        first = forward_step * geometry.chunks_per_step
        along_lanes = recurrence.gates_along_lanes(geometry.chunk_size)
        packed_chunks = [PackedChunk.of(refs, first + chunk.index, geometry, states, along_lanes) for chunk in chunks]
    # Without the walk's checkpoints of every chunk, the step walks its chunks' states from the one entering it.
    entering_state = None if "checkpoints" in refs else segment_entering_state(refs, forward_step, state_block, not packed)
    every_gradients, dstate = _step_gradients(
        chunks, refs, head, A_log, dt_bias, dstate, packed_chunks, scale=scale, use_qk_l2norm=use_qk_l2norm,
        activations=activations, recurrence=recurrence, wy=wy, entering_state=entering_state,
    )
    for chunk, (dq, dk, dv, dg, dbeta, dA_log, ddt_bias) in zip(chunks, every_gradients):
        for name, value in (("dq", dq), ("dk", dk), ("dv", dv), ("dg", dg), ("dbeta", dbeta)):
            if value is None:
                continue
            if G > 1 and name in ("dq", "dk"):  # summed over the group; unset memory is selected away at its first head
                sums = refs.get(f"{name}_sum", refs[name])
                sums[chunk.rows, :] = value.astype(_F32) + jnp.where(group == 0, 0.0, sums[chunk.rows, :])
            elif value.shape[1] == 1:  # one per token (beta, a gate per head): a row per chunk
                refs[name][chunk.index : chunk.index + 1, :] = column_to_row(value)
            elif value.shape[0] == 1:  # a gate per head read along lanes (Recurrence.gates_along_lanes): a row already
                refs[name][chunk.index : chunk.index + 1, :] = value
            else:
                refs[name][chunk.rows, :] = value.astype(refs[name].dtype)
        for name, value in (("dA_log", dA_log), ("ddt_bias", ddt_bias)):
            if name in refs:
                refs[name][...] += value.astype(_F32)
    if "dq_sum" in refs:
        @pl.when(group == G - 1)
        def _write_group_sums():
            for name in ("dq", "dk"):
                refs[name][...] = refs[f"{name}_sum"][...].astype(refs[name].dtype)

    refs["dstate"][...] = dstate
    if packed:  # each sequence's dinitial_state is written where it starts
        states.finish(last)
    else:
        finish_state_gradient(refs, step, geometry)


def backward(
    q, k, v, g, beta, do, *, scale, initial_state, dht, cu_seqlens, use_qk_l2norm,
    use_gate=False, A_log=None, dt_bias=None, lower_bound=None, use_beta_sigmoid=False, allow_neg_eigval=False,
    config: KdaFusedConfig, residuals=None,
) -> KDAGrads:
    """The ``Backward`` protocol of ``tops_core.ops.kda``: unpacked (fused's), or packed (``cu_seqlens`` given, ``B == 1``: varlen's)."""
    activations = Activations.of(use_gate, lower_bound, use_beta_sigmoid, allow_neg_eigval, keep_promise=True)
    return KDAGrads(**gradients(
        q, k, v, g, beta, do, scale=scale, initial_state=initial_state, dht=dht, cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm, activations=activations, A_log=A_log, dt_bias=dt_bias, config=config, recurrence=KDA,
        residuals=residuals,
    ))


def gradients(
    q, k, v, g, beta, do, *, scale, initial_state, dht, cu_seqlens, use_qk_l2norm, config, recurrence: Recurrence,
    activations: Activations = Activations(), A_log=None, dt_bias=None, residuals=None,
) -> dict[str, jax.Array | None]:
    """Every gradient of a call of ``recurrence``'s op by name, in the caller's shapes and dtypes: ``dq``, ``dk``, ``dv``,
    ``dg``, ``dbeta`` (with the delta rule), ``dinitial_state``, ``dA_log`` and ``ddt_bias`` (None where there is no
    such input); unpacked, or packed (``cu_seqlens`` given, ``B == 1``). ``residuals``: what the forward handed on
    (``handed_on``), read where it fits this backward's chunks, else recomputed."""
    B, T, H, K = q.shape
    value_heads, V = v.shape[2:]
    num_seqs = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
    unfitted = geometry_of(B, T, value_heads, K, V, config, value_heads // H, backward=True)
    residuals = _fitting(residuals or {}, unfitted)
    geometry, (*walk, gradients_plan), run = launch.prepare(
        plans, unfitted, q.dtype, config.interpret, handed_on=frozenset(residuals),
        gate_dtype=g.dtype, beta_dtype=None if beta is None else beta.dtype,
        initial_state_dtype=None if initial_state is None else initial_state.dtype, output_final_state=dht is not None,
        use_qk_l2norm=use_qk_l2norm, activations=activations, with_A_log=A_log is not None,
        dt_bias_dtype=None if dt_bias is None else dt_bias.dtype, num_seqs=num_seqs, recurrence=recurrence,
    )
    arrays = {
        **kernel_operands(q, k, v, None, None, initial_state, geometry),
        **fused.gate_operands(g, beta, A_log, dt_bias, geometry, recurrence),
    }
    arrays["do"] = heads_flattened(do, geometry.padded_value_dim)
    if dht is not None:
        arrays["dht"] = padded_state(dht.astype(_F32), geometry)
    if cu_seqlens is not None:
        arrays.update(fused.packed_operands(cu_seqlens, T, geometry.chunk_size))
    static = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, activations=activations, recurrence=recurrence)
    read = {x.name for x in gradients_plan.inputs}
    arrays.update({name: by_step(x, geometry) for name, x in residuals.items() if name in read})
    checkpoints = run(walk[0], fused.kernel, arrays, **static) if walk else {}
    wy = recurrence.delta_rule and fused.wy_gradients_of(config, launch.Target.lowered_for().chip)
    results = run(gradients_plan, _kernel, {**arrays, **checkpoints}, **static, wy=wy)
    grads = _caller_gradients(results, q, g, beta, initial_state, A_log, dt_bias, geometry)
    if cu_seqlens is not None and initial_state is not None:
        grads["dinitial_state"] = with_empty_sequences(grads["dinitial_state"], cu_seqlens, dht)
    return grads


def _fitting(residuals: dict[str, jax.Array], geometry: Geometry) -> dict[str, jax.Array]:
    """The forward's residuals (``grid.by_chunk``) that fit a backward at ``geometry``: its chunks, of its size."""
    g = geometry
    shapes = {
        "checkpoints": (g.batch, g.heads, g.num_chunks, g.padded_key_dim, g.padded_value_dim),
        "inverses": (g.batch, g.heads, g.num_chunks, g.chunk_size, g.chunk_size),
    }
    return {name: x for name, x in residuals.items() if tuple(x.shape) == shapes.get(name)}


def _caller_gradients(results, q, g, beta, initial_state, A_log, dt_bias, geometry: Geometry) -> dict[str, jax.Array | None]:
    """The kernels' outputs in the caller's shapes and dtypes (dq and dk already summed over each group of value heads)."""
    B, T, HV, K = geometry.batch, geometry.seq_len, geometry.heads, geometry.key_dim
    keys = dataclasses.replace(geometry, value_dim=K)  # dg per key: the layout of o, K wide
    query_keys = dataclasses.replace(keys, heads=geometry.key_heads, groups=1)  # dq, dk: one per query/key head

    def query_key(name):
        return caller_output(results[name], query_keys).astype(q.dtype)

    def per_token(name, like):  # token rows [B, HV, steps, chunks, C] -> [B, T, HV]
        return jnp.swapaxes(results[name].reshape(B, HV, -1)[:, :, :T], 1, 2).astype(like.dtype)

    grads = dict(
        dq=query_key("dq"), dk=query_key("dk"), dv=caller_output(results["dv"], geometry),
        dg=caller_output(results["dg"], keys) if g.ndim == 4 else per_token("dg", g),
        dbeta=None if beta is None else per_token("dbeta", beta), dinitial_state=None, dA_log=None, ddt_bias=None,
    )
    if initial_state is not None:
        grads["dinitial_state"] = caller_state(results["dinitial_state"], geometry).astype(initial_state.dtype)
    if A_log is not None:
        grads["dA_log"] = results["dA_log"].sum(axis=0).reshape(HV).astype(A_log.dtype)
    if dt_bias is not None:
        grads["ddt_bias"] = results["ddt_bias"].sum(axis=0)[:, 0, :K].reshape(dt_bias.shape).astype(dt_bias.dtype)
    return grads
