"""Launch plans: one description of a ``pallas_call`` that both runs the kernel and feeds the traffic model.

A plan names every array the kernel touches (scalar-prefetch arrays in SMEM, blocked inputs and
outputs in HBM, scratch in VMEM), with shapes, dtypes, block shapes and index maps, plus the grid
and its dimension semantics. ``LaunchPlan.call`` builds the ``pl.pallas_call`` from it and
``tops_plugins_tpu_pallas.traffic`` counts bytes from the very same object, so the two cannot drift.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from tops_core.lowering import per_platform

SEMANTICS = ("parallel", "arbitrary")


@dataclasses.dataclass(frozen=True)
class Relayout:
    """The caller-facing array that an operand is copied from (inputs) or into (outputs) outside the kernel."""

    shape: tuple[int, ...]
    dtype: Any


@dataclasses.dataclass(frozen=True)
class _Array:
    """What every array of a plan has: a name, a shape and a dtype (normalised to ``jnp.dtype``)."""

    name: str
    shape: tuple[int, ...]
    dtype: Any

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))


@dataclasses.dataclass(frozen=True)
class Blocked(_Array):
    """An HBM array the kernel sees one block at a time.

    ``block_shape`` uses ``None`` for a squeezed dimension (size 1, dropped from the kernel's ref);
    ``index_map(*grid_indices, *scalar_prefetch_refs)`` returns the block index per dimension.
    The last block along a dimension may run past the array's end (a ragged block): on TPU its
    rows there read unspecified values and writes to them are dropped, so a kernel must mask them.
    ``relayout`` is set when the array is a copy made outside the kernel (lane padding).
    """

    block_shape: tuple[int | None, ...]
    index_map: Callable[..., tuple[Any, ...]]
    relayout: Relayout | None = None

    def __post_init__(self):
        super().__post_init__()
        if len(self.block_shape) != len(self.shape):
            raise ValueError(f"{self.name}: block shape {self.block_shape} and array shape {self.shape} differ in rank")

    def block_elements(self, index: Sequence[Any]) -> Any:
        """Elements of the block at ``index`` that lie inside the array (fewer than a whole block at a ragged edge).

        ``index`` holds one block index per dimension, each an int or a NumPy array of them (then
        the result is an array: one count per grid point).
        """
        counts = [
            1 if block is None else np.minimum(block, size - np.asarray(i) * block)
            for size, block, i in zip(self.shape, self.block_shape, index)
        ]
        return math.prod(counts)


@dataclasses.dataclass(frozen=True)
class InHbm(_Array):
    """An HBM array the kernel moves itself, region by region, with DMAs (``memory_space=pl.ANY``).

    The traffic model cannot follow those copies; it counts the whole array moved ``moves`` times,
    what a kernel that touches every region at most ``moves`` times moves at most. ``relayout`` as for ``Blocked``.
    """

    relayout: Relayout | None = None
    moves: int = 1


@dataclasses.dataclass(frozen=True)
class DmaSemaphores:
    """``count`` DMA semaphores in the kernel's scratch, for the copies of ``InHbm`` arrays."""

    name: str
    count: int


@dataclasses.dataclass(frozen=True)
class Scalars(_Array):
    """A small array copied whole into SMEM before the grid starts (scalar prefetch)."""


@dataclasses.dataclass(frozen=True)
class Scratch(_Array):
    """A VMEM buffer that lives for the whole launch, one per core; never touches HBM."""


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Grid, dimension semantics and every operand of one ``pallas_call``.

    ``body_vmem`` estimates the VMEM the kernel body's own values need (matrices it computes and
    spills), which no operand describes. ``flops`` and ``transcendentals`` count what the kernel
    body computes over the whole grid (``pl.CostEstimate``; the bytes come from the traffic model).
    """

    name: str
    grid: tuple[int, ...]
    dimension_semantics: tuple[str, ...]
    scalars: tuple[Scalars, ...]
    inputs: tuple[Blocked | InHbm, ...]
    outputs: tuple[Blocked | InHbm, ...]
    scratch: tuple[Scratch | DmaSemaphores, ...] = ()
    body_vmem: int = 0
    flops: int = 0
    transcendentals: int = 0

    def __post_init__(self):
        if len(self.dimension_semantics) != len(self.grid):
            raise ValueError(f"{self.name}: {len(self.grid)} grid axes but semantics {self.dimension_semantics}")
        unknown = set(self.dimension_semantics) - set(SEMANTICS)
        if unknown:
            raise ValueError(f"{self.name}: unknown dimension semantics {sorted(unknown)}; known: {SEMANTICS}")
        names = [x.name for x in (*self.scalars, *self.inputs, *self.outputs, *self.scratch)]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: operand names must be unique, got {names}")

    def bind(self, refs: Sequence[Any]) -> dict[str, Any]:
        """Name the refs a kernel receives (scalars, inputs, outputs, scratch, in that order)."""
        names = [x.name for x in (*self.scalars, *self.inputs, *self.outputs, *self.scratch)]
        if len(refs) != len(names):
            raise ValueError(f"{self.name}: kernel got {len(refs)} refs, the plan has {len(names)}: {names}")
        return dict(zip(names, refs))

    def call(
        self, kernel: Callable[..., None], arrays: dict[str, jax.Array], interpret: Any, cost: pl.CostEstimate | None = None
    ) -> dict[str, jax.Array]:
        """Run ``kernel`` over this plan; ``arrays`` holds the scalars and inputs by name, the result the outputs.

        ``cost`` tells XLA what the kernel costs (it cannot see inside a Mosaic kernel); it shows
        in the compiled program's ``cost_analysis()``.

        ``interpret``: None compiles with Mosaic where the program is lowered for a TPU and runs
        Pallas' TPU interpreter anywhere else (decided at lowering, so a program lowered for a TPU
        on a CPU host gets the compiled kernel); otherwise ``pl.pallas_call``'s ``interpret``.
        """
        for operand in (*self.scalars, *self.inputs):
            x = arrays[operand.name]
            if tuple(x.shape) != operand.shape or jnp.dtype(x.dtype) != operand.dtype:
                raise ValueError(
                    f"{self.name}: {operand.name} is {tuple(x.shape)} {jnp.dtype(x.dtype).name}, "
                    f"the plan says {operand.shape} {operand.dtype.name}"
                )
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(self.scalars),
            grid=self.grid,
            in_specs=[_block_spec(x) for x in self.inputs],
            out_specs=[_block_spec(x) for x in self.outputs],
            scratch_shapes=[_scratch_shape(s) for s in self.scratch],
        )
        operands = [arrays[x.name] for x in (*self.scalars, *self.inputs)]

        def launch(interpret: Any, operands: list[jax.Array]) -> list[jax.Array]:
            return pl.pallas_call(
                kernel,
                grid_spec=grid_spec,
                out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in self.outputs],
                compiler_params=pltpu.CompilerParams(dimension_semantics=self.dimension_semantics),
                interpret=interpret,
                cost_estimate=cost,
                name=self.name,
            )(*operands)

        if interpret is None:
            results = per_platform(operands, {"tpu": functools.partial(launch, False), "default": functools.partial(launch, True)})
        else:
            results = launch(interpret, operands)
        return {x.name: result for x, result in zip(self.outputs, results)}


def _block_spec(x: Blocked | InHbm) -> pl.BlockSpec:
    if isinstance(x, InHbm):
        return pl.BlockSpec(memory_space=pl.ANY)
    return pl.BlockSpec(x.block_shape, x.index_map)


def _scratch_shape(s: Scratch | DmaSemaphores) -> Any:
    if isinstance(s, DmaSemaphores):
        return pltpu.SemaphoreType.DMA((s.count,))
    return pltpu.VMEM(s.shape, s.dtype)
