"""The device side of every reference call: a ``jax.pure_callback`` into the NumPy computation.

``on_host_in_float64`` hands the concrete input values to a host function that computes in
float64 NumPy (``tops_plugins_ref.host``) and hands the results back in the contract's dtypes.
Because the values are concrete on the host, ``cu_seqlens`` can shape the computation even when
the caller is tracing under ``jit``, ``vmap`` or the core's ``custom_vjp`` backward; and because
the host function runs no JAX at all, it neither depends on nor changes the caller's
``jax_enable_x64`` or default device, and it cannot deadlock the runtime that waits for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tops_core.ops.base import state_dtype
from tops_plugins_ref.host.wire import run_on_host


def on_host_in_float64(
    compute: Callable[[dict[str, Any]], dict[str, Any]],
    results: dict[str, jax.ShapeDtypeStruct | None],
    inputs: dict[str, jax.Array | None],
) -> dict[str, jax.Array | None]:
    """Run ``compute`` (NumPy, float64) on the values of ``inputs`` on the host.

    ``inputs`` maps names to arrays or None; floating arrays (bfloat16 included) reach ``compute``
    as float64 NumPy arrays, integer ones unchanged. ``compute`` returns a dict holding at least
    the names in ``results``; each result whose spec is not None comes back cast to its dtype.
    """
    present = {name: x for name, x in inputs.items() if x is not None}
    host = functools.partial(
        run_on_host,
        compute,
        frozenset(name for name, x in present.items() if jnp.issubdtype(x.dtype, jnp.floating)),
        frozenset(name for name, x in present.items() if x.dtype == jnp.float64),
        {name: None if spec is None else np.dtype(spec.dtype) for name, spec in results.items()},
    )
    wire_inputs = {name: None if x is None else _device_encode(x) for name, x in inputs.items()}
    wire_results = {name: None if spec is None else _wire_spec(spec) for name, spec in results.items()}
    # "sequential" calls the host once per vmapped element: each element may carry its own
    # cu_seqlens, which decide the layout of its sweep, so elements cannot share one call.
    wire = jax.pure_callback(host, wire_results, wire_inputs, vmap_method="sequential")
    return {name: None if spec is None else _device_decode(wire[name], spec) for name, spec in results.items()}


def forward_results(q: Any, v: Any, cu_seqlens: Any, output_final_state: bool) -> dict[str, jax.ShapeDtypeStruct | None]:
    """Shapes and dtypes of ``o`` and of the final state (None when not requested), as the op contract says:
    one state per value head, of which there may be more than query/key heads (kda's grouped value heads)."""
    B, _, H, V = v.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final_state = jax.ShapeDtypeStruct((N, H, q.shape[-1], V), state_dtype(v.dtype)) if output_final_state else None
    return {"o": jax.ShapeDtypeStruct(v.shape, v.dtype), "final_state": final_state}


def gradient_results(given: dict[str, jax.Array | None]) -> dict[str, jax.ShapeDtypeStruct | None]:
    """``d<name>`` like each given differentiable input; None for the absent ones."""
    return {"d" + name: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype) for name, x in given.items()}


# JAX converts a callback's operands and results on the runtime thread that runs it, where a
# caller's thread-local ``jax.enable_x64(True)`` is not in effect: float64 operands would become
# float32 on the way in (they are device_put there) and float64 results would fail the dtype check
# on the way out. float64 therefore crosses the callback boundary, both ways, as uint32 pairs
# (decoded and encoded on the host by ``tops_plugins_ref.host.wire``).
def _wire_spec(spec: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    if spec.dtype == np.float64:
        return jax.ShapeDtypeStruct((*spec.shape, 2), np.uint32)
    return spec


def _device_encode(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint32) if x.dtype == jnp.float64 else x


def _device_decode(x: jax.Array, spec: jax.ShapeDtypeStruct) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.float64) if spec.dtype == np.float64 else x
