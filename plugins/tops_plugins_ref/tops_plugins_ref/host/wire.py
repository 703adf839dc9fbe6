"""The host side of the callback: NumPy arrays in, float64 arithmetic, NumPy arrays out.

float64 crosses the callback boundary as uint32 pairs, both ways (``tops_plugins_ref.callback``
says why); every dtype decision is made at trace time and handed in, so nothing here asks JAX.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def run_on_host(
    compute: Callable[[dict[str, Any]], dict[str, Any]],
    floating: frozenset[str],
    float64_on_the_wire: frozenset[str],
    result_dtypes: dict[str, np.dtype | None],
    wire_inputs: dict[str, Any],
) -> dict[str, np.ndarray | None]:
    """Decode ``wire_inputs``, upcast the ``floating`` ones to float64, run ``compute`` and encode
    each result named in ``result_dtypes`` in its dtype (None where the dtype is None)."""
    inputs = {}
    for name, x in wire_inputs.items():
        if x is not None:
            x = np.asarray(x)
            if name in float64_on_the_wire:
                x = decode(x)
            if name in floating:
                x = x.astype(np.float64)
        inputs[name] = x
    # Inf and NaN in the inputs are legal and propagate to the outputs, without warnings.
    with np.errstate(all="ignore"):
        outputs = compute(inputs)
        return {name: None if dtype is None else encode(np.asarray(outputs[name]).astype(dtype))
                for name, dtype in result_dtypes.items()}


def encode(value: np.ndarray) -> np.ndarray:
    """float64 ``[...]`` as uint32 ``[..., 2]``; any other dtype as it is."""
    if value.dtype == np.float64:
        return np.ascontiguousarray(value).view(np.uint32).reshape(*value.shape, 2)
    return value


def decode(value: np.ndarray) -> np.ndarray:
    """uint32 ``[..., 2]`` back to float64 ``[...]``."""
    return np.ascontiguousarray(value).view(np.float64)[..., 0]
