"""Run one case of the grid against the float64 reference, or check that the matcher rejects it."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import jax

import tops_core
from tops_core.dispatch import NoImplementationError
from tops_core.implementation import Implementation
from tops_core.ops import op
from tops_core.ops.base import platform_of
from tops_core.ops.validation import LayoutWarning
from tops_core.registry import default_registry
from tops_core.conformance import data
from tops_core.conformance.cases import Case
from tops_core.conformance.compare import Measurement, measure, tolerance

REFERENCE = "ref.recurrent"


class ConformanceError(AssertionError):
    """An implementation disagrees with the reference or with its own declarations."""


def interpreted_here(impl: Implementation) -> bool:
    """Whether this machine runs ``impl`` in Pallas' TPU interpreter."""
    return impl.capabilities.interpretable and platform_of([]) != "tpu"


def runnable_here(impl: Implementation) -> str | None:
    """Why ``impl`` cannot run on this machine, or None when it can."""
    platform = platform_of([])
    if platform in impl.capabilities.platforms or interpreted_here(impl):
        return None
    return f"{impl.name} runs on {', '.join(sorted(impl.capabilities.platforms))}; this machine is {platform}"


@contextlib.contextmanager
def _scope(interpret: bool, case: Case) -> Iterator[None]:
    """Strict dispatch (no silent fallback), interpret mode for TPU kernels off TPU, x64 for float64 cases."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(tops_core.use(strict=True, interpret=interpret or None))
        if case.dtype == "float64":
            stack.enter_context(jax.enable_x64(True))
        yield


def _force(impl: Implementation, case: Case):
    return (impl.name, dict(case.config)) if case.config else impl.name


def evaluate(case: Case, implementation, backward: bool, through_vjp: bool = False) -> tuple[tuple, Any]:
    """``(o, final_state)`` and, when ``backward``, the gradients of ``implementation`` (a name, or
    ``(name, config overrides)``) on the case's data; gradients are None otherwise. ``through_vjp``: both by
    ``jax.vjp`` of the forward, the path a training step takes, whose backward gets what the forward hands on
    (``Implementation.residuals``); otherwise by ``forward`` and ``backward`` called on their own."""
    contract = op(case.op)
    inputs = data.forward_inputs(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LayoutWarning)  # the grid's data is time-major, even where T < H
        if through_vjp:
            return _through_vjp(contract, inputs, data.backward_inputs(case, inputs), implementation)
        outputs = contract.forward(**inputs, implementation=implementation)
        grads = contract.backward(**data.backward_inputs(case, inputs), implementation=implementation) if backward else None
    return outputs, grads


def _through_vjp(contract, inputs: dict[str, Any], cotangents: dict[str, Any], implementation) -> tuple[tuple, Any]:
    names = [name for name in contract.differentiable if inputs.get(name) is not None]

    def forward(*arrays):
        return contract.forward(**{**inputs, **dict(zip(names, arrays))}, implementation=implementation)

    outputs, pullback = jax.vjp(forward, *(inputs[name] for name in names))
    gradients = pullback((cotangents["do"], cotangents.get("dht")))
    given = dict(zip(names, gradients))
    return outputs, contract.grads_type(**{"d" + name: given.get(name) for name in contract.differentiable})


def compare(case: Case, got: tuple[tuple, Any], want: tuple[tuple, Any]) -> list[Measurement]:
    """Measure every output, and every gradient both sides have, at the case dtype's tolerance."""
    (got_outputs, got_grads), (want_outputs, want_grads) = got, want
    measurements = [
        measure(name, x, ref, tolerance(case.dtype, gradient=False))
        for name, x, ref in zip(("o", "final_state"), got_outputs, want_outputs) if ref is not None
    ]
    if got_grads is not None and want_grads is not None:
        for field in dataclasses.fields(want_grads):
            ref = getattr(want_grads, field.name)
            if ref is not None:
                measurements.append(measure(field.name, getattr(got_grads, field.name), ref, tolerance(case.dtype, gradient=True)))
    return measurements


@functools.lru_cache(maxsize=64)
def _reference_results(case: Case, reference: Implementation, backward: bool) -> tuple[tuple, Any]:
    """The reference's answer to a case, computed once per process: the grid gives every implementation of an op
    the same cases (the same data, by name), so a worker that checks several of them asks for the same answers.
    Keyed by the registered implementation itself, so a registry that changes it is asked again, and by the case without
    its ``config`` (the checked implementation's settings, which the reference does not take)."""
    with _scope(interpreted_here(reference), case):
        return evaluate(case, reference.name, backward)


def run_case(impl: Implementation, case: Case, reference: str = REFERENCE) -> list[Measurement]:
    """Forward and (where declared) every gradient of ``impl`` against ``reference``; raises ConformanceError."""
    backward = impl.backward is not None
    want = _reference_results(dataclasses.replace(case, config=(), slow=False), default_registry().get(case.op, reference), backward)
    with _scope(interpreted_here(impl), case):
        measurements = compare(case, evaluate(case, _force(impl, case), backward), want)
        # The gradients again, its backward taking what its forward handed on; the config sweep's cases check the configs
        # on op.backward's path alone (the two share every kernel but where the walk's outputs come from).
        if backward and impl.residuals and not case.config:
            through_vjp = compare(case, evaluate(case, _force(impl, case), backward, through_vjp=True), want)
            measurements += [dataclasses.replace(m, name=f"{m.name} (vjp)") for m in through_vjp]
    failures = [m for m in measurements if not m.passed]
    if failures:
        lines = [f"{impl.name} disagrees with {reference} on case {case.name} ({case.dtype}):"]
        lines += [f"  {m.describe()}" for m in measurements]
        raise ConformanceError("\n".join(lines))
    return measurements


def check_rejected(impl: Implementation, case: Case) -> str:
    """The matcher must reject a case outside the declarations before any kernel code runs; returns its reasons."""
    spec = case.spec(platform_of([]), interpreted_here(impl))
    reasons = impl.reasons(spec, "forward")
    if not reasons:
        raise ConformanceError(f"{impl.name} accepts case {case.name}, which lies outside its declared capabilities")
    contract = op(case.op)
    with _scope(interpreted_here(impl), case), warnings.catch_warnings():
        warnings.simplefilter("ignore", LayoutWarning)
        inputs = data.forward_inputs(case)
        try:
            contract.forward(**inputs, implementation=impl.name)
        except NoImplementationError as error:
            if impl.name not in str(error):
                raise ConformanceError(f"the rejection of case {case.name} does not name {impl.name}:\n{error}") from error
            return "; ".join(reasons)
        except Exception as error:
            raise ConformanceError(
                f"case {case.name} reached {impl.name} and failed inside it ({type(error).__name__}: {error}) "
                "instead of being rejected by the matcher"
            ) from error
    raise ConformanceError(f"{impl.name} ran case {case.name}, although its capabilities reject it: {'; '.join(reasons)}")
