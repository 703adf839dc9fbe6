"""The backward of ``tpu_pallas.fused``: the state's gradient in VMEM along a reverse sequential time axis.

Two ``pallas_call``s. The reverse walk needs the forward state entering every chunk, and only a
forward walk produces it, so:

1. **checkpoints** walks time forwards and writes the float32 state entering every *segment*
   (one grid step: ``chunks_per_step`` chunks) to HBM.
2. **gradients** walks the segments from the last to the first (reverse index maps,
   ``t -> steps - 1 - t``; nothing is flipped or copied). At each segment it recomputes the states
   of its chunks from the checkpoint into VMEM, from the ``k``, ``v`` and ``g`` blocks it reads
   anyway, then walks its chunks backwards: ``dq``, ``dk``, ``dv`` and the decay gradient of each,
   and the float32 state gradient ``dS`` (a VMEM scratch, set to ``dht`` or zeros at the first
   reverse step of every (batch, head) and written to ``dinitial_state`` after the last).

VMEM is bounded for any ``T``: one segment's blocks, ``chunks_per_step`` states and ``dS``
(``traffic.vmem_bytes`` of the plans; 16 MiB budget); HBM gains one float32 state per segment,
written once and read once.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tops_plugins_tpu_pallas import blocks, gradients, traffic
from tops_plugins_tpu_pallas.chunkwise import advance_state
from tops_plugins_tpu_pallas.launch import LaunchPlan, Scratch
from tops_plugins_tpu_pallas.layout import Geometry

_F32 = jnp.float32


def plans(geometry: Geometry, dtype, *, gate_dtype=None, initial_state_dtype=None, output_final_state: bool = False, decayed: bool = True) -> tuple[LaunchPlan, LaunchPlan]:
    """The checkpoints and gradients plans; ``output_final_state``: a ``dht`` is given; ``decayed``: ``g`` or ``g_gamma`` is (a decay gradient is wanted)."""
    checkpoints = gradients.checkpoints_plan(geometry, dtype, gate_dtype=gate_dtype, initial_state_dtype=initial_state_dtype, every_chunk=False)
    steps = functools.partial(gradients.reversed_in_time, geometry=geometry)
    K, V = geometry.padded_key_dim, geometry.padded_value_dim
    inputs = [steps(x) for x in gradients.token_inputs(geometry, dtype, gate_dtype, ("q", "k", "v", "do"))]
    inputs.append(steps(gradients.state_checkpoints(geometry, every_chunk=False)))
    if output_final_state:
        inputs.append(gradients.state("dht", geometry, _F32))
    outputs = [steps(blocks.key_rows("dq", geometry, dtype)), steps(blocks.key_rows("dk", geometry, dtype)), steps(gradients.value_rows("dv", geometry, dtype))]
    if decayed:
        outputs.append(steps(gradients.decay_gradients(geometry)))
    if initial_state_dtype is not None:
        outputs.append(gradients.state("dinitial_state", geometry, initial_state_dtype))
    per_chunk = (
        gradients.terms_work(geometry, gate_dtype is not None) * 2  # recomputing the states needs the gates too
        + gradients.full_state_advance_work(geometry)
        + gradients.attention_work(geometry)
        + gradients.value_gradient_work(geometry)
        + gradients.query_key_gradients_work(geometry, decayed)
        + gradients.state_gradient_work(geometry)
    )
    work = per_chunk * (geometry.batch * geometry.heads * geometry.num_chunks)
    return checkpoints, LaunchPlan(
        name="simple_gla_fused_backward",
        grid=gradients.grid(geometry),
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        scalars=(blocks.decay(geometry),),
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        scratch=(gradients.state_gradient(geometry), Scratch("states", (geometry.chunks_per_step, K, V), _F32)),
        body_vmem=gradients.body_vmem(geometry),
        flops=work.flops,
        transcendentals=work.transcendentals,
    )


def _kernel(*refs, plan: LaunchPlan, geometry: Geometry, scale: float):
    refs = plan.bind(refs)
    head, step = pl.program_id(1), pl.program_id(3)
    segment = geometry.time_steps - 1 - step
    chunks = geometry.chunks_per_step

    gradients.start_state_gradient(refs, step)

    refs["states"][0] = refs["checkpoints"][0]

    def recompute_state(index, carry):
        chunk = gradients.chunk_at(geometry, segment, index)
        refs["states"][index + 1] = advance_state(refs["states"][index], chunk.read(refs["k"]), chunk.read(refs["v"]), chunk.gates(refs, head))
        return carry

    lax.fori_loop(0, chunks - 1, recompute_state, None)

    def backward_chunk(reverse_index, carry):
        index = chunks - 1 - reverse_index
        chunk = gradients.chunk_at(geometry, segment, index)
        terms = gradients.ChunkTerms.compute(chunk.gates(refs, head))
        q, k, v, do = (chunk.read(refs[name]) for name in ("q", "k", "v", "do"))
        dstate = refs["dstate"][...]
        attention = gradients.attention(terms, q, k)
        refs["dv"][chunk.rows, :] = gradients.value_gradient(terms, attention, k, do, dstate, scale).astype(refs["dv"].dtype)
        dq, dk, da = gradients.query_key_gradients(terms, attention, q, k, v, do, refs["states"][index], dstate, scale, "da" in refs)
        refs["dq"][chunk.rows, :] = dq.astype(refs["dq"].dtype)
        refs["dk"][chunk.rows, :] = dk.astype(refs["dk"].dtype)
        if da is not None:
            refs["da"][pl.ds(index, 1), :] = da
        refs["dstate"][...] = gradients.state_gradient_entering(terms, q, do, dstate, scale)
        return carry

    lax.fori_loop(0, chunks, backward_chunk, None)

    gradients.finish_state_gradient(refs, step, geometry)


def backward(q, k, v, do, *, g, g_gamma, scale, initial_state, dht, cu_seqlens, config):
    """The ``Backward`` protocol of ``tops_core.ops.simple_gla`` (``cu_seqlens`` is rejected by the capabilities)."""
    del cu_seqlens
    B, T, H, K = q.shape
    geometry = Geometry(B, T, H, K, v.shape[-1], config.chunk_size, config.num_steps)
    checkpoints_plan, gradients_plan = plans(
        geometry, q.dtype,
        gate_dtype=None if g is None else g.dtype,
        initial_state_dtype=None if initial_state is None else initial_state.dtype,
        output_final_state=dht is not None,
        decayed=g is not None or g_gamma is not None,
    )
    traffic.check_vmem(checkpoints_plan)
    traffic.check_vmem(gradients_plan)
    arrays = gradients.operands(q, k, v, do, g, g_gamma, initial_state, dht, geometry)
    checkpoints = checkpoints_plan.call(
        functools.partial(gradients.checkpoints_kernel, plan=checkpoints_plan, geometry=geometry, every_chunk=False),
        arrays, config.interpret, traffic.cost_estimate(checkpoints_plan),
    )
    results = gradients_plan.call(
        functools.partial(_kernel, plan=gradients_plan, geometry=geometry, scale=scale),
        {**arrays, **checkpoints}, config.interpret, traffic.cost_estimate(gradients_plan),
    )
    return gradients.caller_gradients(results, q, k, v, g, g_gamma, initial_state, geometry)
