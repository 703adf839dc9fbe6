"""What a plugin registers: one implementation of one op."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

from tops_core.callspec import PLATFORMS, CallSpec
from tops_core.capabilities import Capabilities

Priority = Mapping[str, int] | Callable[[CallSpec], tuple[int, str]]
"""Either a per-platform table (``{"tpu": 200, "cpu": 10}``; missing platforms rank 0), or a
function of the call spec returning ``(priority, why)`` for choices that depend on the shape."""

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclasses.dataclass(frozen=True, eq=False)
class Implementation:
    """One implementation of an op, as a plugin registers it.

    ``forward`` and ``backward`` follow the op's ``Forward`` and ``Backward`` protocols (see
    ``tops_core.ops.simple_gla``); ``backward=None`` declares a forward-only kernel, which the
    dispatcher pairs with another implementation's backward. ``config`` is a frozen dataclass
    instance of tuning knobs (chunk size, ``num_steps`` ...) passed to both as ``config=``; users
    override fields when forcing the implementation; ``config_sweep`` lists further overrides
    the conformance kit also checks (say ``({"chunk_size": 128},)``). ``explain_config(config, spec,
    direction)``, when given, returns one line on what the config's per-call fields (those left
    None to be decided per call) come to for this call and direction; ``explain`` prints it under
    the selection. ``name`` is the plugin-local name; the registry qualifies it as ``<plugin>.<name>``.

    ``serves_pools``: the forward takes a state-pool call as it comes (``initial_state`` the pool
    ``[P, ...]``, ``ssm_state_indices=`` passed as a keyword) and returns the updated pool, reading and
    writing the rows in place. For every other implementation the core gathers the rows into a dense
    call and writes the final states back (``tops_core.ops.pool``). Backwards always get the dense call.

    ``residuals``: the forward, passed ``residuals=True``, returns ``(outputs, residuals)``: a dict of arrays, each
    ``[B, HV, ...]`` (batch and value heads first; ``{}`` where the call gains nothing), which the backward then takes
    as ``residuals=`` rather than recomputing them. The core passes them where this implementation runs both
    directions of a differentiated call (``grad``, ``vjp``); a backward called on its own (``op.backward``), or paired
    with another forward, gets none and recomputes (``OpContract.kept_residuals``).
    """

    op: str
    name: str
    forward: Callable[..., Any]
    backward: Callable[..., Any] | None = None
    capabilities: Capabilities = Capabilities()
    priority: Priority = dataclasses.field(default_factory=dict)
    config: Any = None
    config_sweep: tuple[Mapping[str, Any], ...] = ()
    explain_config: Callable[[Any, CallSpec, str], str] | None = None
    description: str = ""
    serves_pools: bool = False
    residuals: bool = False

    def reasons(self, spec: CallSpec, direction: str) -> list[str]:
        """Why this implementation cannot serve the call in ``direction``; empty when it can."""
        reasons = self.capabilities.reasons(spec)
        if direction == "backward" and self.backward is None:
            reasons.insert(0, "forward only (no backward)")
        elif direction == "backward":
            reasons += self.capabilities.backward_reasons(spec)
        return reasons

    def rank(self, spec: CallSpec) -> tuple[int, str]:
        """The priority of this implementation for the call, and why."""
        if callable(self.priority):
            value, why = self.priority(spec)
            return int(value), why
        platform = "tpu" if self.capabilities.interpreted(spec) else spec.platform
        value = int(self.priority.get(platform, 0))
        return value, f"declared priority {value} on {platform}"

    def configure(self, overrides: tuple[tuple[str, Any], ...]) -> Any:
        """The default config with user overrides applied; unknown fields are a TypeError."""
        if not overrides:
            return self.config
        if self.config is None:
            raise TypeError(f"{self.name} takes no config, got overrides {dict(overrides)}")
        fields = {f.name for f in dataclasses.fields(self.config)}
        unknown = sorted(set(dict(overrides)) - fields)
        if unknown:
            raise TypeError(f"{self.name} config has no field(s) {unknown}; fields: {sorted(fields)}")
        return dataclasses.replace(self.config, **dict(overrides))

    def check(self, op_features: frozenset[str], op_ndims: frozenset[str]) -> None:
        """Raise TypeError/ValueError when the declaration is malformed."""
        local = self.name.rsplit(".", 1)[-1]
        if not _NAME.match(local):
            raise ValueError(f"implementation name must match {_NAME.pattern}, got {self.name!r}")
        if not callable(self.forward):
            raise TypeError(f"{self.name}: forward must be callable, got {self.forward!r}")
        if self.backward is not None and not callable(self.backward):
            raise TypeError(f"{self.name}: backward must be callable or None, got {self.backward!r}")
        if not isinstance(self.capabilities, Capabilities):
            raise TypeError(f"{self.name}: capabilities must be a tops_core.Capabilities, got {type(self.capabilities).__name__}")
        unknown = self.capabilities.features - op_features
        if unknown:
            raise ValueError(f"{self.name}: unknown features {sorted(unknown)} for op {self.op}; known: {sorted(op_features)}")
        unknown = {name for name, _ in self.capabilities.ndims} - op_ndims
        if unknown:
            raise ValueError(f"{self.name}: ndims declared for {sorted(unknown)}, but op {self.op} has variable rank only for {sorted(op_ndims)}")
        if not callable(self.priority):
            if not isinstance(self.priority, Mapping):
                raise TypeError(f"{self.name}: priority must be a mapping platform -> int or a callable")
            for platform, value in self.priority.items():
                if platform not in PLATFORMS or not isinstance(value, int) or isinstance(value, bool):
                    raise ValueError(f"{self.name}: priority entries must be platform -> int with platform in {PLATFORMS}, got {platform!r}: {value!r}")
        if self.config is not None and not (
            dataclasses.is_dataclass(self.config)
            and not isinstance(self.config, type)
            and type(self.config).__dataclass_params__.frozen
        ):
            raise TypeError(f"{self.name}: config must be a frozen dataclass instance or None, got {self.config!r}")
        for overrides in self.config_sweep:
            self.configure(tuple(sorted(overrides.items())))
        if self.explain_config is not None and (self.config is None or not callable(self.explain_config)):
            raise TypeError(f"{self.name}: explain_config must be a callable, and needs a config to explain, got {self.explain_config!r}")
