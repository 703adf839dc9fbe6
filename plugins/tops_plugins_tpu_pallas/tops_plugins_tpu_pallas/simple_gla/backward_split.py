"""The backward of ``tpu_pallas.chunk``: a reverse sequential pass for ``dS``, then everything else parallel over time.

Three ``pallas_call``s, every one walking ``chunks_per_step`` chunks per grid step:

1. **states**: the forward walk, writing the float32 state entering every chunk to HBM (what
   ``tpu_pallas.chunk``'s first stage computes; the residuals are the original inputs, so the
   backward recomputes it).
2. **state gradients** walks time in reverse (reverse index maps ``t -> steps - 1 - t``, a
   float32 ``dS`` in VMEM set to ``dht`` or zeros at the first reverse step of each (batch, head)).
   It writes ``dS`` leaving every chunk to HBM, and ``dv`` and ``dinitial_state``, which need
   nothing else.
3. **query and key gradients** has every grid axis parallel, time included: ``dq``, ``dk`` and the
   decay gradient of every chunk from its state and ``dS``.

It moves far more bytes than the fused backward (two float32 states per chunk go to HBM and back),
but its heaviest pass spreads over every TensorCore when ``batch * heads`` alone cannot fill them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from tops_plugins_tpu_pallas import blocks, grid, launch
from tops_plugins_tpu_pallas.simple_gla import gradients
from tops_plugins_tpu_pallas.grid import step_chunks
from tops_plugins_tpu_pallas.simple_gla.chunkwise import chunk_gates, constant_gates
from tops_plugins_tpu_pallas.plan import Blocked, LaunchPlan
from tops_plugins_tpu_pallas.layout import Geometry

_F32 = jnp.float32


def _state_gradients(geometry: Geometry) -> Blocked:
    """``dS`` leaving every chunk, float32, laid out as the states entering every chunk."""
    return dataclasses.replace(grid.state_checkpoints(geometry), name="dstates")


def geometry_of(B: int, T: int, H: int, K: int, V: int, config) -> Geometry:
    """The backward's geometry for a ``ChunkConfig``: its chunk size and ``num_steps``, all of ``V`` per block."""
    return grid.backward_geometry(Geometry(B, T, H, K, V, config.chunk_size, config.num_steps))


def plans(geometry: Geometry, dtype, *, gate_dtype=None, initial_state_dtype=None, output_final_state: bool = False, decayed: bool = True) -> tuple[LaunchPlan, LaunchPlan, LaunchPlan]:
    """The states, state gradients and query/key gradients plans; arguments as ``backward_fused.plans``."""
    geometry = grid.backward_geometry(geometry)
    states = gradients.checkpoints_plan(geometry, dtype, gate_dtype=gate_dtype, initial_state_dtype=initial_state_dtype, every_chunk=True)
    reverse = functools.partial(grid.reversed_in_time, geometry=geometry)
    chunk_count = geometry.batch * geometry.heads * geometry.grid_chunks
    gated = gate_dtype is not None

    pass1_inputs = [reverse(x) for x in gradients.token_inputs(geometry, dtype, gate_dtype, ("q", "k", "do"))]
    if output_final_state:
        pass1_inputs.append(blocks.state("dht", geometry, _F32))
    pass1_outputs = [reverse(blocks.value_rows("dv", geometry, dtype)), reverse(_state_gradients(geometry))]
    if initial_state_dtype is not None:
        pass1_outputs.append(blocks.state("dinitial_state", geometry, initial_state_dtype))
    pass1_work = (
        gradients.attention_work(geometry) + gradients.value_gradient_work(geometry) + gradients.state_gradient_work(geometry)
    ) * chunk_count + gradients.gating_work(geometry, gated)
    state_gradients = grid.grid_plan(
        "simple_gla_split_backward_state_gradients", geometry, (blocks.decay(geometry),), pass1_inputs, pass1_outputs,
        pass1_work, gradients.body_vmem(geometry), scratch=(grid.state_gradient(geometry),),
    )

    pass2_inputs = gradients.token_inputs(geometry, dtype, gate_dtype, ("q", "k", "v", "do"))
    pass2_inputs += (grid.state_checkpoints(geometry), _state_gradients(geometry))
    pass2_outputs = [blocks.key_rows("dq", geometry, dtype), blocks.key_rows("dk", geometry, dtype)]
    if decayed:
        pass2_outputs.append(gradients.decay_gradients(geometry))
    pass2_work = (
        gradients.attention_work(geometry) + gradients.query_key_gradients_work(geometry, decayed)
    ) * chunk_count + gradients.gating_work(geometry, gated)
    query_key_gradients = LaunchPlan(
        name="simple_gla_split_backward_query_key_gradients",
        grid=blocks.grid(geometry),
        dimension_semantics=("parallel",) * 4,
        scalars=(blocks.decay(geometry),),
        inputs=pass2_inputs,
        outputs=tuple(pass2_outputs),
        body_vmem=gradients.body_vmem(geometry),
        flops=pass2_work.flops,
        transcendentals=pass2_work.transcendentals,
    )
    return states, state_gradients, query_key_gradients


