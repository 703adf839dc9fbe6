"""Selection policy: which implementation a user forces, denies, and how strict dispatch is.

Three sources, strongest first: an ``implementation=`` argument on the call, the innermost
``tops_core.use(...)`` context, then environment variables:

- ``TOPS_FORCE="simple_gla=xla.chunk,kda=ref.recurrent"``: force per op;
- ``TOPS_DENY="tpu_pallas.*"``: never select these (names or shell patterns);
- ``TOPS_STRICT=1``: never fall back past the forced or the highest-priority implementation;
- ``TOPS_INTERPRET=1``: accept TPU kernels off TPU, run in Pallas' TPU interpreter.

The policy is read when a call is traced: at every eager call, and when ``jax.jit`` traces a
function. The scope of ``use`` is a JAX user context (``jax.make_user_context``), part of jit's
tracing and compilation cache keys, so a function jitted before a ``use`` block is traced again
inside it and runs the block's choice, and after it the old one. The environment is not part of
those keys: a function already traced keeps the choice it was traced with when ``os.environ``
changes later; eager calls and new traces see the change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax

from tops_core import environment
from tops_core.registry import default_registry
from tops_core.signatures import known_op

ForceRequest = str | tuple[str, Mapping[str, Any]] | None


@dataclasses.dataclass(frozen=True)
class Force:
    """An implementation the user asked for, with config overrides, and where the request came from."""

    implementation: str
    config: tuple[tuple[str, Any], ...] = ()
    source: str = "argument"

    @classmethod
    def parse(cls, request: ForceRequest, source: str) -> Force | None:
        if request is None:
            return None
        if isinstance(request, str):
            return cls(request, (), source)
        if (
            isinstance(request, tuple)
            and len(request) == 2
            and isinstance(request[0], str)
            and isinstance(request[1], Mapping)
        ):
            config = tuple(sorted(request[1].items()))
            try:
                hash(config)
            except TypeError:
                raise TypeError(f"config overrides for {request[0]!r} must be hashable values, got {request[1]!r}") from None
            return cls(request[0], config, source)
        raise TypeError(
            "an implementation must be given as a name such as 'xla.chunk' or as "
            f"(name, {{config overrides}}), got {request!r}"
        )

    def describe(self) -> str:
        overrides = ", ".join(f"{k}={v!r}" for k, v in self.config)
        return f"{self.implementation}({overrides})" if overrides else self.implementation


@dataclasses.dataclass(frozen=True)
class Policy:
    """The resolved policy for one op; hashable, so it can key the decision cache."""

    force: Force | None = None
    deny: frozenset[str] = frozenset()
    strict: bool = False
    interpret: bool = False

    def denies(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.deny)


@dataclasses.dataclass(frozen=True)
class _Scope:
    forces: tuple[tuple[str, Force], ...] = ()
    deny: frozenset[str] = frozenset()
    strict: bool | None = None
    interpret: bool | None = None


_scope = jax.make_user_context(_Scope())
"""The innermost ``use`` block's scope; its value keys jit's caches (see the module docstring)."""


@contextlib.contextmanager
def use(
    *,
    deny: Iterable[str] | None = None,
    strict: bool | None = None,
    interpret: bool | None = None,
    **ops: ForceRequest,
) -> Iterator[None]:
    """Force implementations per op and set policy flags inside a ``with`` block.

    ``tops_core.use(simple_gla="xla.chunk")``, with config overrides
    ``tops_core.use(simple_gla=("tpu_pallas.fused", {"num_steps": 2}))``; ``None`` lifts an
    outer force. Deny patterns accumulate with outer scopes (each must match a registered
    implementation); flags left ``None`` are inherited.

    It applies to every call run inside the block, jitted or not: the scope is part of
    ``jax.jit``'s cache keys, so a function jitted and run before the block is traced again for
    it, and runs its earlier choice again after it.
    """
    outer = _scope.value
    forces = dict(outer.forces)
    for op_name, request in ops.items():
        known_op(op_name, "tops_core.use()")
        force = Force.parse(request, "tops_core.use()")
        if force is None:
            forces.pop(op_name, None)
        else:
            forces[op_name] = force
    if isinstance(deny, str):
        deny = [deny]
    inner = _Scope(
        forces=tuple(sorted(forces.items())),
        deny=outer.deny | deny_patterns(deny or (), "tops_core.use(deny=...)"),
        strict=outer.strict if strict is None else bool(strict),
        interpret=outer.interpret if interpret is None else bool(interpret),
    )
    with _scope(inner):
        yield


def deny_patterns(patterns: Iterable[str], source: str) -> frozenset[str]:
    """Deny patterns (names or shell patterns such as ``tpu_pallas.*``) as a set; a ValueError naming
    ``source``, the pattern and the registered names when one matches no implementation of any op.

    Any op: ``TOPS_DENY="tpu_pallas.*"`` holds for every op, also one that has no such kernel.
    """
    patterns = frozenset(patterns)
    if not patterns:
        return patterns
    if not all(isinstance(pattern, str) for pattern in patterns):
        raise TypeError(f"{source}: deny patterns must be strings, got {sorted(patterns, key=repr)!r}")
    names = sorted({impl.name for impl in default_registry().all_implementations()})
    for pattern in sorted(patterns):
        if not fnmatch.filter(names, pattern):
            raise ValueError(
                f"{source}: deny pattern {pattern!r} matches no registered implementation; registered: {', '.join(names) or 'none'}"
            )
    return patterns


def _env_force(op_name: str) -> Force | None:
    forces = {}
    for item in environment.names("TOPS_FORCE"):
        key, sep, impl = item.partition("=")
        if not sep or not key.strip() or not impl.strip():
            raise ValueError(f"TOPS_FORCE entries must look like 'op=plugin.impl', got {item!r}")
        name = known_op(key.strip(), "TOPS_FORCE").name
        if name in forces:
            raise ValueError(f"TOPS_FORCE names {name} twice ({forces[name]} and {impl.strip()}); force one implementation per op")
        forces[name] = impl.strip()
    return Force(forces[op_name], (), "TOPS_FORCE") if op_name in forces else None


def interpret_enabled() -> bool:
    """Whether interpret mode is on in the current scope (``use(interpret=...)``, else TOPS_INTERPRET)."""
    scope = _scope.value
    return scope.interpret if scope.interpret is not None else environment.flag("TOPS_INTERPRET")


def current_policy(op_name: str, implementation: ForceRequest = None) -> Policy:
    """Resolve the policy for one call of ``op_name``."""
    scope = _scope.value
    force = Force.parse(implementation, "argument")
    if force is None:
        force = dict(scope.forces).get(op_name)
    if force is None:
        force = _env_force(op_name)
    return Policy(
        force=force,
        deny=scope.deny | deny_patterns(environment.names("TOPS_DENY"), "TOPS_DENY"),
        strict=scope.strict if scope.strict is not None else environment.flag("TOPS_STRICT"),
        interpret=interpret_enabled(),
    )
