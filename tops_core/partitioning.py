"""Sharded calls: each device of a ``jax.sharding`` mesh runs its own kernel on its own block of the inputs.

A ``Split`` names the mesh axes that split the batch, the sequence and the heads. Every device
then runs the call on its block, decided by the dispatcher for the block's shapes. Batch and heads
are independent, so a device needs nothing from the others, and a gradient summed over them
(``dg_gamma``) is summed over the mesh with one ``psum``. A split sequence needs the state carried
in from the devices before: the op's sequence-parallel algorithm (``OpContract.split_sequence``)
exchanges ``K x V`` states only, never tokens. Head and value dimensions are never split.

The split is applied in one of two ways:

- known when the call is traced (``tops_core.parallel.shard``): the call runs in a
  ``jax.shard_map`` over the whole mesh. This works on every platform, and is the only way on
  TPU, whose Pallas kernels JAX runs on several devices only inside a ``shard_map``;
- otherwise, under ``jax.jit`` with sharded inputs, the SPMD partitioner, which alone knows the
  inputs' shardings, tells ``Plan.partition`` through ``jax.experimental.custom_partitioning``
  while compiling. Its Python callback runs in the compilers of CPU and GPU only; lowered for
  TPU, the call is left whole.

On one device, and under ``jax.vmap`` (which ``custom_partitioning`` does not support), the call
is the ordinary, unsplit one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import ClosedJaxpr, Primitive, jaxpr_as_fun
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

FACTORS = {"b": "batch", "t": "sequence", "h": "heads"}
"""The dimensions a split may divide, by their factor names in an op's ``dims``; every other one stays whole."""

_SPEC_PLATFORM = {"cuda": "gpu", "rocm": "gpu"}


@dataclasses.dataclass(frozen=True)
class Split:
    """The mesh axes dividing each factor (``b`` batch, ``t`` sequence, ``h`` heads); hashable."""

    mesh: Any  # jax.sharding.Mesh or AbstractMesh
    axes: tuple[tuple[str, tuple[str, ...]], ...]

    @classmethod
    def of(cls, mesh: Any, **axes: tuple[str, ...]) -> Split:
        return cls(mesh, tuple((factor, tuple(axes.get(factor, ()))) for factor in FACTORS))

    def __getitem__(self, factor: str) -> tuple[str, ...]:
        return dict(self.axes).get(factor, ())

    def size(self, factor: str) -> int:
        return math.prod(self.mesh.shape[a] for a in self[factor])

    @classmethod
    def from_types(cls, x: jax.Array, dims: tuple[str, ...]) -> Split | None:
        """The split ``x``'s type carries over explicit mesh axes (``jax.sharding.AxisType.Explicit``), if any."""
        sharding = jax.typeof(x).sharding
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or mesh.empty or not mesh.explicit_axes:
            return None
        axes = {}
        for factor, entry in zip(dims, sharding.spec):
            named = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            if factor in FACTORS and named:
                axes[factor] = named
        return cls.of(mesh, **axes) if axes else None

    @property
    def platform(self) -> str | None:
        """The call-spec platform of the mesh's devices, when the mesh knows it."""
        if isinstance(self.mesh, jax.sharding.Mesh) and not self.mesh.empty:
            platform = self.mesh.devices.flat[0].platform
        elif getattr(self.mesh, "abstract_device", None) is not None:
            platform = self.mesh.abstract_device.platform
        else:
            return None
        return _SPEC_PLATFORM.get(platform, platform)

    def spec(self, dims: tuple[str, ...]) -> PartitionSpec:
        return PartitionSpec(*(self[f] or None for f in dims))

    def describe(self, factor: str) -> str:
        axes = self[factor]
        return repr(axes[0]) if len(axes) == 1 else repr(axes)


