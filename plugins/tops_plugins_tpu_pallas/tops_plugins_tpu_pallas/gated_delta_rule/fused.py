"""``tpu_pallas.fused`` for gated_delta_rule: the whole forward in one ``pallas_call`` on the fused grid (``grid.run``,
as kda's ``kda/fused.py``): grid ``(batch, value head, value block, time step)``, the float32 state in VMEM along the
sequential time axis, each step's chunks unrolled through ``kda.chunkwise.chunk_steps`` with this op's own pair
products (``gated_delta_rule.chunkwise``).

Value head ``j`` reads query/key head ``j // G`` in place (grouped value heads); ``g`` and ``beta`` ``[B, T, HV]`` are
read as they are, every head's column of a step's rows (``blocks.per_head``), the kernel taking its own. A state pool
is served on gathered rows (the core's), packed calls by ``xla.chunk``; the backward is ``xla.chunk``'s.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from tops_plugins_tpu_pallas import blocks, grid
from tops_plugins_tpu_pallas.gated_delta_rule.chunkwise import chunk_factors, chunk_work, step_body_vmem
from tops_plugins_tpu_pallas.grid import chunks_of_the_grid, finish_sequence, geometry_of, start_sequence, step_chunks
from tops_plugins_tpu_pallas.kda.chunkwise import chunk_steps
from tops_plugins_tpu_pallas.layout import Geometry
from tops_plugins_tpu_pallas.plan import LaunchPlan

__all__ = ["forward", "geometry_of", "plans"]


def plans(
    geometry: Geometry, dtype, *, gate_dtype=None, beta_dtype=None, initial_state_dtype=None, output_final_state: bool = False,
    use_qk_l2norm: bool = False,
) -> tuple[LaunchPlan]:
    """The (single) launch plan of one call; a dtype of None for ``g`` or ``beta`` (a ``CallSpec``, which carries neither)
    plans it as float32, the larger."""
    inputs = [
        blocks.key_rows("q", geometry, dtype), blocks.key_rows("k", geometry, dtype), blocks.value_rows("v", geometry, dtype),
        blocks.per_head("g", geometry, gate_dtype or jnp.float32), blocks.per_head("beta", geometry, beta_dtype or jnp.float32),
    ]
    if initial_state_dtype is not None:
        inputs.append(blocks.state("initial_state", geometry, initial_state_dtype))
    outputs = [blocks.value_rows("o", geometry, dtype)]
    if output_final_state:
        outputs.append(blocks.state("final_state", geometry, jnp.float32))
    work = chunk_work(geometry, use_qk_l2norm) * chunks_of_the_grid(geometry)
    return (grid.grid_plan("gated_delta_rule_fused", geometry, (), inputs, outputs, work, step_body_vmem(geometry)),)


def kernel(*refs, plan: LaunchPlan, geometry: Geometry, scale: float, use_qk_l2norm: bool):
    refs = plan.bind(refs)
    head, step = pl.program_id(1), pl.program_id(3)
    start_sequence(refs, step)
    chunks, inputs = step_chunks(geometry, step), []
    for chunk in chunks:
        q, k, v = (chunk.read(refs[name]) for name in ("q", "k", "v"))
        inputs.append((q, k, v, chunk.head_column(refs["g"], head), chunk.head_column(refs["beta"], head), None))
    outputs, _, state = chunk_steps(inputs, refs["state"][...], scale=scale, use_qk_l2norm=use_qk_l2norm, factors=chunk_factors)
    for chunk, o in zip(chunks, outputs):
        refs["o"][chunk.rows, :] = o.astype(refs["o"].dtype)
    refs["state"][...] = state
    finish_sequence(refs, step, geometry)


def forward(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, config):
    """The ``Forward`` protocol of ``tops_core.ops.gated_delta_rule`` (``cu_seqlens`` is rejected by the capabilities)."""
    del cu_seqlens
    return grid.run(
        functools.partial(kernel, use_qk_l2norm=use_qk_l2norm),
        functools.partial(plans, beta_dtype=beta.dtype, use_qk_l2norm=use_qk_l2norm),
        q, k, v, g=g, g_gamma=None, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        config=config, operands={"beta": beta},
    )
