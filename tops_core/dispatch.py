"""The dispatcher: pick the best implementation for a call spec under a policy, and say why."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from tops_core.callspec import CallSpec
from tops_core.implementation import Implementation
from tops_core.policy import Policy

DIRECTIONS = ("forward", "backward")


class NoImplementationError(RuntimeError):
    """No registered implementation supports the call (or the policy forbids the ones that do)."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One implementation as the dispatcher saw it for one call."""

    name: str
    reasons: tuple[str, ...]
    priority: int
    why_priority: str
    interpreted: bool

    @property
    def supported(self) -> bool:
        return not self.reasons


@dataclasses.dataclass(frozen=True)
class Decision:
    """The outcome of selection, able to explain itself."""

    op: str
    direction: str
    spec: CallSpec
    policy: Policy
    candidates: tuple[Candidate, ...]
    implementation: Implementation
    config: Any
    decided_by: str
    notes: tuple[str, ...] = ()
    fallback: str | None = None  # why a forced implementation was passed over (a RuntimeWarning)

    @property
    def interpreted(self) -> bool:
        return self.implementation.capabilities.interpreted(self.spec)

    def explain(self) -> str:
        lines = [f"{self.op} {self.direction}: {self.spec.describe()}", f"  policy: {describe_policy(self.policy)}"]
        lines += _candidate_lines(self.candidates, winner=self.implementation.name)
        label = self.implementation.name + (" [interpreted]" if self.interpreted else "")
        if self.config is not None:
            label += f" with {self.config!r}"
        lines.append(f"  selected: {label}")
        if self.config is not None and self.implementation.explain_config is not None:
            lines.append(f"  for this call: {self.implementation.explain_config(self.config, self.spec, self.direction)}")
        lines.append(f"  decided by: {self.decided_by}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    __str__ = explain


def pairing_note(forward: Decision, backward: Decision) -> str | None:
    """A line saying that a forward-only implementation is paired with another's backward, or that a forward hands its
    own backward its residuals (``Implementation.residuals``)."""
    same = forward.implementation is backward.implementation and forward.config == backward.config
    if same and forward.implementation.residuals:
        return (
            f"residuals: under grad or vjp {forward.implementation.name}'s backward takes whatever its own forward hands "
            "on (Implementation.residuals) rather than recomputing it; op.backward called on its own recomputes it"
        )
    if forward.implementation.backward is not None or forward.implementation is backward.implementation:
        return None
    return (
        f"pairing: {forward.implementation.name} is forward-only; gradients come from "
        f"{backward.implementation.name}'s backward, which recomputes from the original inputs"
    )


def describe_policy(policy: Policy) -> str:
    force = f"{policy.force.describe()} (from {policy.force.source})" if policy.force else "none"
    deny = ", ".join(sorted(policy.deny)) or "none"
    return (
        f"force={force}; deny={deny}; strict={'on' if policy.strict else 'off'}; "
        f"interpret={'on' if policy.interpret else 'off'}"
    )


def _candidate_lines(candidates: tuple[Candidate, ...], winner: str | None) -> list[str]:
    lines = ["  candidates (best first):"]
    width = max((len(c.name) for c in candidates), default=0)
    for c in candidates:
        marker = "*" if c.name == winner else ("-" if c.supported else "x")
        if c.supported:
            tag = " [interpreted]" if c.interpreted else ""
            lines.append(f"    {marker} {c.name:<{width}}  priority {c.priority} ({c.why_priority}){tag}")
        else:
            lines.append(f"    {marker} {c.name:<{width}}  rejected: {'; '.join(c.reasons)}")
    return lines


def _order(candidates: list[Candidate]) -> tuple[Candidate, ...]:
    return tuple(sorted(candidates, key=lambda c: (not c.supported, -c.priority, c.name)))


def no_implementation_message(
    op: str, direction: str, spec: CallSpec, policy: Policy, candidates: tuple[Candidate, ...], headline: str
) -> str:
    """The one formatter for every "nothing (allowed) supports this call" error."""
    lines = [f"{headline}", f"  call: {op} {direction}: {spec.describe()}", f"  policy: {describe_policy(policy)}"]
    if candidates:
        lines += _candidate_lines(candidates, winner=None)
    else:
        lines.append(f"  no implementations of {op} are registered (see `tops plugins`)")
    return "\n".join(lines)


def select(
    implementations: list[Implementation], spec: CallSpec, direction: str, policy: Policy, warn: bool = True
) -> Decision:
    """Choose an implementation of ``spec.op`` for ``direction`` under ``policy`` (uncached).

    ``warn=False`` leaves warning about a forced implementation's fallback to the caller
    (``Decision.fallback``): a traced call warns only where its program is lowered.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    by_name = {impl.name: impl for impl in implementations}
    candidates = []
    for impl in implementations:
        reasons = impl.reasons(spec, direction)
        if policy.denies(impl.name):
            reasons.append("denied by policy")
        priority, why = impl.rank(spec)
        candidates.append(Candidate(impl.name, tuple(reasons), priority, why, impl.capabilities.interpreted(spec)))
    candidates = _order(candidates)
    by_candidate = {c.name: c for c in candidates}

    def fail(headline: str) -> NoImplementationError:
        return NoImplementationError(no_implementation_message(spec.op, direction, spec, policy, candidates, headline))

    def decision(name: str, decided_by: str, config: Any = None, notes: tuple[str, ...] = ()) -> Decision:
        impl = by_name[name]
        config = config if config is not None else impl.config
        return Decision(spec.op, direction, spec, policy, candidates, impl, config, decided_by, notes, fallback)

    notes: tuple[str, ...] = ()
    fallback = None
    force = policy.force
    if force is not None:
        if force.implementation not in by_name:
            raise ValueError(
                f"unknown implementation {force.implementation!r} for {spec.op} (forced by {force.source}); "
                f"registered: {', '.join(sorted(by_name)) or 'none'}"
            )
        forced = by_name[force.implementation]
        if direction == "backward" and forced.backward is None:
            notes = (f"the forced {forced.name} is forward-only; its backward is chosen by priority",)
        else:
            config = forced.configure(force.config)
            candidate = by_candidate[forced.name]
            if candidate.supported:
                return decision(forced.name, f"forced by {force.source}", config)
            if policy.strict:
                raise fail(f"the forced implementation {forced.name} does not support this call, and strict mode forbids falling back")
            notes = (f"the forced {forced.name} does not support this call ({'; '.join(candidate.reasons)}); fell back by priority",)
            fallback = f"tops: {notes[0]}"
            if warn:
                warnings.warn(fallback, RuntimeWarning, stacklevel=4)

    supported = [c for c in candidates if c.supported]
    if not supported:
        raise fail(f"no implementation of {spec.op} supports this {direction} call")
    best = supported[0]
    if policy.strict:
        eligible = [
            c for c in candidates
            if by_name[c.name].capabilities.runs_on(spec)
            and (direction == "forward" or by_name[c.name].backward is not None)
            and not policy.denies(c.name)
        ]
        top = min(eligible, key=lambda c: (-c.priority, c.name), default=best)  # the candidates' own order
        if not top.supported:
            raise fail(
                f"strict mode: the highest-priority implementation on {spec.platform}, {top.name}, does not support "
                f"this call, and strict mode forbids falling back to {best.name}"
            )
    runners_up = supported[1:]
    decided_by = f"highest priority ({best.why_priority})"
    if runners_up:
        decided_by += " over " + ", ".join(f"{c.name} ({c.priority})" for c in runners_up)
    else:
        decided_by += "; the only implementation that supports this call"
    return decision(best.name, decided_by, notes=notes)
