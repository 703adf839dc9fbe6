"""Launching plans: fit them to the VMEM of the chip the program is lowered for, and run each as a ``pallas_call``.

The VMEM budget is the chip's (``tops_core.tpu.generations.vmem_budget``) when the call knows
which TPU generation it is lowered for (``CallSpec.chip``, ``tops_core.target_chip``), and
16 MiB, what every generation gives a kernel by default, when it does not. On a known chip the
kernel asks Mosaic for all of the chip's VMEM (``vmem_limit_bytes``), a third more than the budget,
for Mosaic's spills and scratch (``tops_core.tpu.generations.MOSAIC_HEADROOM_BUDGET``). The capability predicates size the same plans against the same
budget, so a call the matcher accepts is launched as it was sized.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from tops_core import target_chip
from tops_core.lowering import per_platform
from tops_core.tpu.generations import GENERATIONS, vmem_budget

from tops_plugins_tpu_pallas import traffic
from tops_plugins_tpu_pallas.plan import Blocked, DmaSemaphores, InHbm, LaunchPlan, ScalarScratch, Scratch


@dataclasses.dataclass(frozen=True)
class Target:
    """The chip a launch is sized for (None: not known), the VMEM its plans may take there (``budget``),
    and the limit Mosaic is given (``vmem_limit_bytes``: the chip's whole VMEM; None on an unknown chip).

    The limit exceeds the budget so that what the plans' estimate leaves out (the kernel body's
    values beyond ``LaunchPlan.body_vmem``, Mosaic's internal scratch) still fits.
    """

    chip: str | None
    budget: int
    limit: int | None

    @classmethod
    def of(cls, chip: str | None) -> Target:
        return cls(chip, vmem_budget(chip), None if chip is None else GENERATIONS[chip].vmem_bytes)

    @classmethod
    def lowered_for(cls) -> Target:
        """The target of the program being traced (what ``CallSpec.chip`` says of the same call)."""
        return cls.of(target_chip())

    def describe(self) -> str:
        if self.chip:
            return f"{self.budget / 2**20:.0f} MiB budget of a {self.chip}"
        return f"{self.budget / 2**20:.0f} MiB budget of an unknown TPU (every generation's; lowered for a known v5e, v5p or v6e, the chip's larger one)"


UNKNOWN = Target.of(None)
"""A launch for an unknown chip: the 16 MiB every generation gives, no ``vmem_limit_bytes``."""


def fit(build_plans: Callable[..., tuple[LaunchPlan, ...]], geometry, dtype, target: Target, **inputs) -> tuple[Any, tuple[LaunchPlan, ...]]:
    """``build_plans(geometry, dtype, **inputs)`` with fewer chunks per grid step while one plan would not
    fit ``target``'s budget; returns the geometry and its plans. ValueError if one chunk per step does not fit."""
    plans = build_plans(geometry, dtype, **inputs)
    while geometry.chunks_per_step > 1 and needed_vmem(plans) > target.budget:
        geometry = dataclasses.replace(geometry, num_steps=geometry.chunks_per_step - 1)
        plans = build_plans(geometry, dtype, **inputs)
    needed = needed_vmem(plans)
    if needed > target.budget:
        largest = max(plans, key=traffic.vmem_bytes)
        raise ValueError(
            f"{largest.name} needs {needed / 2**20:.1f} MiB of VMEM (double-buffered blocks, scratch, body values) "
            f"at one chunk per step, more than the {target.describe()}"
        )
    return geometry, plans


def needed_vmem(plans: tuple[LaunchPlan, ...]) -> int:
    """The VMEM of the largest of ``plans`` (they run one after another)."""
    return max(traffic.vmem_bytes(plan) for plan in plans)


def prepare(build_plans: Callable[..., tuple[LaunchPlan, ...]], geometry, dtype, interpret: Any, **inputs):
    """A call's launches, as the program being traced needs them: ``(geometry, plans, run)``, the geometry and
    plans ``fit`` to the chip it is lowered for, and ``run`` with that target, ``interpret`` and the geometry bound."""
    target = Target.lowered_for()
    geometry, plans = fit(build_plans, geometry, dtype, target, **inputs)
    return geometry, plans, functools.partial(run, target=target, interpret=interpret, geometry=geometry)


def run(plan: LaunchPlan, kernel: Callable[..., None], arrays: dict[str, jax.Array], *, target: Target, interpret: Any, **static) -> dict[str, jax.Array]:
    """Run ``kernel(*refs, plan=plan, **static)`` over ``plan``; ``arrays`` holds the scalars and inputs by name, the result the outputs.

    XLA is told what the kernel costs (it cannot see inside a Mosaic kernel; the figures show in
    the compiled program's ``cost_analysis()``), and Mosaic, on a known chip, the VMEM it may use.

    ``interpret``: None compiles with Mosaic where the program is lowered for a TPU and runs
    Pallas' TPU interpreter anywhere else (decided at lowering, so a program lowered for a TPU
    on a CPU host gets the compiled kernel); otherwise ``pl.pallas_call``'s ``interpret``.
    """
    for operand in (*plan.scalars, *plan.inputs):
        x = arrays[operand.name]
        if tuple(x.shape) != operand.shape or jnp.dtype(x.dtype) != operand.dtype:
            raise ValueError(
                f"{plan.name}: {operand.name} is {tuple(x.shape)} {jnp.dtype(x.dtype).name}, "
                f"the plan says {operand.shape} {operand.dtype.name}"
            )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(plan.scalars),
        grid=plan.grid,
        in_specs=[_block_spec(x) for x in plan.inputs],
        out_specs=[_block_spec(x) for x in plan.outputs],
        scratch_shapes=[_scratch_shape(s) for s in plan.scratch],
    )
    operands = [arrays[x.name] for x in (*plan.scalars, *plan.inputs)]
    cost = pl.CostEstimate(flops=plan.flops, transcendentals=plan.transcendentals, bytes_accessed=sum(traffic.kernel_traffic(plan)))
    compiler_params = pltpu.CompilerParams(
        dimension_semantics=plan.dimension_semantics, vmem_limit_bytes=target.limit,
        fuse_transposed_lhs_in_matmul=plan.fuse_transposed_lhs,
    )

    positions = {x.name: i for i, x in enumerate((*plan.scalars, *plan.inputs))}
    outputs = {x.name: i for i, x in enumerate(plan.outputs)}
    aliases = {positions[source]: outputs[target] for source, target in plan.aliases}

    def launch(interpret: Any, operands: list[jax.Array]) -> list[jax.Array]:
        return pl.pallas_call(
            functools.partial(kernel, plan=plan, **static),
            grid_spec=grid_spec,
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in plan.outputs],
            input_output_aliases=aliases,
            compiler_params=compiler_params,
            interpret=interpret,
            cost_estimate=cost,
            name=plan.name,
        )(*operands)

    if interpret is None:
        # per_platform traces its first branch now and the other only when a program is lowered for its platforms: the
        # branch of the platform the call is traced on goes first (a kernel traced for a TPU it never runs on would
        # double the tracing of every interpreted call).
        compiled, interpreted = ("tpu", functools.partial(launch, False)), ("default", functools.partial(launch, True))
        on_a_tpu = target.chip is not None or jax.default_backend() == "tpu"
        results = per_platform(operands, dict([compiled, interpreted] if on_a_tpu else [interpreted, compiled]))
    else:
        results = launch(interpret, operands)
    return {x.name: result for x, result in zip(plan.outputs, results)}


def _block_spec(x: Blocked | InHbm) -> pl.BlockSpec:
    if isinstance(x, InHbm):
        return pl.BlockSpec(memory_space=pl.ANY)
    return pl.BlockSpec(x.block_shape, x.index_map)


def _scratch_shape(s: Scratch | DmaSemaphores | ScalarScratch) -> Any:
    if isinstance(s, DmaSemaphores):
        return pltpu.SemaphoreType.DMA((s.count,))
    if isinstance(s, ScalarScratch):
        return pltpu.SMEM(s.shape, s.dtype)
    return pltpu.VMEM(s.shape, s.dtype)
