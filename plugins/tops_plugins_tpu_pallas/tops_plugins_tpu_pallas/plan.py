"""Launch plans: one description of a ``pallas_call`` that both runs the kernel and feeds the traffic model.

A plan names every array the kernel touches (scalar-prefetch arrays in SMEM, blocked inputs and
outputs in HBM, scratch in VMEM), with shapes, dtypes, block shapes and index maps, plus the grid
and its dimension semantics. ``tops_plugins_tpu_pallas.launch`` builds the ``pl.pallas_call`` from
it and ``tops_plugins_tpu_pallas.traffic`` counts bytes from the very same object, so the two cannot drift.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

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
    what a kernel that touches every region at most ``moves`` times moves at most; or, given ``rows``,
    that many of its leading index's rows (a state pool, of which a call reaches its sequences' rows).
    ``relayout`` as for ``Blocked``.
    """

    relayout: Relayout | None = None
    moves: int = 1
    rows: int | None = None


@dataclasses.dataclass(frozen=True)
class DmaSemaphores:
    """``count`` DMA semaphores in the kernel's scratch, for the copies of ``InHbm`` arrays."""

    name: str
    count: int


@dataclasses.dataclass(frozen=True)
class ScalarScratch(_Array):
    """Scalars in SMEM that live for the whole launch, one set per core: bookkeeping the kernel keeps across its own
    branches and loops (which sequence's DMA is in flight into which buffer, ``grid.SequenceStates``)."""


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
    body computes over the whole grid (what ``launch`` tells XLA, with the bytes the traffic model counts).
    ``aliases``: ``(input, output)`` name pairs that share one HBM buffer (``input_output_aliases``):
    the output is the input updated in place, and only the blocks the grid writes change.
    ``fuse_transposed_lhs``: Mosaic's hint to feed a product's transposed left operand (``a.T @ b``) to the MXU as it
    is, without a transpose on the XLU first; it helps some kernels and slows others, so each plan says.
    """

    name: str
    grid: tuple[int, ...]
    dimension_semantics: tuple[str, ...]
    scalars: tuple[Scalars, ...]
    inputs: tuple[Blocked | InHbm, ...]
    outputs: tuple[Blocked | InHbm, ...]
    scratch: tuple[Scratch | DmaSemaphores | ScalarScratch, ...] = ()
    body_vmem: int = 0
    flops: int = 0
    transcendentals: int = 0
    aliases: tuple[tuple[str, str], ...] = ()
    fuse_transposed_lhs: bool = False

    def __post_init__(self):
        if len(self.dimension_semantics) != len(self.grid):
            raise ValueError(f"{self.name}: {len(self.grid)} grid axes but semantics {self.dimension_semantics}")
        unknown = set(self.dimension_semantics) - set(SEMANTICS)
        if unknown:
            raise ValueError(f"{self.name}: unknown dimension semantics {sorted(unknown)}; known: {SEMANTICS}")
        names = [x.name for x in (*self.scalars, *self.inputs, *self.outputs, *self.scratch)]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: operand names must be unique, got {names}")
        inputs, outputs = ({x.name: x for x in xs} for xs in (self.inputs, self.outputs))
        for source, target in self.aliases:
            if source not in inputs or target not in outputs:
                raise ValueError(f"{self.name}: alias {source} -> {target} must name an input and an output")
            if (inputs[source].shape, inputs[source].dtype) != (outputs[target].shape, outputs[target].dtype):
                raise ValueError(f"{self.name}: alias {source} -> {target} joins arrays of different shapes or dtypes")

    def bind(self, refs: Sequence[Any]) -> dict[str, Any]:
        """Name the refs a kernel receives (scalars, inputs, outputs, scratch, in that order)."""
        names = [x.name for x in (*self.scalars, *self.inputs, *self.outputs, *self.scratch)]
        if len(refs) != len(names):
            raise ValueError(f"{self.name}: kernel got {len(refs)} refs, the plan has {len(names)}: {names}")
        return dict(zip(names, refs))
