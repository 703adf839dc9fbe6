"""SPEC.md "Tolerances": relative RMS error against the float64 reference, per output and gradient."""

from __future__ import annotations

import dataclasses

import numpy as np

TOLERANCES = {
    # input dtype: (outputs and final state, gradients)
    "float64": (1e-10, 1e-9),
    "float32": (1e-5, 5e-5),
    "bfloat16": (5e-3, 1e-2),
    # Not in SPEC.md's table; float16 gets bfloat16's row, which its longer mantissa meets easily.
    "float16": (5e-3, 1e-2),
}
ABSOLUTE_PASS = 1e-6
"""A result also passes when ``max|x - ref|`` is at most this (tiny outputs, e.g. after strong decay)."""


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
        return self.finite and (self.error <= self.tolerance or self.max_abs <= ABSOLUTE_PASS)

    @property
    def passed_by_absolute_rule(self) -> bool:
        """Passed only because ``max|x - ref|`` is small: for float64 the 1e-6 absolute rule is far
        looser than the 1e-10 relative tolerance, so such a pass deserves a look."""
        return self.passed and self.error > self.tolerance

    def describe(self) -> str:
        if not self.finite:
            return f"{self.name}: NaN or Inf where the reference is finite"
        verdict = "ok by the absolute rule only" if self.passed_by_absolute_rule else ("ok" if self.passed else "FAIL")
        return f"{self.name}: relative RMS {self.error:.2e} (tolerance {self.tolerance:.0e}), max abs {self.max_abs:.2e} {verdict}"


def tolerance(dtype: str, gradient: bool) -> float:
    return TOLERANCES[dtype][1 if gradient else 0]


def measure(name: str, got, want, tol: float) -> Measurement:
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {got.shape} differs from the reference's {want.shape}")
    finite = bool(np.all(np.isfinite(got) | ~np.isfinite(want)))
    diff = np.where(np.isfinite(want), got - want, 0.0)
    rms_ref = float(np.sqrt(np.mean(np.square(np.where(np.isfinite(want), want, 0.0))))) if want.size else 0.0
    rms_diff = float(np.sqrt(np.mean(np.square(diff)))) if diff.size else 0.0
    if rms_ref > 0:
        error = rms_diff / rms_ref
    else:
        error = 0.0 if rms_diff == 0 else float("inf")
    max_abs = float(np.max(np.abs(diff))) if diff.size else 0.0
    return Measurement(name, error, max_abs if np.isfinite(max_abs) else float("inf"), tol, finite)