@dataclasses.dataclass(frozen=True)
class SequenceShards:
    """Where a device's block of a split sequence lies: mesh ``axes`` of ``size`` devices, this one's ``index``."""

    axes: tuple[str, ...]
    size: int
    index: jax.Array

    def shift(self, x: jax.Array, distance: int) -> jax.Array:
        """``x`` of the device ``distance`` places earlier in the sequence (later when negative); zeros where there is none."""
        pairs = [(i, i + distance) for i in range(self.size) if 0 <= i + distance < self.size]
        return jax.lax.ppermute(x, self.axes, pairs)


def per_row(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x``, indexed by the leading dimensions of ``like`` (a ``[B]`` mask, a ``[B, H]`` or ``[B, H, K]`` decay of
    ``[B, H, K, V]`` states), shaped to broadcast against it."""
    return x.reshape(x.shape + (1,) * (like.ndim - x.ndim))


def _apply(decay: jax.Array, state: jax.Array) -> jax.Array:
    """``decay`` applied to ``state`` (another map's decay, or a ``[B, H, K, V]`` state): a ``[B, H, K, K]`` matrix
    multiplies it, a diagonal (``[B, H]`` or ``[B, H, K]``) scales its rows."""
    if decay.ndim == 4:
        return jnp.einsum("bhij,bhj...->bhi...", decay, state, precision=jax.lax.Precision.HIGHEST)
    return per_row(decay, state) * state


def exclusive_affine_scan(decay: jax.Array, state: jax.Array, shards: SequenceShards, reverse: bool = False) -> jax.Array:
    """The state each device receives when every device maps an incoming state ``x`` to ``decay x + state``.

    ``state`` is ``[B, H, K, V]``; ``decay`` is diagonal, ``[B, H]`` (one per head) or ``[B, H, K]`` (one per key), or a
    ``[B, H, K, K]`` matrix (the delta rule's). The result on device ``p`` is the maps of devices ``0 .. p-1`` applied
    in order to zero (``reverse``: those of ``p+1 .. P-1``, last first). A log-depth scan (Hillis and Steele) over
    ``ppermute``: one shift, then ``ceil(log2(P - 1))`` doubling rounds over the ``P - 1`` shifted maps, each sending
    one ``[B, H, K, V]`` state (and its decay) per device.
    """
    step = -1 if reverse else 1
    first = 0 if not reverse else shards.size - 1
    identity = jnp.eye(decay.shape[-1], dtype=decay.dtype) if decay.ndim == 4 else 1.0
    decay, state = shards.shift(decay, step), shards.shift(state, step)
    decay = jnp.where(shards.index == first, identity, decay)  # nothing before the first device: the identity map
    distance = 1
    while distance < shards.size - 1:
        earlier_decay, earlier_state = shards.shift(decay, step * distance), shards.shift(state, step * distance)
        has_earlier = shards.index >= distance if not reverse else shards.index < shards.size - distance
        state = state + jnp.where(has_earlier, _apply(decay, earlier_state), 0.0)
        decay = jnp.where(has_earlier, _apply(decay, earlier_decay), decay)
        distance *= 2
    return state


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """How one call splits: the factors of each operand and result, and the call to run on a block.

    ``out_tree``: the structure of the call's results (``result_dims`` follows its leaves).
    ``operand_dims``/``result_dims``: each array's factors, one name per dimension (``b``, ``t``,
    ``h`` may be split; any other name, such as ``k``, ``v``, ``n`` for sequences, stays whole).
    The first operand (``q``) carries the split the partitioner reports. ``local(platform,
    sequence, *operands)`` computes one device's results from its block: ``platform`` is the
    call-spec platform of the mesh's devices (``None`` when unknown), ``sequence`` the
    ``SequenceShards`` of a split sequence (``None`` when it is whole). A result without a split
    factor of the operands is summed over the devices that split it, so ``local`` returns its
    device's share. ``unsplittable_sequence``: why the sequence may not be split (``None``: it may).
    """

    operand_dims: tuple[tuple[str, ...], ...]
    result_dims: tuple[tuple[str, ...], ...]
    out_tree: Any
    local: Callable[..., Any]
    unsplittable_sequence: str | None

    def check(self, split: Split, seq_len: int) -> None:
        """Raise ``ValueError`` when the sequence may not be split as ``split`` asks."""
        if not split["t"]:
            return
        size = split.size("t")
        reason = self.unsplittable_sequence
        if reason is None and seq_len % size:
            reason = (
                f"T={seq_len} is not divisible by its {size} devices; the sequence is split into equal blocks, "
                f"so pad T to a multiple of {size} (with cu_seqlens, as one more sequence)"
            )
        if reason:
            raise ValueError(f"cannot split the sequence over mesh axis {split.describe('t')}: {reason}")

    def mapped(self, split: Split, operands: Sequence[jax.Array]) -> list[jax.Array]:
        """The call split over ``split`` in a ``shard_map`` over the whole mesh."""
        self.check(split, operands[0].shape[self.operand_dims[0].index("t")])
        operands = [_typed_for(x, split.mesh, split.spec(dims)) for x, dims in zip(operands, self.operand_dims)]
        run = jax.shard_map(
            functools.partial(self._local, split, split.platform),
            mesh=split.mesh,
            in_specs=tuple(split.spec(dims) for dims in self.operand_dims),
            out_specs=[split.spec(dims) for dims in self.result_dims],
            check_vma=False,  # the block's results are replicated where _local says (psum), not where JAX can prove it
        )
        return run(*operands)

    def custom_partitioned(self, whole: ClosedJaxpr) -> Callable:
        """``whole`` as a ``custom_partitioning`` function that ``partition`` splits while compiling."""
        function = custom_partitioning(jaxpr_as_fun(whole))
        factors = dict.fromkeys(f for dims in self.operand_dims + self.result_dims for f in dims)  # Shardy wants this order
        operands = ", ".join(" ".join(dims) for dims in self.operand_dims)
        results = ", ".join(" ".join(dims) for dims in self.result_dims)
        function.def_partition(
            partition=self.partition, sharding_rule=f"{operands} -> {results}",
            need_replication_factors=tuple(f for f in factors if f not in FACTORS),
        )
        return function

    def partition(self, mesh: Any, arg_shapes: Sequence[Any], result_shape: Any):
        """``custom_partitioning``'s callback: the split the partitioner chose for ``q``, applied to every array."""
        sharding = arg_shapes[0].sharding
        axes = {}
        if isinstance(sharding, NamedSharding):  # else no axis names to exchange over: leave the call whole
            for factor, entry in zip(self.operand_dims[0], sharding.spec):
                if factor in FACTORS and entry is not None:
                    axes[factor] = (entry,) if isinstance(entry, str) else tuple(entry)
        split = Split.of(mesh, **axes)
        self.check(split, arg_shapes[0].shape[self.operand_dims[0].index("t")])
        arg_shardings = tuple(NamedSharding(mesh, split.spec(dims)) for dims in self.operand_dims)
        result_shardings = [NamedSharding(mesh, split.spec(dims)) for dims in self.result_dims]
        return mesh, functools.partial(self._local, split, split.platform), result_shardings, arg_shardings

    def _local(self, split: Split, platform: str | None, *operands: jax.Array) -> list[jax.Array]:
        sequence = None
        if split["t"]:
            sequence = SequenceShards(split["t"], split.size("t"), jax.lax.axis_index(split["t"]))
        results = jax.tree.leaves(self.local(platform, sequence, *operands))
        split_factors = {f for dims in self.operand_dims for f in dims if split[f]}
        shared = []
        for dims, result in zip(self.result_dims, results):
            over = tuple(a for f in sorted(split_factors - set(dims)) for a in split[f])
            shared.append(jax.lax.psum(result, over) if over else result)
        return shared


def _typed_for(x: jax.Array, mesh: Any, spec: PartitionSpec) -> jax.Array:
    """``x`` resharded to ``spec`` over the mesh's explicit axes (``AxisType.Explicit``, ``jax.make_mesh``'s default).

    ``jax.shard_map`` requires an input's type to match its ``in_specs`` over explicit axes (an
    unsharded input would be refused); over Auto axes it reshards the input itself, and
    ``reshard`` may not name them, so they are left out of the spec here.
    """
    explicit = set(mesh.explicit_axes)
    if not explicit:
        return x

    def kept(entry: Any) -> Any:
        axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a in explicit)
        return axes or None

    return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec(*(kept(entry) for entry in spec))))


