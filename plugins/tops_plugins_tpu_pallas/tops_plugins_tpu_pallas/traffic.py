"""HBM traffic and VMEM model of launch plans, and the figures for the benchmark shape.

The model follows the Pallas TPU pipeline on one core: the grid runs in row-major order (last
axis fastest); an input block is fetched from HBM whenever its block index differs from the
previous grid step's, an output block is written back whenever its index is about to change and
after the last step; scalar-prefetch arrays are copied to SMEM once. A ragged edge block moves
only its part inside the array. With several cores each
walks a contiguous share of the parallel axes, which adds at most one fetch per operand per core.

VMEM: every input and output block is double-buffered; scratch is single. Sizes are rounded up to
whole TPU tiles (128 lanes; 8 sublanes of 32 bits, i.e. 16 rows of bf16). The values the kernel
body computes (the ``C x C`` attention matrix, float32 copies of a chunk) are added as the plan's
``body_vmem`` estimate.

Bytes per token are per token *and head* (``B * T * H`` positions): the floor for bf16
``K = V = 128`` is reading q, k, v and writing o, ``4 * 128 * 2 = 1024`` bytes.
``python -m tops_plugins_tpu_pallas.traffic_report`` prints the figures of both kernels for the
benchmark shape, kernel-only and end to end (with the relayout copies around the kernels).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from tops_plugins_tpu_pallas.plan import Blocked, InHbm, LaunchPlan, Scratch

_LANES = 128
_SUBLANE_BITS = 8 * 32


def _itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


def _vmem_tile_bytes(shape: Sequence[int], dtype) -> int:
    size = _itemsize(dtype)
    dims = list(shape)
    dims[-1] = -(-dims[-1] // _LANES) * _LANES
    if len(dims) >= 2:
        rows_per_tile = _SUBLANE_BITS // (8 * size)
        dims[-2] = -(-dims[-2] // rows_per_tile) * rows_per_tile
    return math.prod(dims) * size


def _grid_points(plan: LaunchPlan) -> np.ndarray:
    """Every grid point in execution order (row-major, last axis fastest), one column per point."""
    return np.indices(plan.grid).reshape(len(plan.grid), -1)


def _scalar_stand_ins(plan: LaunchPlan) -> list[np.ndarray]:
    """What an index map that reads scalar-prefetch arrays sees in the model: each array's positions as its values
    (a pool's rows all distinct and in order, as a decode batch's are)."""
    return [np.arange(math.prod(s.shape)).reshape(s.shape) for s in plan.scalars]


def _block_indices(operand: Blocked, points: np.ndarray, scalars: list[np.ndarray]) -> np.ndarray:
    """The operand's block index at every grid point: one row per array dimension."""
    index = operand.index_map(*points, *scalars)
    return np.stack([np.broadcast_to(np.asarray(i), points.shape[1:]) for i in index])


def _moved_bytes(operand: Blocked, index: np.ndarray, moved: np.ndarray) -> int:
    return int(np.sum(operand.block_elements(index[:, moved]))) * _itemsize(operand.dtype)


def kernel_traffic(plan: LaunchPlan) -> tuple[int, int]:
    """Bytes ``(read, written)`` between HBM and VMEM/SMEM over the whole grid of one plan."""
    read = sum(math.prod(s.shape) * _itemsize(s.dtype) for s in plan.scalars)
    written = 0
    points = _grid_points(plan)
    scalars = _scalar_stand_ins(plan)
    for x in plan.inputs:  # fetched at the first point and wherever the index differs from the previous one
        if isinstance(x, InHbm):
            read += _whole_array_bytes(x)
            continue
        index = _block_indices(x, points, scalars)
        read += _moved_bytes(x, index, np.concatenate([[True], _changes(index)]))
    for x in plan.outputs:  # written back before the index changes, and after the last point
        if isinstance(x, InHbm):
            written += _whole_array_bytes(x)
            continue
        index = _block_indices(x, points, scalars)
        written += _moved_bytes(x, index, np.concatenate([_changes(index), [True]]))
    return read, written


def _whole_array_bytes(x: InHbm) -> int:
    """What the kernel's own DMAs move of an ``InHbm`` array, at most: every region (of ``x.rows`` rows) ``x.moves`` times."""
    rows = x.shape[0] if x.rows is None else x.rows
    return x.moves * rows * math.prod(x.shape[1:]) * _itemsize(x.dtype)


def _changes(index: np.ndarray) -> np.ndarray:
    """Whether the block index changes between each grid point and the next."""
    return np.any(index[:, 1:] != index[:, :-1], axis=0)


def relayout_traffic(plans: Sequence[LaunchPlan]) -> tuple[int, int]:
    """Bytes ``(read, written)`` of the copies outside the kernels (lane padding); an array several plans share is copied once."""
    copies = {}
    for plan in plans:
        for x in plan.inputs:
            if x.relayout is not None:
                copies[x.name] = (math.prod(x.relayout.shape) * _itemsize(x.relayout.dtype), math.prod(x.shape) * _itemsize(x.dtype))
        for x in plan.outputs:
            if x.relayout is not None:
                copies[x.name] = (math.prod(x.shape) * _itemsize(x.dtype), math.prod(x.relayout.shape) * _itemsize(x.relayout.dtype))
    return sum(r for r, _ in copies.values()), sum(w for _, w in copies.values())


def vmem_bytes(plan: LaunchPlan) -> int:
    """Peak VMEM of one plan: double-buffered blocks and scratch in whole tiles, plus the body's values."""
    blocks = sum(
        2 * _vmem_tile_bytes([b for b in x.block_shape if b is not None], x.dtype)
        for x in (*plan.inputs, *plan.outputs) if isinstance(x, Blocked)
    )
    return blocks + sum(_vmem_tile_bytes(s.shape, s.dtype) for s in plan.scratch if isinstance(s, Scratch)) + plan.body_vmem


@dataclasses.dataclass(frozen=True)
class Figures:
    """Traffic of one op call (one or more launches) for ``tokens`` token-head positions.

    ``kernel_bytes`` is what the launches move between HBM and VMEM/SMEM; ``relayout_bytes`` what
    the copies around them move (zero when every head dimension is a multiple of 128);
    ``end_to_end_bytes`` their sum, the whole call.
    """

    tokens: int
    kernel_bytes: int
    relayout_bytes: int
    peak_vmem: int

    @property
    def end_to_end_bytes(self) -> int:
        return self.kernel_bytes + self.relayout_bytes

    @property
    def kernel_per_token(self) -> float:
        return self.kernel_bytes / self.tokens

    @property
    def relayout_per_token(self) -> float:
        return self.relayout_bytes / self.tokens

    @property
    def end_to_end_per_token(self) -> float:
        return self.end_to_end_bytes / self.tokens


def figures(plans: Sequence[LaunchPlan], tokens: int) -> Figures:
    kernel = sum(sum(kernel_traffic(p)) for p in plans)
    return Figures(tokens, kernel, sum(relayout_traffic(plans)), max(vmem_bytes(p) for p in plans))
