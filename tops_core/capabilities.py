"""Capabilities: what an implementation supports, declared as data and matched against a call spec.

Matching returns human-readable reasons; an empty list means the call is supported. The same
declarations drive the CLI's support matrix and the conformance kit's case grid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from tops_core.callspec import PLATFORMS, CallSpec

FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


@dataclasses.dataclass(frozen=True)
class DimRule:
    """An accepted head dimension: ``min <= d <= max`` and ``d % multiple_of == 0``."""

    min: int = 1
    max: int | None = None
    multiple_of: int = 1

    def accepts(self, value: int) -> bool:
        return (
            value >= self.min
            and (self.max is None or value <= self.max)
            and value % self.multiple_of == 0
        )

    def describe(self) -> str:
        if self.min <= 1 and self.max is None and self.multiple_of == 1:
            return "any"
        parts = []
        if self.min > 1 or self.max is not None:
            parts.append(f"{self.min}..{self.max if self.max is not None else ''}")
        if self.multiple_of > 1:
            parts.append(f"multiple of {self.multiple_of}")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What an implementation supports.

    ``platforms``: where it runs natively. ``interpretable``: a TPU kernel that also runs off TPU
    in Pallas' TPU interpreter when interpret mode is on. ``features``: the optional inputs and
    options it accepts (see ``CallSpec.features``); ``requires``: features it cannot do without.
    ``ndims``: accepted ranks per input whose rank may vary, e.g. ``{"g_gamma": {1}}``.
    ``predicate``: anything else; returns a reason string to reject, ``None`` to accept.
    ``backward_predicate``: the same for the backward alone, where its kernels serve fewer calls than the
    forward's (a chip its compiler rejects them on): its reason leaves the forward selectable.
    Whether it has a backward is not declared here: it is whether the implementation has one.
    """

    platforms: frozenset[str] = frozenset(PLATFORMS)
    interpretable: bool = False
    dtypes: frozenset[str] = frozenset(("bfloat16", "float16", "float32"))
    features: frozenset[str] = frozenset()
    requires: frozenset[str] = frozenset()
    ndims: tuple[tuple[str, frozenset[int]], ...] = ()
    key_dim: DimRule = DimRule()
    value_dim: DimRule = DimRule()
    deterministic: bool = True
    predicate: Callable[[CallSpec], str | None] | None = None
    backward_predicate: Callable[[CallSpec], str | None] | None = None

    def __post_init__(self):
        for name in ("platforms", "dtypes", "features", "requires"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"Capabilities.{name} must be a collection of names, got the string {value!r}")
            object.__setattr__(self, name, frozenset(value))
        unknown = self.platforms - set(PLATFORMS)
        if unknown:
            raise ValueError(f"Capabilities.platforms has unknown platforms {sorted(unknown)}; known: {PLATFORMS}")
        unknown = self.dtypes - set(FLOAT_DTYPES)
        if unknown:
            raise ValueError(f"Capabilities.dtypes has unknown dtypes {sorted(unknown)}; known: {FLOAT_DTYPES}")
        if not self.requires <= self.features:
            raise ValueError("Capabilities.requires must be a subset of Capabilities.features")
        ndims = self.ndims.items() if isinstance(self.ndims, Mapping) else self.ndims
        object.__setattr__(self, "ndims", tuple(sorted((k, frozenset(v)) for k, v in ndims)))
        if self.interpretable and "tpu" not in self.platforms:
            raise ValueError("Capabilities.interpretable only makes sense for a TPU kernel")

    def runs_on(self, spec: CallSpec) -> bool:
        """True when the call's platform (or interpret mode) lets this implementation run."""
        return spec.platform in self.platforms or self.interpreted(spec)

    def interpreted(self, spec: CallSpec) -> bool:
        """True when this call would run the implementation in Pallas' TPU interpreter."""
        return spec.platform != "tpu" and self.interpretable and spec.interpret

    def reasons(self, spec: CallSpec) -> list[str]:
        """Why this call is not supported; empty when it is."""
        reasons = []
        if not self.runs_on(spec):
            reason = f"runs on {_names(self.platforms)}, this call is on {spec.platform}"
            if self.interpretable:
                reason += " (interpret mode is off; TOPS_INTERPRET=1 runs it in Pallas' TPU interpreter)"
            reasons.append(reason)
        if spec.dtype not in self.dtypes:
            reasons.append(f"dtype {spec.dtype} not supported (supports {_names(self.dtypes)})")
        for feature in sorted(spec.features - self.features):
            reasons.append(f"does not support {feature}")
        for feature in sorted(self.requires - spec.features):
            reasons.append(f"requires {feature}")
        for name, accepted in self.ndims:
            ndim = spec.ndim(name)
            if ndim is not None and ndim not in accepted:
                reasons.append(f"{name}.ndim={ndim} not supported (supports ndim {_names(accepted)})")
        if not self.key_dim.accepts(spec.key_dim):
            reasons.append(f"K={spec.key_dim} not supported (K: {self.key_dim.describe()})")
        if not self.value_dim.accepts(spec.value_dim):
            reasons.append(f"V={spec.value_dim} not supported (V: {self.value_dim.describe()})")
        if self.predicate is not None:
            reason = self.predicate(spec)
            if reason:
                reasons.append(reason)
        return reasons

    def backward_reasons(self, spec: CallSpec) -> list[str]:
        """Why the backward alone cannot serve this call (``backward_predicate``); empty when it can."""
        reason = self.backward_predicate(spec) if self.backward_predicate is not None else None
        return [f"backward: {reason}"] if reason else []

    def accepted_ndims(self, name: str) -> frozenset[int] | None:
        return dict(self.ndims).get(name)


def _names(values: Iterable) -> str:
    return ", ".join(str(v) for v in sorted(values))
