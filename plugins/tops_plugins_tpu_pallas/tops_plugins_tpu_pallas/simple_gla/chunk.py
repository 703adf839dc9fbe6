"""``tpu_pallas.chunk``: the simple_gla forward in two ``pallas_call`` stages.

Stage 1 (states) walks time sequentially, like the fused kernel, but only advances the state
and writes the float32 state entering every chunk to HBM (``chunk_states``). Stage 2 (outputs)
then computes every chunk's ``o`` from its entering state with *all* grid axes parallel, time
included. It moves more bytes than the fused kernel (the chunk states go to HBM and back) but its
heavy half can spread over every TensorCore when ``B * H * value tiles`` alone cannot.
Both stages share the grid ``(batch, head, value tile, time step)`` and walk ``num_steps`` chunks
per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl

from tops_plugins_tpu_pallas import blocks, grid, launch
from tops_plugins_tpu_pallas.grid import chunks_of_the_grid, finish_sequence, start_sequence, step_chunks
from tops_plugins_tpu_pallas.simple_gla.chunkwise import (
    advance_state, advance_state_work, chunk_body_vmem, chunk_gates, chunk_output, chunk_output_work, constant_gates,
    gate_computations, gates_work,
)
from tops_plugins_tpu_pallas.config import check_common_fields
from tops_plugins_tpu_pallas.plan import LaunchPlan
from tops_plugins_tpu_pallas.layout import Geometry, caller_output, caller_state, kernel_operands


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """``chunk_size``: tokens per chunk (64 or 128; 128 halves the chunk-state traffic). ``num_steps``:
    chunks per grid step in both stages. ``interpret``: None (compile where lowered for a TPU,
    interpret elsewhere), True (fast interpreter), a ``pltpu.InterpretParams`` (faithful
    interpreter) or False (always compile)."""

    chunk_size: int = 128
    num_steps: int = 4
    interpret: Any = None

    def __post_init__(self):
        check_common_fields(self)


def geometry_of(B: int, T: int, H: int, K: int, V: int, config: ChunkConfig) -> Geometry:
    return Geometry(B, T, H, K, V, config.chunk_size, config.num_steps)


def plans(geometry: Geometry, dtype, *, gate_dtype=None, initial_state_dtype=None, output_final_state: bool = False) -> tuple[LaunchPlan, LaunchPlan]:
    """The launch plans of stage 1 (states) and stage 2 (outputs) for one call."""
    gate = (blocks.gates(geometry, gate_dtype),) if gate_dtype is not None else ()
    start = (blocks.state("initial_state", geometry, initial_state_dtype),) if initial_state_dtype is not None else ()
    end = (blocks.state("final_state", geometry, jnp.float32),) if output_final_state else ()
    k, v = blocks.key_rows("k", geometry, dtype), blocks.value_rows("v", geometry, dtype)
    chunks, gated = chunks_of_the_grid(geometry), gate_dtype is not None
    computations = gate_computations(geometry, gated)
    states_work = advance_state_work(geometry) * chunks + gates_work(geometry, gated, attention=False) * computations
    outputs_work = chunk_output_work(geometry) * chunks + gates_work(geometry, gated) * computations
    states = grid.grid_plan(
        "simple_gla_chunk_states", geometry, (blocks.decay(geometry),), (k, v, *gate, *start), (blocks.chunk_states(geometry), *end),
        states_work, chunk_body_vmem(geometry),
    )
    outputs = LaunchPlan(
        name="simple_gla_chunk_outputs",
        grid=blocks.grid(geometry),
        dimension_semantics=("parallel",) * 4,
        scalars=(blocks.decay(geometry),),
        inputs=(blocks.key_rows("q", geometry, dtype), k, v, *gate, blocks.chunk_states(geometry)),
        outputs=(blocks.value_rows("o", geometry, dtype),),
        body_vmem=chunk_body_vmem(geometry),
        flops=outputs_work.flops,
        transcendentals=outputs_work.transcendentals,
    )
    return states, outputs


def _states_kernel(*refs, plan: LaunchPlan, geometry: Geometry):
    refs = plan.bind(refs)
    head, step = pl.program_id(1), pl.program_id(3)
    start_sequence(refs, step)

    constant = constant_gates(refs, head, geometry, attention=False)
    state = refs["state"][...]
    for chunk in step_chunks(geometry, step):
        refs["chunk_states"][chunk.index] = state
        gates = chunk_gates(chunk, refs, head, constant, attention=False)
        state = advance_state(state, chunk.read(refs["k"]), chunk.read(refs["v"]), gates)
    refs["state"][...] = state
    finish_sequence(refs, step, geometry)


def _outputs_kernel(*refs, plan: LaunchPlan, geometry: Geometry, scale: float):
    refs = plan.bind(refs)
    head, step = pl.program_id(1), pl.program_id(3)

    constant = constant_gates(refs, head, geometry)
    for chunk in step_chunks(geometry, step):
        q, k, v = chunk.read(refs["q"]), chunk.read(refs["k"]), chunk.read(refs["v"])
        gates = chunk_gates(chunk, refs, head, constant)
        refs["o"][chunk.rows, :] = chunk_output(q, k, v, refs["chunk_states"][chunk.index], gates, scale).astype(refs["o"].dtype)


def forward(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, config: ChunkConfig):
    """The ``Forward`` protocol of ``tops_core.ops.simple_gla`` (``cu_seqlens`` is rejected by the capabilities)."""
    del cu_seqlens
    B, T, H, K = q.shape
    geometry, (states_plan, outputs_plan), run = launch.prepare(
        plans, geometry_of(B, T, H, K, v.shape[-1], config), q.dtype, config.interpret,
        gate_dtype=None if g is None else g.dtype,
        initial_state_dtype=None if initial_state is None else initial_state.dtype,
        output_final_state=output_final_state,
    )
    operands = kernel_operands(q, k, v, g, g_gamma, initial_state, geometry)
    stage1 = run(states_plan, _states_kernel, operands)
    stage2 = run(outputs_plan, _outputs_kernel, {**operands, "chunk_states": stage1["chunk_states"]}, scale=scale)
    final_state = caller_state(stage1["final_state"], geometry) if output_final_state else None
    return caller_output(stage2["o"], geometry), final_state
