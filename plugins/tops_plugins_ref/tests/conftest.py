"""Fixtures shared by the reference plugin's tests."""

import jax
import numpy as np
import pytest


@pytest.fixture
def x64():
    """float64 arrays for the duration of one test, without touching the global jax_enable_x64."""
    with jax.enable_x64(True):
        yield


@pytest.fixture
def finite_difference_errors():
    """``errors(loss, primals, grads)``: per input, the relative error of ``grads[name]`` along a random direction.

    ``loss`` maps a dict of float64 inputs to a scalar; ``grads[name]`` claims to be its gradient.
    Each input is checked on its own, so one gradient cannot hide behind a larger one: the
    directional derivative ``<grads[name], u>`` is compared with the central difference
    ``(loss(x + eps u) - loss(x - eps u)) / (2 eps)``, whose error is O(eps^2) plus rounding.
    """

    def errors(loss, primals, grads, eps=1e-5, seed=0):
        rng = np.random.default_rng(seed)
        result = {}
        for name, x in primals.items():
            direction = rng.normal(size=np.shape(x))
            shifted = lambda sign: loss({**primals, name: np.asarray(x) + sign * eps * direction})  # noqa: E731
            numeric = (float(shifted(+1)) - float(shifted(-1))) / (2 * eps)
            analytic = float(np.sum(np.asarray(grads[name]) * direction))
            result[name] = abs(numeric - analytic) / max(abs(numeric), 1e-12)
        return result

    return errors