def partitioned(plan: Plan, operands: Sequence[jax.Array], body: Callable[..., Any], split: Split | None) -> Any:
    """``body(*operands)`` split by ``plan``: over ``split`` now, or, when it is ``None``, as the inputs turn out sharded."""
    if split is not None:
        return jax.tree.unflatten(plan.out_tree, plan.mapped(split, operands))
    whole = jax.make_jaxpr(body)(*operands)
    if any(isinstance(const, jax.core.Tracer) for const in whole.consts):
        raise ValueError("partitioned: the body closes over a traced value; pass it in the operands")
    if _calls_the_host(whole.jaxpr) or whole.effects:
        # A host callback inside a custom_partitioning function crashes the process when the
        # program runs on several devices (JAX 0.10.2, CPU: a segfault), so a call whose
        # implementation runs on the host (the float64 reference) is left whole, for XLA to place.
        # So is one with side effects (Pallas' faithful TPU interpreter calls back in order): the
        # custom_partitioning lowering has no token for them (a KeyError on the ordered effect).
        return jax.tree.unflatten(plan.out_tree, jaxpr_as_fun(whole)(*operands))
    # Traced here rather than when lowering: JAX gives a lowering the devices custom_partitioning
    # needs only when it finds the primitive in the program.
    split_later = jax.make_jaxpr(plan.custom_partitioned(whole))(*operands)

    @jax.custom_jvp
    def call(*operands):
        return _partitioned_p.bind(*operands, split=split_later, whole=whole)

    @call.defjvp
    def call_jvp(primals, tangents):
        # Only higher-order gradients differentiate here (the op's own VJP is custom): they
        # differentiate the unsplit body.
        outs, out_tangents = jax.jvp(jaxpr_as_fun(whole), primals, tangents)
        return list(outs), list(out_tangents)

    return jax.tree.unflatten(plan.out_tree, call(*operands))


