"""The tolerance rule: relative RMS error against the float64 reference, per output and gradient.

``error = rms(x - ref) / rms(ref)``, or ``rms(x)`` where the reference is exactly zero. There is
no absolute escape: a float64 result must meet its 1e-10 on its own (docs/ops.md "Tolerances").
"""

from __future__ import annotations

import dataclasses

import numpy as np

TOLERANCES = {
    # input dtype: (outputs and final state, gradients)
    "float64": (1e-10, 1e-9),
    "float32": (1e-5, 5e-5),
    "float16": (1e-3, 2e-3),
    "bfloat16": (5e-3, 1e-2),
}


@dataclasses.dataclass(frozen=True)
class Measurement:
    """How far one output of an implementation is from the reference."""

    name: str
    error: float
    max_abs: float
    tolerance: float
    finite: bool

    @property
    def passed(self) -> bool:
        return self.finite and self.error <= self.tolerance

    def describe(self) -> str:
        if not self.finite:
            return f"{self.name}: NaN or Inf where the reference is finite"
        verdict = "ok" if self.passed else "FAIL"
        return f"{self.name}: relative RMS {self.error:.2e} (tolerance {self.tolerance:.0e}), max abs {self.max_abs:.2e} {verdict}"


def tolerance(dtype: str, gradient: bool) -> float:
    return TOLERANCES[dtype][1 if gradient else 0]


def relative_error(got, want) -> float:
    """``rms(got - want) / rms(want)`` over the entries where ``want`` is finite; ``rms(got)`` when ``want`` is all zero."""
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    if got.size == 0:
        return 0.0
    finite = np.isfinite(want)
    rms_ref = float(np.sqrt(np.mean(np.square(np.where(finite, want, 0.0)))))
    rms_diff = float(np.sqrt(np.mean(np.square(np.where(finite, got - want, 0.0)))))
    if rms_ref > 0:
        return rms_diff / rms_ref
    return float(np.sqrt(np.mean(np.square(np.where(finite, got, 0.0)))))


def measure(name: str, got, want, tol: float) -> Measurement:
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {got.shape} differs from the reference's {want.shape}")
    finite = bool(np.all(np.isfinite(got) | ~np.isfinite(want)))
    diff = np.where(np.isfinite(want), got - want, 0.0)
    max_abs = float(np.max(np.abs(diff))) if diff.size else 0.0
    error = relative_error(got, want)
    return Measurement(name, error if np.isfinite(error) else float("inf"), max_abs if np.isfinite(max_abs) else float("inf"), tol, finite)
