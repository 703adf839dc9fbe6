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
import itertools
import math
from collections.abc import Sequence

import numpy as np

from tops_plugins_tpu_pallas.launch import Blocked, LaunchPlan

VMEM_BUDGET = 16 * 2**20
"""Scoped VMEM a kernel may plan for: the default scoped limit of v4/v5e (v6e and later allow more)."""

_LANES = 128
_SUBLANE_BITS = 8 * 32


def _itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


def _block_bytes(operand: Blocked, index: Sequence[int]) -> int:
    return operand.block_elements(index) * _itemsize(operand.dtype)


def _vmem_tile_bytes(shape: Sequence[int], dtype) -> int:
    size = _itemsize(dtype)
    dims = list(shape)
    dims[-1] = -(-dims[-1] // _LANES) * _LANES
    if len(dims) >= 2:
        rows_per_tile = _SUBLANE_BITS // (8 * size)
        dims[-2] = -(-dims[-2] // rows_per_tile) * rows_per_tile
    return math.prod(dims) * size


def kernel_traffic(plan: LaunchPlan) -> tuple[int, int]:
    """Bytes ``(read, written)`` between HBM and VMEM/SMEM over the whole grid of one plan."""
    read = sum(math.prod(s.shape) * _itemsize(s.dtype) for s in plan.scalars)
    written = 0
    last_in = {x.name: None for x in plan.inputs}
    last_out = {x.name: None for x in plan.outputs}
    for point in itertools.product(*(range(n) for n in plan.grid)):
        for x in plan.inputs:
            index = tuple(int(i) for i in x.index_map(*point))
            if index != last_in[x.name]:
                read += _block_bytes(x, index)
                last_in[x.name] = index
        for x in plan.outputs:
            index = tuple(int(i) for i in x.index_map(*point))
            if last_out[x.name] is not None and index != last_out[x.name]:
                written += _block_bytes(x, last_out[x.name])
            last_out[x.name] = index
    written += sum(_block_bytes(x, last_out[x.name]) for x in plan.outputs)  # the blocks resident after the last step
    return read, written


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
        2 * _vmem_tile_bytes([b for b in x.block_shape if b is not None], x.dtype) for x in (*plan.inputs, *plan.outputs)
    )
    return blocks + sum(_vmem_tile_bytes(s.shape, s.dtype) for s in plan.scratch) + plan.body_vmem


def check_vmem(plan: LaunchPlan) -> None:
    """Raise ValueError when the plan needs more VMEM than ``VMEM_BUDGET``."""
    needed = vmem_bytes(plan)
    if needed > VMEM_BUDGET:
        raise ValueError(
            f"{plan.name} needs {needed / 2**20:.1f} MiB of VMEM (double-buffered blocks, scratch, body values), "
            f"more than the {VMEM_BUDGET / 2**20:.0f} MiB budget; lower num_steps or chunk_size"
        )


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
