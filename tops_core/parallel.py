"""Splitting the ops over the devices of a mesh: batch, heads, and the sequence.

    mesh = jax.make_mesh((2, 4), ("data", "seq"))
    with tops_core.parallel.shard(mesh, batch="data", sequence="seq"):
        o, ht = tops_core.op("simple_gla").forward(q, k, v, g_gamma=gamma, output_final_state=True)

Inside the block, every op call (forward, backward, and the gradient of a forward) runs on each
device's block of its inputs, in a ``jax.shard_map`` over the whole mesh: ``q``, ``k``, ``v`` and
the per-token inputs are split along ``B`` over ``batch``, along ``T`` over ``sequence`` and along
``H`` over ``heads``; the outputs come back split the same way, and whatever has no such axis
(final states, ``dg_gamma``, ``dinitial_state``) comes back whole on every device. Each device's
block is decided by the dispatcher for its own shapes. A split sequence exchanges only ``K x V``
states and their maps between devices (``tops_core.ops.diagonal_sequence`` for simple_gla and gla, whose states
decay diagonally, ``tops_core.ops.delta_sequence`` for kda and gated_delta_rule); its ``T`` must divide evenly.

Use it inside the function you ``jax.jit``: the split is fixed when the call is traced. Without
it, a call under ``jax.jit`` whose inputs are sharded is split as the compiler finds them sharded,
on CPU and GPU (``tops_core.partitioning``); on TPU only this block splits a call.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax

from tops_core.partitioning import Split

_current: contextvars.ContextVar[Split | None] = contextvars.ContextVar("tops_split", default=None)

AxisNames = str | tuple[str, ...] | None


@contextlib.contextmanager
def shard(
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None, *,
    batch: AxisNames = None, heads: AxisNames = None, sequence: AxisNames = None,
) -> Iterator[Split]:
    """Split every op call in the block over ``mesh`` (default: the mesh of ``jax.set_mesh``).

    ``batch``, ``heads``, ``sequence``: the mesh axis (or tuple of axes) dividing ``B``, ``H``
    and ``T``; ``None`` leaves the dimension whole. Mesh axes named nowhere hold copies.
    """
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError("tops_core.parallel.shard: pass a mesh, or set one with jax.set_mesh")
    named = {"b": _axes("batch", batch, mesh), "h": _axes("heads", heads, mesh), "t": _axes("sequence", sequence, mesh)}
    used = [a for axes in named.values() for a in axes]
    if len(used) != len(set(used)):
        raise ValueError(f"tops_core.parallel.shard: a mesh axis divides two dimensions (batch={batch!r}, heads={heads!r}, sequence={sequence!r})")
    token = _current.set(Split.of(mesh, **named))
    try:
        yield _current.get()
    finally:
        _current.reset(token)


def current() -> Split | None:
    """The split of the innermost ``shard`` block, or ``None`` outside one."""
    return _current.get()


def _axes(dimension: str, value: Any, mesh: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    axes = (value,) if isinstance(value, str) else tuple(value)
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown or not all(isinstance(a, str) for a in axes):
        raise ValueError(f"tops_core.parallel.shard: {dimension}={value!r} names no axis of the mesh (axes: {', '.join(mesh.axis_names)})")
    return axes