def _state_gradients_kernel(*refs, plan: LaunchPlan, geometry: Geometry, scale: float):
    refs = plan.bind(refs)
    head, step = pl.program_id(1), pl.program_id(3)
    grid.start_state_gradient(refs, step)

    constant = constant_gates(refs, head, geometry)
    dstate = refs["dstate"][...]
    for chunk in reversed(step_chunks(geometry, geometry.time_steps - 1 - step)):
        gates = chunk_gates(chunk, refs, head, constant)
        q, k, do = (chunk.read(refs[name]) for name in ("q", "k", "do"))
        refs["dstates"][chunk.index] = dstate
        # dS's step first, the chain from chunk to chunk (as in backward_fused: fewer issued cycles).
        dentering = gradients.state_gradient_entering(gates, q, do, dstate, scale)
        attention = gradients.attention(gates.decays, q, k)
        refs["dv"][chunk.rows, :] = gradients.value_gradient(gates, attention, k, do, dstate, scale).astype(refs["dv"].dtype)
        dstate = dentering
    refs["dstate"][...] = dstate

    grid.finish_state_gradient(refs, step, geometry)


def _query_key_gradients_kernel(*refs, plan: LaunchPlan, geometry: Geometry, scale: float, per_token: bool):
    refs = plan.bind(refs)
    head, step = pl.program_id(1), pl.program_id(3)

    constant = constant_gates(refs, head, geometry)
    for chunk in step_chunks(geometry, step):
        gates = chunk_gates(chunk, refs, head, constant)
        q, k, v, do = (chunk.read(refs[name]) for name in ("q", "k", "v", "do"))
        attention = gradients.attention(gates.decays, q, k)
        dq, dk, da = gradients.query_key_gradients(
            gates, attention, q, k, v, do, refs["checkpoints"][chunk.index], refs["dstates"][chunk.index], scale, "da" in refs,
            gradients.summed_tokens(chunk, per_token),
        )
        refs["dq"][chunk.rows, :] = dq.astype(refs["dq"].dtype)
        refs["dk"][chunk.rows, :] = dk.astype(refs["dk"].dtype)
        if da is not None:
            refs["da"][chunk.index : chunk.index + 1, :] = da


def backward(q, k, v, do, *, g, g_gamma, scale, initial_state, dht, cu_seqlens, config):
    """The ``Backward`` protocol of ``tops_core.ops.simple_gla`` (``cu_seqlens`` is rejected by the capabilities)."""
    del cu_seqlens
    B, T, H, K = q.shape
    inputs = gradients.plan_inputs(q, g, g_gamma, initial_state, dht)
    geometry, (states_plan, state_gradients_plan, query_key_plan), run = launch.prepare(
        plans, geometry_of(B, T, H, K, v.shape[-1], config), q.dtype, config.interpret, **inputs,
    )
    arrays = gradients.operands(q, k, v, do, g, g_gamma, initial_state, dht, geometry)
    states = run(states_plan, gradients.checkpoints_kernel, gradients.with_gate_rows(arrays, g, geometry), every_chunk=True)
    pass1 = run(state_gradients_plan, _state_gradients_kernel, arrays, scale=scale)
    per_token = gradients.per_token_decay_gradient(g is not None, launch.Target.lowered_for().chip, split=True)
    pass2 = run(query_key_plan, _query_key_gradients_kernel, {**arrays, **states, "dstates": pass1["dstates"]}, scale=scale, per_token=per_token)
    return gradients.caller_gradients({**pass1, **pass2}, q, k, v, g, g_gamma, initial_state, geometry)
