"""``tpu_pallas.fused`` for kda: the whole KDA forward in one ``pallas_call``.

the fused grid, layout and launch every forward here shares (``grid.run``): grid ``(batch, head, value block,
time step)``, the first three "parallel", time "arbitrary" (sequential), each step walking
``chunks_per_step`` chunks unrolled (``step_chunks``) with the float32 state carried as a value
between them. The state lives in a VMEM scratch between steps; it is loaded from
``initial_state`` (or zeroed) at the first time step of *every* (batch, head, value block),
because parallel grid points run on either core in any order, and written to ``final_state`` at
the last. Everything else of a chunk (decays, pair products, the exact inverse) is computed inline
from the chunk's rows and never stored.

KDA's own inputs, read in place:

- ``g`` ``[B, T, H, K]`` as ``[B, T, H * K]`` (a reshape), the head's ``K`` columns of a step's
  rows, like ``q`` and ``k`` (and lane-padded with zeros, no decay, when they are).
- ``beta`` ``[B, T, H]`` as is: a full-width block ``(rows, H)`` (the last block dimension equals
  the array's, so no padding in HBM); the kernel takes its head's column.

Forward only: the dispatcher pairs it with another implementation's backward (xla.chunk's).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl

from tops_plugins_tpu_pallas import blocks, grid, launch
from tops_plugins_tpu_pallas.grid import chunks_of_the_grid, finish_sequence, start_sequence, step_chunks
from tops_plugins_tpu_pallas.config import check_common_fields
from tops_plugins_tpu_pallas.kda.chunkwise import chunk_body_vmem, chunk_step, chunk_work
from tops_plugins_tpu_pallas.plan import LaunchPlan
from tops_plugins_tpu_pallas.layout import Geometry, heads_flattened

__all__ = ["KdaFusedConfig", "fitted_plans", "forward", "geometry_of", "plans"]


@dataclasses.dataclass(frozen=True)
class KdaFusedConfig:
    """simple_gla's ``FusedConfig`` fields but its backward's, with a default chunk that suits KDA.

    ``chunk_size`` (64 or 128): 64 by default. A KDA chunk's work grows faster than simple_gla's:
    per token, the run sums and the pair products of its ``log2 C`` halving levels cost
    ``O(C K log C)`` flops, so chunks of 128 do about twice the matmul work of chunks of 64
    (README "kda"), for the same bytes. ``num_steps``: chunks per grid step, at most (fewer when
    VMEM is short, ``launch.fit``). ``full_values``: one grid point per (batch, head)
    holding all of ``V`` (the decays, pairs and inverse computed once, not per 128-lane value
    tile). ``interpret``: as ``FusedConfig``'s.
    """

    chunk_size: int = 64
    num_steps: int = 8
    full_values: bool = True
    interpret: Any = None

    def __post_init__(self):
        check_common_fields(self)
        if not isinstance(self.full_values, bool):
            raise TypeError(f"KdaFusedConfig.full_values must be a bool, got {self.full_values!r}")


def geometry_of(B: int, T: int, H: int, K: int, V: int, config: KdaFusedConfig) -> Geometry:
    return Geometry(B, T, H, K, V, config.chunk_size, config.num_steps, config.full_values)


def plans(
    geometry: Geometry, dtype, *, gate_dtype=None, beta_dtype=None, initial_state_dtype=None,
    output_final_state: bool = False, use_qk_l2norm: bool = False,
) -> tuple[LaunchPlan]:
    """The (single) launch plan of one call; ``initial_state_dtype`` None when there is no initial state.

    ``g`` and ``beta`` are always inputs; a dtype of None (a ``CallSpec``, which carries neither)
    plans them as float32, the larger.
    """
    inputs = [
        blocks.key_rows("q", geometry, dtype), blocks.key_rows("k", geometry, dtype), blocks.value_rows("v", geometry, dtype),
        blocks.key_rows("g", geometry, gate_dtype or jnp.float32), blocks.per_head("beta", geometry, beta_dtype or jnp.float32),
    ]
    if initial_state_dtype is not None:
        inputs.append(blocks.state("initial_state", geometry, initial_state_dtype))
    outputs = [blocks.value_rows("o", geometry, dtype)]
    if output_final_state:
        outputs.append(blocks.state("final_state", geometry, jnp.float32))
    work = chunk_work(geometry, use_qk_l2norm) * chunks_of_the_grid(geometry)
    return (grid.grid_plan("kda_fused", geometry, (), inputs, outputs, work, chunk_body_vmem(geometry)),)


def fitted_plans(geometry: Geometry, dtype, *, target: launch.Target = launch.UNKNOWN, **inputs) -> tuple[LaunchPlan]:
    """``plans`` at the geometry ``forward`` launches (fewer chunks per step while ``target``'s VMEM is short)."""
    return grid.fitted_plans(plans, geometry, dtype, target=target, **inputs)


def _kernel(*refs, plan: LaunchPlan, geometry: Geometry, scale: float, use_qk_l2norm: bool):
    refs = plan.bind(refs)
    head, step = pl.program_id(1), pl.program_id(3)
    start_sequence(refs, step)

    state = refs["state"][...]
    for chunk in step_chunks(geometry, step):
        beta = chunk.head_column(refs["beta"], head)
        q, k, v = chunk.read(refs["q"]), chunk.read(refs["k"]), chunk.read(refs["v"])
        g = chunk.read(refs["g"]).astype(jnp.float32)
        o, state = chunk_step(q, k, v, g, beta, state, scale=scale, use_qk_l2norm=use_qk_l2norm)
        refs["o"][chunk.rows, :] = o.astype(refs["o"].dtype)
    refs["state"][...] = state
    finish_sequence(refs, step, geometry)


def forward(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, config: KdaFusedConfig):
    """The ``Forward`` protocol of ``tops_core.ops.kda`` (``cu_seqlens`` is rejected by the capabilities)."""
    del cu_seqlens
    padded_key_dim = geometry_of(*q.shape, v.shape[-1], config).padded_key_dim
    return grid.run(
        functools.partial(_kernel, use_qk_l2norm=use_qk_l2norm),
        functools.partial(plans, beta_dtype=beta.dtype, use_qk_l2norm=use_qk_l2norm),
        q, k, v, g=g, g_gamma=None, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        config=config, operands={"g": heads_flattened(g, padded_key_dim), "beta": beta},
    )
