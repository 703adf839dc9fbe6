"""simple_gla: gated linear attention with a scalar gate per head (docs/ops.md "simple_gla").

For each sequence and head, with ``S_0 = initial_state`` (zeros if None)::

    a_t = g[t] + g_gamma            (a missing term counts as 0)
    S_t = exp(a_t) * S_{t-1} + k_t^T v_t          # [K, V]
    o_t = scale * q_t S_t                          # [V]

Implementing it: register ``Implementation(op="simple_gla", forward=..., backward=...)`` whose
callables follow ``Forward`` and ``Backward`` below. They receive validated arguments (shapes
consistent, ``scale`` a float, ``cu_seqlens`` int32 with ``B == 1``), never a call their
capabilities reject, and their results are checked against the contract (shapes, dtypes, a
gradient for every given input). ``g_gamma`` is ``[H]`` or a scalar (declare the ranks you
accept with ``Capabilities(ndims={"g_gamma": {...}})``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from tops_core.ops import diagonal_sequence, validation
from tops_core.ops.base import Explanation, OpContract, Prepared, nan_where, state_dtype
from tops_core.policy import ForceRequest
from tops_core.signatures import SIMPLE_GLA

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SimpleGLAGrads:
    """Gradients of simple_gla; a field is None exactly when its input was not given."""

    dq: Array
    dk: Array
    dv: Array
    dg: Array | None = None
    dg_gamma: Array | None = None
    dinitial_state: Array | None = None


class Forward(Protocol):
    def __call__(
        self,
        q: Array,
        k: Array,
        v: Array,
        *,
        g: Array | None,
        g_gamma: Array | None,
        scale: float,
        initial_state: Array | None,
        output_final_state: bool,
        cu_seqlens: Array | None,
        config: Any,
    ) -> tuple[Array, Array | None]:
        """Return ``o`` ``[B, T, H, V]`` (dtype of ``v``) and the final state ``[N, H, K, V]`` (float32, float64 for float64 inputs) or None."""


class Backward(Protocol):
    def __call__(
        self,
        q: Array,
        k: Array,
        v: Array,
        do: Array,
        *,
        g: Array | None,
        g_gamma: Array | None,
        scale: float,
        initial_state: Array | None,
        dht: Array | None,
        cu_seqlens: Array | None,
        config: Any,
    ) -> SimpleGLAGrads:
        """Return the exact VJP for cotangents ``do`` and ``dht`` (None: no final-state cotangent)."""


def log_decay(g: Array | None, g_gamma: Array | None, shape: tuple[int, int, int], dtype) -> Array:
    """The log decay of every token and head ``[B, T, H]`` in ``dtype``: ``g + g_gamma``, a missing term counting 0
    (what a token-by-token recurrence decays its state by)."""
    decay = jnp.zeros(shape, dtype)
    if g is not None:
        decay = decay + g.astype(dtype)
    if g_gamma is not None:
        decay = decay + g_gamma.astype(dtype)
    return decay


class SimpleGLA(OpContract, signature=SIMPLE_GLA):
    differentiable = ("q", "k", "v", "g", "g_gamma", "initial_state")
    grads_type = SimpleGLAGrads
    dims = {
        "q": "b t h k", "k": "b t h k", "v": "b t h v", "g": "b t h", "g_gamma": "h",
        "initial_state": "n h k v", "cu_seqlens": "c",
    }
    sequence_parallel = diagonal_sequence

    def forward(
        self,
        q: Array,
        k: Array,
        v: Array,
        g: Array | None = None,
        g_gamma: Array | None = None,
        scale: float | None = None,
        initial_state: Array | None = None,
        output_final_state: bool = False,
        cu_seqlens: Array | None = None,
        ssm_state_indices: Array | None = None,
        *,
        implementation: ForceRequest = None,
    ) -> tuple[Array, Array | None]:
        """Compute ``(o, final_state)``; differentiable with ``jax.grad``, and works under ``jit``/``vmap``.

        With ``ssm_state_indices``, ``initial_state`` is a state pool and the final state is the updated pool
        (``tops_core.ops.pool``)."""
        policy = self.policy(implementation)
        prepared = self.prepare(q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, policy.interpret, ssm_state_indices)
        return self._forward(prepared, policy)

    def backward(
        self,
        q: Array,
        k: Array,
        v: Array,
        do: Array,
        g: Array | None = None,
        g_gamma: Array | None = None,
        scale: float | None = None,
        initial_state: Array | None = None,
        dht: Array | None = None,
        cu_seqlens: Array | None = None,
        ssm_state_indices: Array | None = None,
        *,
        implementation: ForceRequest = None,
    ) -> SimpleGLAGrads:
        """The explicit VJP: gradients for cotangents ``do`` (and ``dht``, the final state's: the pool's with ``ssm_state_indices``)."""
        policy = self.policy(implementation)
        prepared = self.prepare(q, k, v, g, g_gamma, scale, initial_state, dht is not None, cu_seqlens, policy.interpret, ssm_state_indices)
        do, dht = self.check_cotangents(prepared, do, dht)
        return self._backward(prepared, policy, do, dht)

    def explain(
        self,
        q: Array,
        k: Array,
        v: Array,
        g: Array | None = None,
        g_gamma: Array | None = None,
        scale: float | None = None,
        initial_state: Array | None = None,
        output_final_state: bool = False,
        cu_seqlens: Array | None = None,
        ssm_state_indices: Array | None = None,
        *,
        implementation: ForceRequest = None,
    ) -> Explanation:
        """Which implementations the forward and backward of this call would use, and why."""
        policy = self.policy(implementation)
        prepared = self.prepare(q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, policy.interpret, ssm_state_indices)
        return self._explain(prepared, policy)

    def prepare(self, q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, interpret, ssm_state_indices=None) -> Prepared:
        """Validate a call (docs/ops.md "Invalid input") and derive its call spec."""
        q, k, v, (B, T, H, K, V) = validation.qkv(q, k, v, initial_state_given=initial_state is not None)
        floats = state_dtype(q.dtype)  # the dtype Python numbers and lists become
        g = validation.real_array("g", g, floats, required=False)
        if g is not None:
            validation.shape("g", g, (B, T, H), "[B, T, H]")
        g_gamma = validation.real_array("g_gamma", g_gamma, floats, required=False)
        if g_gamma is not None and g_gamma.ndim != 0:
            validation.shape("g_gamma", g_gamma, (H,), "[H] (or a scalar)")
        cu_seqlens, N = validation.cu_seqlens(cu_seqlens, B, T)
        initial_state = validation.real_array("initial_state", initial_state, floats, required=False)
        ssm_state_indices = validation.state_indices(ssm_state_indices, initial_state, N, floats)
        if initial_state is not None:
            validation.state_shape(initial_state, ssm_state_indices, N, (H, K, V), "H, K, V")
        output_final_state = validation.flag("output_final_state", output_final_state)
        arrays = dict(
            q=q, k=k, v=v, g=g, g_gamma=g_gamma, initial_state=initial_state, cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
        )
        options = (("scale", validation.scale(scale, K)), ("output_final_state", output_final_state))
        ndims = {"g_gamma": g_gamma.ndim} if g_gamma is not None else {}
        return self.make_prepared(arrays, options, N, ndims, interpret)

    def poisoned(self, arrays, bad):
        """``g`` where given (``[B, T, H]``, a 128th of ``v`` at K = 128): a NaN decay makes the state NaN."""
        if arrays["g"] is None:
            return super().poisoned(arrays, bad)
        return {**arrays, "g": nan_where(bad, arrays["g"])}

    def counted_flops_per_token(self, key_dim: int, value_dim: int, chunk_size: int) -> float:
        """``4KV`` (queries against the state, the state update) and ``2C(K+V)`` (scores, scores against values)."""
        return 4 * key_dim * value_dim + 2 * chunk_size * (key_dim + value_dim)

    def call_forward(self, fn: Forward, prepared: Prepared, config: Any):
        a = prepared.arrays
        return fn(
            a["q"], a["k"], a["v"], g=a["g"], g_gamma=a["g_gamma"], scale=prepared.option("scale"),
            initial_state=a["initial_state"], output_final_state=prepared.option("output_final_state"),
            cu_seqlens=a["cu_seqlens"], config=config,
        )

    def call_backward(self, fn: Backward, prepared: Prepared, do: Array, dht: Array | None, config: Any):
        a = prepared.arrays
        return fn(
            a["q"], a["k"], a["v"], do, g=a["g"], g_gamma=a["g_gamma"], scale=prepared.option("scale"),
            initial_state=a["initial_state"], dht=dht, cu_seqlens=a["cu_seqlens"], config=config,
        )
