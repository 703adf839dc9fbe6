"""What both reference ops share: running in float64 on the host, and a scan over packed sequences.

Every reference call goes through ``on_host_in_float64``: a ``jax.pure_callback`` whose host
function receives the concrete input values, upcasts them to float64 and runs a jitted
recurrence on the CPU device inside ``jax.enable_x64(True)``. That context is thread-local and undone on exit,
so the caller's ``jax_enable_x64`` and default device are never touched, and because the inputs
are concrete inside the callback, ``cu_seqlens`` can shape the computation even when the caller
is tracing under ``jit``, ``vmap`` or the core's ``custom_vjp`` backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tops_core.ops import validation
from tops_core.ops.base import state_dtype


def on_host_in_float64(compute: Callable[[dict[str, Any]], Any], results: Any, inputs: dict[str, Any]) -> Any:
    """Run ``compute`` on numpy copies of ``inputs`` in float64 on the CPU device.

    ``inputs`` maps names to arrays or None; floating arrays (bfloat16 included) reach ``compute``
    as float64, integer ones unchanged. ``compute`` returns a pytree shaped like ``results``
    (``jax.ShapeDtypeStruct`` leaves, None for absent results); each leaf comes back cast to its
    declared dtype.
    """
    dtypes = {name: None if x is None else jnp.dtype(x.dtype) for name, x in inputs.items()}

    def host(wire_inputs: dict[str, Any]) -> Any:
        as_numpy = {name: None if x is None else _host_decode(np.asarray(x), dtypes[name]) for name, x in wire_inputs.items()}
        upcast = {
            name: x.astype(np.float64) if x is not None and jnp.issubdtype(x.dtype, jnp.floating) else x
            for name, x in as_numpy.items()
        }
        # Looked up here, not at import: importing a plugin must not initialise JAX's backends.
        with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
            outputs = compute(upcast)
            return jax.tree.map(lambda out, spec: _host_encode(np.asarray(out).astype(spec.dtype)), outputs, results)

    wire_inputs = {name: None if x is None else _device_encode(x) for name, x in inputs.items()}
    # "sequential" calls the host once per vmapped element: each element may carry its own
    # cu_seqlens, which decide the layout of its scan, so elements cannot share one call.
    wire = jax.pure_callback(host, jax.tree.map(_wire_spec, results), wire_inputs, vmap_method="sequential")
    return jax.tree.map(_device_decode, wire, results)


# JAX converts a callback's operands and results on the runtime thread that runs it, where a
# caller's thread-local ``jax.enable_x64(True)`` is not in effect: float64 operands would become
# float32 on the way in (they are device_put there) and float64 results would fail the dtype check
# on the way out. float64 therefore crosses the callback boundary, both ways, as uint32 pairs.
def _wire_spec(spec: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    if spec.dtype == np.float64:
        return jax.ShapeDtypeStruct((*spec.shape, 2), np.uint32)
    return spec


def _device_encode(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint32) if x.dtype == jnp.float64 else x


def _device_decode(x: jax.Array, spec: jax.ShapeDtypeStruct) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.float64) if spec.dtype == np.float64 else x


def _host_encode(value: np.ndarray) -> np.ndarray:
    if value.dtype == np.float64:
        return np.ascontiguousarray(value).view(np.uint32).reshape(*value.shape, 2)
    return value


def _host_decode(value: np.ndarray, dtype: Any) -> np.ndarray:
    if dtype == jnp.float64:
        return np.ascontiguousarray(value).view(np.float64)[..., 0]
    return value


def forward_results(q: Any, v: Any, cu_seqlens: Any, output_final_state: bool) -> tuple[Any, Any]:
    """Shapes and dtypes of ``o`` and of the final state (None when not requested), as the op contract says."""
    B, _, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    o = jax.ShapeDtypeStruct(v.shape, v.dtype)
    if not output_final_state:
        return o, None
    return o, jax.ShapeDtypeStruct((N, H, K, v.shape[-1]), state_dtype(v.dtype))


class SequenceLayout(NamedTuple):
    """How the flattened ``[B * T]`` token axis splits into ``N`` sequences padded to a common length ``L``."""

    token_index: np.ndarray  # [N, L] int32: the token at each step of each sequence; B * T (out of range) on padding
    valid: np.ndarray  # [N, L] bool: the step is a real token, not padding
    padded_position: np.ndarray  # [B * T] int32: where each token sits in the [N * L] padded steps


def sequence_layout(cu_seqlens: np.ndarray | None, batch: int, seq_len: int) -> SequenceLayout:
    """The layout of ``batch`` rows of ``seq_len`` tokens, or of the packed sequences ``cu_seqlens``.

    Without ``cu_seqlens`` each batch row is one sequence (no padding), so both cases share one
    code path. The core validates ``cu_seqlens`` only when it is concrete at call time; under
    ``jit`` this is the first place its values are seen, so it is validated here with the core's rules.
    """
    if cu_seqlens is None:
        bounds = np.arange(batch + 1) * seq_len
    else:
        bounds = np.asarray(validation.cu_seqlens(cu_seqlens, batch, seq_len)[0])
    starts, lengths = bounds[:-1], np.diff(bounds)
    steps = np.arange(lengths.max())
    valid = steps < lengths[:, None]
    tokens = np.arange(batch * seq_len)
    # side="right" skips empty sequences: a token belongs to the last sequence starting at or before it.
    sequence = np.searchsorted(bounds, tokens, side="right") - 1
    return SequenceLayout(
        token_index=np.where(valid, starts[:, None] + steps, batch * seq_len).astype(np.int32),
        valid=valid,
        padded_position=(sequence * len(steps) + tokens - starts[sequence]).astype(np.int32),
    )


def scan_sequences(
    step: Callable[[jax.Array, Any], tuple[jax.Array, jax.Array]],
    tokens: Any,
    initial_states: jax.Array,
    layout: SequenceLayout,
) -> tuple[Any, jax.Array]:
    """Run ``step(state, token) -> (state, output)`` over each sequence's tokens in order.

    ``tokens`` is a pytree of ``[B * T, ...]`` arrays and ``initial_states`` is ``[N, ...]``. Each
    sequence starts from its own row of ``initial_states``; padding steps leave the state as it
    is, so a sequence's final state is the state after its last token, or its initial state when
    it has none. Returns the per-token outputs ``[B * T, ...]`` and the final states ``[N, ...]``.
    """

    def one_sequence(tokens, initial_state, valid):
        def body(state, xs):
            token, is_valid = xs
            next_state, output = step(state, token)
            return jnp.where(is_valid, next_state, state), output

        return lax.scan(body, initial_state, (tokens, valid))

    # Padding steps read zeros rather than a neighbour's token, so they cannot produce Inf or NaN.
    padded = jax.tree.map(lambda x: jnp.take(x, layout.token_index, axis=0, mode="fill", fill_value=0), tokens)
    final_states, outputs = jax.vmap(one_sequence)(padded, initial_states, layout.valid)
    outputs = jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:])[layout.padded_position], outputs)
    return outputs, final_states
