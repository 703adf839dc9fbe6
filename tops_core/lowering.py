"""Code chosen by the platform a program is lowered for, and the dispatcher's use of it.

A traced call (under ``jit``, ``grad`` or ``vmap``, or traced from abstract inputs for
ahead-of-time lowering) can end up compiled for any platform: a training step lowered on a CPU
host for a TPU, a function exported with ``jax.export(..., platforms=("tpu",))``. Its inputs carry
no device, so the dispatcher decides once per platform and stages the winners out with
``per_platform``; the lowering keeps the branch of the platform it lowers for, so a TPU kernel is
never lowered for a CPU and the CPU's choice never reaches a TPU.

``per_platform`` is ``jax.lax.platform_dependent`` with two differences. Each branch is lowered
for its own platforms only: ``platform_dependent`` lowers every kept branch for every platform of
a multi-platform lowering (``jax.export(..., platforms=("cpu", "tpu"))``), and a compiled Pallas
TPU kernel has no CPU lowering, so the CPU half of such an export would fail on the TPU branch.
And only the first branch (the dispatcher puts the call's own platform first) is traced with the
call; the others are traced when the program is lowered for their platforms, so a training step
jitted on a CPU host does not trace the TPU kernels it will never run (about 3 s for kda's).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Primitive, jaxpr_as_fun
from jax.interpreters import batching, mlir

from tops_core.dispatch import Decision, NoImplementationError

JAX_PLATFORM_NAMES: Mapping[str, tuple[str, ...]] = {"cpu": ("cpu",), "gpu": ("cuda", "rocm"), "tpu": ("tpu",)}
"""The names JAX lowers for, per call-spec platform."""

Choice = Decision | NoImplementationError


def per_platform(
    operands: Any, branches: Mapping[str, Callable[[Any], Any]], warnings_when_lowered: Mapping[str, str] | None = None
) -> Any:
    """``branches[p](operands)`` for the platform ``p`` the program is lowered for.

    ``branches`` is keyed by JAX platform name (``cpu``, ``cuda``, ``rocm``, ``tpu``) and
    optionally ``default``; every branch must return the same shapes and dtypes, and sees only
    ``operands`` (a traced value it closes over is an error). The first branch is traced now and
    gives the results' shapes; each other one is traced when the program is lowered for one of
    its platforms, and a difference in shapes is a TypeError then. ``warnings_when_lowered`` maps
    platform names to a ``RuntimeWarning`` issued when the program is lowered for them.
    Differentiating through it (only higher-order gradients do, for the dispatcher)
    differentiates the branches inside ``jax.lax.platform_dependent``, without the per-branch
    lowering (nor the warnings); a branch JAX cannot differentiate (a Pallas kernel) then raises
    only if the program is lowered for its platforms.
    """
    warn = tuple(sorted((warnings_when_lowered or {}).items()))

    @jax.custom_jvp
    def select(operands):
        return _bind_per_platform(operands, branches, warn)

    @select.defjvp
    def select_jvp(primals, tangents):
        return jax.lax.platform_dependent(primals[0], tangents[0], **_differentiated(branches, primals[0], tangents[0]))

    return select(operands)


def _differentiated(branches: Mapping[str, Callable], operands: Any, tangents: Any) -> dict[str, Callable]:
    """The JVP of each branch, or, where JAX cannot differentiate one, a branch that refuses to lower."""
    jvps: dict[Callable, Callable] = {}
    failures: dict[Callable, Exception] = {}
    shape = None
    for function in dict.fromkeys(branches.values()):
        jvp = functools.partial(_jvp, function)
        try:
            shape = jax.eval_shape(jvp, operands, tangents)
        except Exception as error:  # noqa: BLE001 - recorded, raised when lowering for its platforms
            failures[function] = error
        else:
            jvps[function] = jvp
    if not jvps:
        raise next(iter(failures.values()))
    for function, error in failures.items():
        platforms = tuple(name for name, f in branches.items() if f is function)
        message = f"lowering for {', '.join(platforms)}: JAX cannot differentiate this platform's branch: {error!r}"
        jvps[function] = functools.partial(_cannot_lower, NotImplementedError, message, shape)
    return {name: jvps[function] for name, function in branches.items()}


def _jvp(function: Callable, operands: Any, tangents: Any) -> Any:
    return jax.jvp(function, (operands,), (tangents,))


@dataclasses.dataclass(frozen=True, eq=False)
class _Deferred:
    """A branch not traced yet: ``function`` of the flat operands, returning the flat results."""

    function: Callable[..., list[Any]]

    def trace(self, avals: Sequence[Any], out_avals: Sequence[Any]) -> ClosedJaxpr:
        """Its jaxpr for operands ``avals``; a TypeError when its results differ from ``out_avals``."""
        jaxpr = jax.make_jaxpr(self.function)(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))
        _check_same_types(out_avals, jaxpr.out_avals)
        return jaxpr


Branch = ClosedJaxpr | _Deferred


def _bind_per_platform(operands: Any, branches: Mapping[str, Callable[[Any], Any]], warn: tuple[tuple[str, str], ...]) -> Any:
    leaves, in_tree = jax.tree.flatten(operands)
    functions: list[Callable] = []
    table = []
    for platform, function in branches.items():
        if function not in functions:
            functions.append(function)
        table.append((platform, functions.index(function)))
    first, out_shape = jax.make_jaxpr(lambda *leaves: functions[0](jax.tree.unflatten(in_tree, leaves)), return_shape=True)(*leaves)
    if any(isinstance(const, jax.core.Tracer) for const in first.consts):
        raise ValueError("per_platform: a branch closes over a traced value; pass it in the operands")
    out_tree = jax.tree.structure(out_shape)

    def deferred(function: Callable) -> _Deferred:
        def flat(*leaves: Any) -> list[Any]:
            results = function(jax.tree.unflatten(in_tree, leaves))
            if jax.tree.structure(results) != out_tree:
                raise TypeError(f"per_platform: the branches return different structures: {jax.tree.structure(results)} and {out_tree}")
            return jax.tree.leaves(results)
        return _Deferred(flat)

    traced = (first, *(deferred(function) for function in functions[1:]))
    results = _per_platform_p.bind(*leaves, branches=traced, table=tuple(table), warn=warn)
    return jax.tree.unflatten(out_tree, results)


def _check_same_types(expected: Sequence[Any], got: Sequence[Any]) -> None:
    # Shapes and dtypes must agree; the avals' shardings may not (a branch traced for one shard of
    # a partitioned call may name the mesh, a Pallas kernel's results never do).
    if [(a.shape, a.dtype) for a in expected] != [(a.shape, a.dtype) for a in got]:
        raise TypeError(f"per_platform: the branches return different shapes or dtypes: {list(expected)} and {list(got)}")


def _branch(branches: tuple[Branch, ...], table: tuple[tuple[str, int], ...], platform: str) -> Branch:
    indices = dict(table)
    index = indices.get(platform, indices.get("default"))
    if index is None:
        raise NotImplementedError(f"per_platform: no branch for platform {platform!r} and no default (branches: {sorted(indices)})")
    return branches[index]


_per_platform_p = Primitive("tops_per_platform")
_per_platform_p.multiple_results = True


@_per_platform_p.def_abstract_eval
def _abstract_eval(*avals, branches, table, warn):
    return branches[0].out_avals


@_per_platform_p.def_impl
def _run_eagerly(*args, branches, table, warn):
    # Compiled where the arguments are, so the lowering picks the branch, as under jit.
    return jax.jit(functools.partial(_per_platform_p.bind, branches=branches, table=table, warn=warn))(*args)


def _lower(ctx, *args, branches, table, warn, platform):
    if platform in dict(warn):
        warnings.warn(dict(warn)[platform], RuntimeWarning, stacklevel=2)
    branch = _branch(branches, table, platform)
    if isinstance(branch, _Deferred):
        branch = branch.trace(ctx.avals_in, ctx.avals_out)
    # JAX narrows ctx to this platform, so what the branch holds is lowered for it alone.
    return mlir.lower_fun(jaxpr_as_fun(branch), multiple_results=True)(ctx, *args)


for _name in sorted({name for names in JAX_PLATFORM_NAMES.values() for name in names}):
    mlir.register_lowering(_per_platform_p, functools.partial(_lower, platform=_name), platform=_name)


def _batch(args, dims, *, branches, table, warn):
    in_axes = [None if d is None else 0 for d in dims]
    args = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims)]
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]

    def batched(branch: Branch) -> Branch:
        if isinstance(branch, _Deferred):
            return _Deferred(jax.vmap(branch.function, in_axes=in_axes, out_axes=0))
        return jax.make_jaxpr(jax.vmap(jaxpr_as_fun(branch), in_axes=in_axes, out_axes=0))(*shapes)

    results = _per_platform_p.bind(*args, branches=tuple(map(batched, branches)), table=table, warn=warn)
    return results, [0] * len(results)


batching.primitive_batchers[_per_platform_p] = _batch


def stage_per_platform(
    choices: Mapping[str, Choice], run: Callable[[Decision, Any], Any], operands: Any, expected: Callable[[], Any]
) -> Any:
    """``run(decision, operands)`` with the decision of the platform the program is lowered for.

    ``choices`` maps call-spec platforms to their decision, or to the error selection raised for
    them; platforms whose decisions agree (same implementation and config) share one branch, and
    when all agree nothing is staged. ``expected()`` gives the result's shapes and dtypes (a pytree
    of ``ShapeDtypeStruct``): a platform nothing supports gets a branch of that shape whose
    lowering raises its ``NoImplementationError``. A forced implementation's fallback
    (``Decision.fallback``) is warned about now when it is the same everywhere, else when the
    program is lowered for a platform where it happens.
    """
    groups: list[tuple[Choice, list[str]]] = []
    for platform, choice in choices.items():
        same = next((platforms for other, platforms in groups if same_choice(other, choice)), None)
        if same is None:
            groups.append((choice, [platform]))
        else:
            same.append(platform)
    if len(groups) == 1 and isinstance(groups[0][0], Decision):
        decision = groups[0][0]
        if decision.fallback:
            warnings.warn(decision.fallback, RuntimeWarning, stacklevel=5)
        return run(decision, operands)
    branches, warn = {}, {}
    for choice, platforms in groups:
        names = [name for platform in platforms for name in JAX_PLATFORM_NAMES[platform]]
        if isinstance(choice, Decision):
            branch = functools.partial(run, choice)
            warn.update({name: choices[p].fallback for p in platforms for name in JAX_PLATFORM_NAMES[p] if choices[p].fallback})
        else:
            message = f"lowering for {', '.join(platforms)}: {choice}"
            branch = functools.partial(_cannot_lower, NoImplementationError, message, expected())
        branches.update({name: branch for name in names})
    return per_platform(operands, branches, warn)


def same_choice(a: Choice, b: Choice) -> bool:
    """Whether two choices are the same implementation with the same config (so they stage one branch)."""
    if isinstance(a, Decision) and isinstance(b, Decision):
        return a.implementation is b.implementation and a.config == b.config
    return False


_cannot_lower_p = Primitive("tops_cannot_lower")
_cannot_lower_p.multiple_results = True
_cannot_lower_p.def_abstract_eval(lambda *, error, message, avals: avals)


def _refuse_to_lower(ctx, *, error, message, avals):
    raise error(message)


mlir.register_lowering(_cannot_lower_p, _refuse_to_lower)


def _cannot_lower(error: type[Exception], message: str, expected: Any, *operands: Any) -> Any:
    """Results shaped like ``expected`` (a pytree of ``ShapeDtypeStruct``) whose lowering raises ``error(message)``."""
    leaves, tree = jax.tree.flatten(expected)
    avals = tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in leaves)
    return jax.tree.unflatten(tree, _cannot_lower_p.bind(error=error, message=message, avals=avals))
