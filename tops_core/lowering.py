"""Code chosen by the platform a program is lowered for, and the dispatcher's use of it.

A traced call (under ``jit``, ``grad`` or ``vmap``, or traced from abstract inputs for
ahead-of-time lowering) can end up compiled for any platform: a training step lowered on a CPU
host for a TPU, a function exported with ``jax.export(..., platforms=("tpu",))``. Its inputs carry
no device, so the dispatcher decides once per platform and stages the winners out with
``per_platform``; the lowering keeps the branch of the platform it lowers for, so a TPU kernel is
never lowered for a CPU and the CPU's choice never reaches a TPU.

``per_platform`` is ``jax.lax.platform_dependent`` with one difference: each branch is lowered
for its own platforms only. ``platform_dependent`` lowers every kept branch for every platform of
a multi-platform lowering (``jax.export(..., platforms=("cpu", "tpu"))``), and a compiled Pallas
TPU kernel has no CPU lowering, so the CPU half of such an export would fail on the TPU branch.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
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
    ``operands`` (a traced value it closes over is an error). ``warnings_when_lowered`` maps
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


def _bind_per_platform(operands: Any, branches: Mapping[str, Callable[[Any], Any]], warn: tuple[tuple[str, str], ...]) -> Any:
    leaves, in_tree = jax.tree.flatten(operands)
    functions: list[Callable] = []
    table = []
    for platform, function in branches.items():
        if function not in functions:
            functions.append(function)
        table.append((platform, functions.index(function)))
    jaxprs, out_trees = [], []
    for function in functions:
        jaxpr, out_shape = jax.make_jaxpr(lambda *leaves: function(jax.tree.unflatten(in_tree, leaves)), return_shape=True)(*leaves)
        if any(isinstance(const, jax.core.Tracer) for const in jaxpr.consts):
            raise ValueError("per_platform: a branch closes over a traced value; pass it in the operands")
        jaxprs.append(jaxpr)
        out_trees.append(jax.tree.structure(out_shape))
    # Shapes and dtypes must agree; the avals' shardings may not (a branch traced for one shard of
    # a partitioned call may name the mesh, a Pallas kernel's results never do).
    types = [[(aval.shape, aval.dtype) for aval in jaxpr.out_avals] for jaxpr in jaxprs]
    if any(tree != out_trees[0] for tree in out_trees) or any(t != types[0] for t in types):
        raise TypeError(f"per_platform: the branches return different shapes or dtypes: {[j.out_avals for j in jaxprs]}")
    results = _per_platform_p.bind(*leaves, branches=tuple(jaxprs), table=tuple(table), warn=warn)
    return jax.tree.unflatten(out_trees[0], results)


def _branch(branches: tuple[ClosedJaxpr, ...], table: tuple[tuple[str, int], ...], platform: str) -> ClosedJaxpr:
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
    # JAX narrows ctx to this platform, so what the branch holds is lowered for it alone.
    return mlir.lower_fun(jaxpr_as_fun(_branch(branches, table, platform)), multiple_results=True)(ctx, *args)


for _name in sorted({name for names in JAX_PLATFORM_NAMES.values() for name in names}):
    mlir.register_lowering(_per_platform_p, functools.partial(_lower, platform=_name), platform=_name)


def _batch(args, dims, *, branches, table, warn):
    in_axes = [None if d is None else 0 for d in dims]
    args = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims)]
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
    batched = tuple(jax.make_jaxpr(jax.vmap(jaxpr_as_fun(b), in_axes=in_axes, out_axes=0))(*shapes) for b in branches)
    results = _per_platform_p.bind(*args, branches=batched, table=table, warn=warn)
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
        same = next((platforms for other, platforms in groups if _same_choice(other, choice)), None)
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


def _same_choice(a: Choice, b: Choice) -> bool:
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
