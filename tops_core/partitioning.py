"""Sharded calls: each shard of a ``jax.sharding`` mesh runs its own kernel on its own part of the inputs.

An op call traced under ``jax.jit`` has no idea how its inputs will be laid out over devices;
the SPMD partitioner finds out while compiling. ``partitioned`` hands the call to it through
``jax.experimental.custom_partitioning``: when the program is compiled for several devices, the
partitioner tells ``_Plan.partition`` how the operands are sharded, and every device then runs
the call on its local block, decided by the dispatcher for the block's shapes. Batch and heads
are independent, so a shard needs nothing from the others; a gradient that sums over them
(``dg_gamma``) is summed over the mesh with one ``psum``. A sharded sequence needs the state
carried in from the devices before it: the op's sequence-parallel algorithm
(``OpContract.sequence_parallel``) exchanges ``K x V`` states only, never tokens. Head and value
dimensions are never split (the partitioner gathers them if a caller shards them).

On one device, and under ``jax.vmap`` (which ``custom_partitioning`` does not support), the call
is the ordinary, unpartitioned one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import ClosedJaxpr, Primitive, jaxpr_as_fun
from jax.interpreters import batching, mlir
from jax.sharding import Mesh, NamedSharding, PartitionSpec

SPLIT = ("b", "t", "h")
"""The factors a shard may split: batch, time (the sequence) and heads; every other dimension stays whole."""

JAX_TO_SPEC_PLATFORM = {"cuda": "gpu", "rocm": "gpu"}


@dataclasses.dataclass(frozen=True)
class SequenceShards:
    """Where a device's block of a sharded sequence lies: mesh ``axes`` of ``size`` devices, this one's ``index``."""

    axes: tuple[str, ...]
    size: int
    index: jax.Array

    def shift(self, x: jax.Array, distance: int) -> jax.Array:
        """``x`` of the device ``distance`` places earlier in the sequence (later when negative); zeros where there is none."""
        pairs = [(i, i + distance) for i in range(self.size) if 0 <= i + distance < self.size]
        return jax.lax.ppermute(x, self.axes, pairs)


def exclusive_affine_scan(decay: jax.Array, state: jax.Array, shards: SequenceShards, reverse: bool = False) -> jax.Array:
    """The state each device receives when every device maps an incoming state ``x`` to ``decay * x + state``.

    ``decay`` is ``[B, H]`` and ``state`` ``[B, H, K, V]``; the result on device ``p`` is the maps
    of devices ``0 .. p-1`` applied in order to zero (``reverse``: those of ``p+1 .. P-1``, last
    first). A log-depth scan (Hillis and Steele) over ``ppermute``: one shift and
    ``ceil(log2(P))`` doubling rounds, each sending one ``[B, H, K, V]`` state per device.
    """
    step = -1 if reverse else 1
    first = 0 if not reverse else shards.size - 1
    decay, state = shards.shift(decay, step), shards.shift(state, step)
    decay = jax.numpy.where(shards.index == first, 1.0, decay)  # nothing before the first device: the identity map
    distance = 1
    while distance < shards.size:
        earlier_decay, earlier_state = shards.shift(decay, step * distance), shards.shift(state, step * distance)
        has_earlier = shards.index >= distance if not reverse else shards.index < shards.size - distance
        state = state + jax.numpy.where(has_earlier, decay[..., None, None] * earlier_state, 0.0)
        decay = jax.numpy.where(has_earlier, decay * earlier_decay, decay)
        distance *= 2
    return state


def partitioned(plan: Plan, operands: Sequence[jax.Array], body: Callable[..., Any]) -> Any:
    """``body(*operands)``, partitioned by ``plan`` when the program is compiled for several devices."""
    whole, out_shape = jax.make_jaxpr(body, return_shape=True)(*operands)
    if any(isinstance(const, jax.core.Tracer) for const in whole.consts):
        raise ValueError("partitioned: the body closes over a traced value; pass it in the operands")
    # Traced here rather than when lowering: JAX gives a lowering the devices custom_partitioning
    # needs only when it finds the primitive in the program.
    split = jax.make_jaxpr(plan.custom_partitioned(whole))(*operands)

    @jax.custom_jvp
    def call(*operands):
        return _partitioned_p.bind(*operands, split=split, whole=whole)

    @call.defjvp
    def call_jvp(primals, tangents):
        # Only higher-order gradients differentiate here (the op's own VJP is custom): they
        # differentiate the unpartitioned body.
        outs, out_tangents = jax.jvp(jaxpr_as_fun(whole), primals, tangents)
        return list(outs), list(out_tangents)

    return jax.tree.unflatten(jax.tree.structure(out_shape), call(*operands))


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """How one call is split: the factors of each operand and result, and the call to run on a shard.

    ``operand_dims``/``result_dims``: each array's factors, one name per dimension (``b`` batch,
    ``t`` time, ``h`` heads; others, such as ``k``, ``v``, ``n`` sequences, are never split).
    ``local(platform, sequence, *operands)`` computes one device's results from its block:
    ``platform`` is the call-spec platform of the mesh's devices, ``sequence`` the
    ``SequenceShards`` of a split time axis (``None`` when it is whole). A result without a split
    factor of the operands is summed over the devices that split it, so a device returns its
    share. ``unsplittable_sequence``: why the time axis may not be split (``None``: it may).
    """

    operand_dims: tuple[tuple[str, ...], ...]
    result_dims: tuple[tuple[str, ...], ...]
    local: Callable[..., Any]
    unsplittable_sequence: str | None

    def sharding_rule(self) -> tuple[str, tuple[str, ...]]:
        """The Shardy rule (``"b t h k, h -> b t h v"``) and the factors that must stay whole."""
        operands = ", ".join(" ".join(dims) for dims in self.operand_dims)
        results = ", ".join(" ".join(dims) for dims in self.result_dims)
        factors = dict.fromkeys(f for dims in self.operand_dims + self.result_dims for f in dims)  # Shardy wants them in this order
        return f"{operands} -> {results}", tuple(f for f in factors if f not in SPLIT)

    def custom_partitioned(self, whole: ClosedJaxpr) -> Callable:
        function = custom_partitioning(jaxpr_as_fun(whole))
        rule, whole = self.sharding_rule()
        function.def_partition(partition=self.partition, sharding_rule=rule, need_replication_factors=whole)
        return function

    def partition(self, mesh: Mesh, arg_shapes: Sequence[Any], result_shape: Any):
        axes = self.split_axes(mesh, arg_shapes)
        arg_shardings = tuple(NamedSharding(mesh, _spec(dims, axes)) for dims in self.operand_dims)
        result_shardings = [NamedSharding(mesh, _spec(dims, axes)) for dims in self.result_dims]
        platform = mesh.devices.flat[0].platform
        return mesh, functools.partial(self._local, mesh, axes, JAX_TO_SPEC_PLATFORM.get(platform, platform)), result_shardings, arg_shardings

    def split_axes(self, mesh: Mesh, arg_shapes: Sequence[Any]) -> dict[str, tuple[str, ...]]:
        """The mesh axes splitting each factor, read from the first operand's sharding (``q``'s)."""
        sharding = arg_shapes[0].sharding
        if not isinstance(sharding, NamedSharding):
            return {factor: () for factor in SPLIT}  # no axis names to exchange over: run whole
        spec = tuple(sharding.spec) + (None,) * (len(self.operand_dims[0]) - len(sharding.spec))
        axes = {factor: () for factor in SPLIT}
        for factor, entry in zip(self.operand_dims[0], spec):
            if factor in axes:
                axes[factor] = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        if axes["t"]:
            size = math.prod(mesh.shape[a] for a in axes["t"])
            seq_len = arg_shapes[0].shape[self.operand_dims[0].index("t")]
            reason = self.unsplittable_sequence
            if reason is None and seq_len % size:
                reason = (
                    f"T={seq_len} is not divisible by the {size} devices of mesh axis {_names(axes['t'])}; "
                    f"sequence parallelism splits T into equal blocks: pad T to a multiple of {size}"
                )
            if reason:
                raise ValueError(f"cannot split the sequence over mesh axis {_names(axes['t'])}: {reason}")
        return axes

    def _local(self, mesh: Mesh, axes: dict[str, tuple[str, ...]], platform: str, *operands: jax.Array) -> list[jax.Array]:
        sequence = None
        if axes["t"]:
            size = math.prod(mesh.shape[a] for a in axes["t"])
            sequence = SequenceShards(axes["t"], size, jax.lax.axis_index(axes["t"]))
        results = self.local(platform, sequence, *operands)
        split = {f for dims in self.operand_dims for f in dims if f in SPLIT and axes[f]}
        reduced = []
        for dims, result in zip(self.result_dims, jax.tree.leaves(results)):
            over = tuple(a for f in sorted(split - set(dims)) for a in axes[f])
            reduced.append(jax.lax.psum(result, over) if over else result)
        return reduced


def _spec(dims: tuple[str, ...], axes: dict[str, tuple[str, ...]]) -> PartitionSpec:
    return PartitionSpec(*(axes.get(f) or None for f in dims))


def _names(axes: tuple[str, ...]) -> str:
    return repr(axes[0]) if len(axes) == 1 else repr(axes)


_partitioned_p = Primitive("tops_partitioned")
_partitioned_p.multiple_results = True


@_partitioned_p.def_abstract_eval
def _abstract_eval(*avals, split, whole):
    return whole.out_avals


@_partitioned_p.def_impl
def _run_eagerly(*args, split, whole):
    # Compiled where the arguments are and as they are sharded, as under jit.
    return jax.jit(functools.partial(_partitioned_p.bind, split=split, whole=whole))(*args)


def _lower(ctx, *args, split, whole):
    return mlir.lower_fun(jaxpr_as_fun(split), multiple_results=True)(ctx, *args)


mlir.register_lowering(_partitioned_p, _lower)


def _batch(args, dims, *, split, whole):
    # custom_partitioning has no batching rule: a vmapped call runs unpartitioned.
    results = jax.vmap(jaxpr_as_fun(whole), in_axes=list(dims), out_axes=0)(*args)
    return list(results), [0] * len(results)


batching.primitive_batchers[_partitioned_p] = _batch
