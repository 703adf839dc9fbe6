"""The backward of ``tpu_pallas.fused``: the state's gradient in VMEM along a reverse sequential time axis.

Two ``pallas_call``s. The reverse walk needs the forward state entering every chunk, and only a
forward walk produces it, so:

1. **checkpoints** walks time forwards over every *segment* (one grid step: ``chunks_per_step``
   chunks) but the last, and writes the float32 state leaving each, the one entering the next, to
   HBM. The last segment's ``k``, ``v`` and ``g`` reach no state the backward reads, so the walk
   reads ``(segments - 1) / segments`` of them; where one segment is the whole sequence, there is no
   walk and one ``pallas_call``.
2. **gradients** walks the segments from the last to the first (reverse index maps,
   ``t -> steps - 1 - t``; nothing is flipped or copied). At each segment it recomputes the states
   of its chunks into VMEM from the state entering it (the walk's checkpoint, or the initial state
   or zeros at the first segment), from the ``k``, ``v`` and ``g`` blocks it reads
   anyway, then walks its chunks backwards for the float32 state gradient ``dS`` leaving each (a VMEM
   scratch, set to ``dht`` or zeros at the first reverse step of every (batch, head) and written to
   ``dinitial_state`` after the last), then computes ``dq``, ``dk``, ``dv`` and the decay gradient of
   each chunk, which then depend on no other chunk's.

A segment is ``FusedConfig.backward_num_steps`` chunks, by default ``SEGMENT_TOKENS`` (4096) tokens'
worth, independent of the forward's ``num_steps``, and fewer chunks while the plans would not fit
VMEM. VMEM is bounded for any ``T``: one segment's blocks, ``chunks_per_step`` states and ``dS``
(``traffic.vmem_bytes`` of the plans, within the chip's budget, ``launch.fit``); HBM gains one float32 state per segment
but the last, written once and read once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from tops_plugins_tpu_pallas import blocks, grid, launch
from tops_plugins_tpu_pallas.simple_gla import gradients, varlen
from tops_plugins_tpu_pallas.grid import step_chunks
from tops_plugins_tpu_pallas.simple_gla.chunkwise import (
    advance_state, advance_state_work, constant_gates, step_gates,
)
from tops_plugins_tpu_pallas.simple_gla.fused import gates_along_lanes
from tops_plugins_tpu_pallas.plan import LaunchPlan, Scratch
from tops_plugins_tpu_pallas.layout import Geometry

_F32 = jnp.float32


SEGMENT_TOKENS = 4096
"""Tokens per segment when ``FusedConfig.backward_num_steps`` is None, fewer where VMEM is short (``launch.fit``); the
forward's grid step holds as many rows (32 chunks of 128).