def _calls_the_host(jaxpr: Any) -> bool:
    """Whether ``jaxpr``, or a jaxpr inside it, calls back to the host (``jax.pure_callback``)."""
    for equation in jaxpr.eqns:
        if equation.primitive.name == "pure_callback":
            return True
        for value in equation.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's jaxpr
                if hasattr(inner, "eqns") and _calls_the_host(inner):
                    return True
    return False


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


def _lower_whole(ctx, *args, split, whole):
    # TPU compilers do not run custom_partitioning's callback ("Custom emitter for
    # CustomSPMDPartitioning not found"), so the call stays whole; XLA can partition plain
    # jax.numpy, but a Pallas kernel runs on several devices only inside a shard_map.
    try:
        return mlir.lower_fun(jaxpr_as_fun(whole), multiple_results=True)(ctx, *args)
    except NotImplementedError as error:
        if "shard_map" not in str(error):
            raise
        raise NotImplementedError(
            "a TPU kernel in a program for several devices runs only split over them explicitly: call the op inside "
            "tops_core.parallel.shard(mesh, batch=..., heads=..., sequence=...) (JAX cannot split it on TPU by itself)"
        ) from error


mlir.register_lowering(_partitioned_p, _lower)
mlir.register_lowering(_partitioned_p, _lower_whole, platform="tpu")


def _batch(args, dims, *, split, whole):
    # custom_partitioning has no batching rule: a vmapped call runs unsplit.
    results = jax.vmap(jaxpr_as_fun(whole), in_axes=list(dims), out_axes=0)(*args)
    return list(results), [0] * len(results)


batching.primitive_batchers[_partitioned_p] = _batch