A longer segment wins twice: the walk reads every segment but the last (none at ``T <= SEGMENT_TOKENS``), and each grid
step costs a few hundred cycles of its own. But its chunks are unrolled, so it compiles longer. Cycles one TensorCore
issues, the walk + the gradients kernel (B=2 T=4096 H=8 K=V=128 bf16, 2026-12-06), segments of 2048 -> 4096 tokens:
with ``g`` v6e 16833 + 267232 -> 254657, v5e 20373 + 331047 -> 337047; with ``g_gamma`` v6e 14847 + 198591 -> 183326
(under its MXU time either way), v5e 20142 + 296688 -> 279868, and at T=8192 61872 + 592899 -> 36526 + 568909.
Compiling the gradient (forward and backward, v6e, an idle two-core host): bf16 K=V=128 6.7 -> 11.7 s, float32
K=V=256 26.7 -> 53.5 s. The plans need 22 MiB of VMEM at K = V = 128 bf16 (11.2 at 2048): v5e's and v6e's budgets
hold 96, v5p's 48; on v4 ``launch.fit`` takes fewer chunks. (Until 2026-12-06 2048: then the walk read every segment,
and 4096 had saved less.)"""


CHUNK_SIZE = 128
"""The backward's chunk when ``FusedConfig.chunk_size`` is None, on every chip. Chunk 256, which the
forward takes on v6e, makes the backward slower there too (modelled, B=8 T=4096 H=16 K=V=128 bf16
``g_gamma``, kernels against the backward's floor: v6e 2.43x -> 2.93x, v5e 1.92x -> 2.66x)."""


def chunk_size_of(config) -> int:
    """The backward's chunk for a ``FusedConfig``: its ``chunk_size``, or ``CHUNK_SIZE`` when None."""
    return config.chunk_size or CHUNK_SIZE


def geometry_of(B: int, T: int, H: int, K: int, V: int, config, segment_tokens: int = SEGMENT_TOKENS) -> Geometry:
    """The backward's geometry for a ``FusedConfig``: its chunk size (None: ``CHUNK_SIZE``), ``backward_num_steps``
    chunks per segment (None: ``segment_tokens`` tokens' worth), all of ``V`` per block; before VMEM fitting (``fitted_plans``)."""
    chunk_size = chunk_size_of(config)
    chunks = config.backward_num_steps or max(1, segment_tokens // chunk_size)
    return grid.backward_geometry(Geometry(B, T, H, K, V, chunk_size, chunks))


def fitted_plans(geometry: Geometry, dtype, *, target: launch.Target = launch.UNKNOWN, **inputs) -> tuple[LaunchPlan, LaunchPlan]:
    """``plans`` at the geometry ``backward`` launches (fewer chunks per segment while ``target``'s VMEM is short)."""
    return launch.fit(plans, geometry, dtype, target, **inputs)[1]


def plans(
    geometry: Geometry, dtype, *, gate_dtype=None, initial_state_dtype=None, output_final_state: bool = False, decayed: bool = True,
    cut_at_starts: bool = False,
) -> tuple[LaunchPlan, ...]:
    """The checkpoints and gradients plans, or the gradients plan alone where one segment is the whole sequence (no
    state to recompute but the initial one); ``output_final_state``: a ``dht`` is given; ``decayed``: ``g`` or
    ``g_gamma`` is (a decay gradient is wanted); ``cut_at_starts``: a packed call without ``g`` whose sequences start where
    ``blocks.sequence_cuts`` says, both kernels cutting the constant decay's gates there."""
    geometry = grid.backward_geometry(geometry)
    walked = geometry.time_steps > 1
    steps = functools.partial(grid.reversed_in_time, geometry=geometry)
    K, V = geometry.padded_key_dim, geometry.padded_value_dim
    along_lanes = gates_along_lanes(gate_dtype is not None, geometry.chunk_size)
    inputs = [steps(x) for x in gradients.token_inputs(geometry, dtype, gate_dtype, ("q", "k", "v", "do"), along_lanes)]
    scalars = (blocks.decay(geometry),)
    if cut_at_starts:
        cut_scalars, next_starts = blocks.sequence_cuts(geometry)
        scalars, inputs = scalars + cut_scalars, [*inputs, steps(next_starts)]
    if walked:
        inputs.append(steps(grid.entering_segment(geometry)))
    if initial_state_dtype is not None:
        inputs.append(blocks.state("initial_state", geometry, initial_state_dtype))
    if output_final_state:
        inputs.append(blocks.state("dht", geometry, _F32))
    outputs = [steps(blocks.key_rows("dq", geometry, dtype)), steps(blocks.key_rows("dk", geometry, dtype)), steps(blocks.value_rows("dv", geometry, dtype))]
    if decayed:
        outputs.append(steps(gradients.decay_gradients(geometry)))
    if initial_state_dtype is not None:
        outputs.append(blocks.state("dinitial_state", geometry, initial_state_dtype))
    gated = gate_dtype is not None
    per_chunk = (
        advance_state_work(geometry)
        + gradients.attention_work(geometry)
        + gradients.value_gradient_work(geometry)
        + gradients.query_key_gradients_work(geometry, decayed)
        + gradients.state_gradient_work(geometry)
    )
    work = per_chunk * (geometry.batch * geometry.heads * geometry.grid_chunks) + gradients.gating_work(geometry, gated)
    gradients_plan = grid.grid_plan(
        "simple_gla_fused_backward", geometry, scalars, inputs, outputs, work, segment_vmem(geometry),
        scratch=(grid.state_gradient(geometry), Scratch("states", (geometry.chunks_per_step, K, V), _F32)),
    )
    # Transposed-LHS products fed to the MXU as they are: with g (gates along lanes) the gradients kernel issues 4% fewer
    # cycles (B=2 T=4096 H=8 K=V=128 bf16: v6e 276750 -> 266384, v5e 342992 -> 330448); with g_gamma alone, 3% more.
    gradients_plan = dataclasses.replace(gradients_plan, fuse_transposed_lhs=along_lanes)
    if not walked:
        return (gradients_plan,)
    checkpoints = gradients.checkpoints_plan(
        geometry, dtype, gate_dtype=gate_dtype, initial_state_dtype=initial_state_dtype, every_chunk=False, cut_at_starts=cut_at_starts,
    )
    return checkpoints, gradients_plan


def segment_vmem(geometry: Geometry) -> int:
    """One chunk's values (``gradients.body_vmem``, which holds one ``dS``) and what the segment keeps for each of its
    chunks until that chunk's gradients: its gates (``C x C`` decays and two columns) and the ``dS`` leaving it."""
    C, K, V = geometry.chunk_size, geometry.padded_key_dim, geometry.padded_value_dim
    n = geometry.chunks_per_step
    return gradients.body_vmem(geometry) + 4 * (n * (C * C + 2 * C) + (n - 1) * K * V)


def _kernel(*refs, plan: LaunchPlan, geometry: Geometry, scale: float, form: gradients.ChunkForm):
    refs = plan.bind(refs)
    head, step = pl.program_id(1), pl.program_id(3)
    grid.start_state_gradient(refs, step)

    constant = constant_gates(refs, head, geometry)
    segment = geometry.time_steps - 1 - step
    chunks = step_chunks(geometry, segment)
    # Three passes over the segment's chunks: their states, then the dS chain, then everything else. Neither chain
    # waits on the rest of a chunk's work, and the gradients of different chunks no longer depend on each other:
    # chunk by chunk, the scheduler had run one chunk's products after the other's (v6e with g: 326 -> 202 us). The
    # last pass (gradients.reversed_gradients) may take every chunk's products of its inputs first.
    along_lanes = gates_along_lanes("g" in refs, geometry.chunk_size)
    every_gates = step_gates(chunks, refs, head, constant, along_lanes=along_lanes, key_column=True, step=segment)
    state = grid.segment_entering_state(refs, segment, refs["states"].shape[1:])
    refs["states"][0] = state
    for chunk in chunks[:-1]:
        k = chunk.read(refs["k"])
        state = advance_state(state, k, chunk.read(refs["v"]), every_gates[chunk.index], form.passes.chain)
        refs["states"][chunk.index + 1] = state

    dstate, leaving = refs["dstate"][...], [None] * len(chunks)
    for chunk in reversed(chunks):
        leaving[chunk.index] = dstate
        q, do = chunk.read(refs["q"]), chunk.read(refs["do"])
        dstate = gradients.state_gradient_entering(every_gates[chunk.index], q, do, dstate, scale, form.passes.chain)
    refs["dstate"][...] = dstate
    every_gradients = gradients.reversed_gradients(
        chunks, every_gates, refs, lambda chunk: refs["states"][chunk.index], leaving, scale, "da" in refs, form,
    )
    for chunk, (dq, dk, dv, da) in every_gradients:
        refs["dv"][chunk.rows, :] = dv.astype(refs["dv"].dtype)
        refs["dq"][chunk.rows, :] = dq.astype(refs["dq"].dtype)
        refs["dk"][chunk.rows, :] = dk.astype(refs["dk"].dtype)
        if da is not None:
            refs["da"][chunk.index : chunk.index + 1, :] = da

    grid.finish_state_gradient(refs, step, geometry)


def backward(q, k, v, do, *, g, g_gamma, scale, initial_state, dht, cu_seqlens, config, sequence_starts: jax.Array | None = None):
    """The ``Backward`` protocol of ``tops_core.ops.simple_gla`` (``cu_seqlens`` is rejected by the capabilities).
    ``sequence_starts``: ``[T]`` bool, where a packed call without ``g`` (and without states) starts its sequences: both
    kernels cut the constant decay's gates there (``ChunkGates.cut_at``)."""
    del cu_seqlens
    if sequence_starts is not None and g is not None:
        raise ValueError("sequence_starts cuts g_gamma's gates, for a packed call without g; give g its reset gates instead")
    B, T, H, K = q.shape
    inputs = dict(gradients.plan_inputs(q, g, g_gamma, initial_state, dht), cut_at_starts=sequence_starts is not None)
    geometry, (*walk, gradients_plan), run = launch.prepare(
        plans, geometry_of(B, T, H, K, v.shape[-1], config), q.dtype, config.interpret, **inputs,
    )
    arrays = gradients.with_gate_rows(gradients.operands(q, k, v, do, g, g_gamma, initial_state, dht, geometry), g, geometry)
    if sequence_starts is not None:
        arrays.update(varlen.sequence_cuts(sequence_starts, geometry.chunk_size, geometry.time_steps * geometry.chunks_per_step))
    checkpoints = run(walk[0], gradients.checkpoints_kernel, arrays, every_chunk=False) if walk else {}
    chip = launch.Target.lowered_for().chip
    form = gradients.chunk_form(q.dtype, chip, g is not None, g_gamma is not None)
    results = run(gradients_plan, _kernel, {**arrays, **checkpoints}, scale=scale, form=form)
    return gradients.caller_gradients(results, q, k, v, g, g_gamma, initial_state, geometry)
