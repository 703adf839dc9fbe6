"""gla: gated linear attention with one gate per key (docs/ops.md "gla"; flash-linear-attention's ``chunk_gla``).

For each sequence and head, with ``S_0 = initial_state`` (zeros if None)::

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t        # [K, V]: each key row decays by its own gate
    o_t = scale * q_t S_t                           # [V]

``g`` ``[B, T, H, K]`` is the log decay itself, any real ``<= 0`` (``-inf`` resets a key row). Implementing
it: register ``Implementation(op="gla", forward=..., backward=...)`` whose callables follow ``Forward`` and
``Backward`` below; they receive validated arguments, as for simple_gla.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

from tops_core.ops import diagonal_sequence, validation
from tops_core.ops.base import Explanation, OpContract, Prepared, state_dtype
from tops_core.ops.simple_gla import SimpleGLA
from tops_core.policy import ForceRequest
from tops_core.signatures import GLA as GLA_SIGNATURE

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GLAGrads:
    """Gradients of gla; ``dinitial_state`` is None exactly when no initial state was given."""

    dq: Array
    dk: Array
    dv: Array
    dg: Array
    dinitial_state: Array | None = None


class Forward(Protocol):
    def __call__(
        self, q: Array, k: Array, v: Array, g: Array, *, scale: float, initial_state: Array | None,
        output_final_state: bool, cu_seqlens: Array | None, config: Any,
    ) -> tuple[Array, Array | None]:
        """Return ``o`` ``[B, T, H, V]`` (dtype of ``v``) and the final state ``[N, H, K, V]`` (float32, float64 for float64 inputs) or None."""


class Backward(Protocol):
    def __call__(
        self, q: Array, k: Array, v: Array, g: Array, do: Array, *, scale: float, initial_state: Array | None,
        dht: Array | None, cu_seqlens: Array | None, config: Any,
    ) -> GLAGrads:
        """Return the exact VJP for cotangents ``do`` and ``dht`` (None: no final-state cotangent)."""


class GLA(OpContract, signature=GLA_SIGNATURE):
    differentiable = ("q", "k", "v", "g", "initial_state")
    grads_type = GLAGrads
    dims = {"q": "b t h k", "k": "b t h k", "v": "b t h v", "g": "b t h k", "initial_state": "n h k v", "cu_seqlens": "c"}
    sequence_parallel = diagonal_sequence

    def forward(
        self, q: Array, k: Array, v: Array, g: Array, scale: float | None = None, initial_state: Array | None = None,
        output_final_state: bool = False, cu_seqlens: Array | None = None, ssm_state_indices: Array | None = None, *,
        implementation: ForceRequest = None,
    ) -> tuple[Array, Array | None]:
        """Compute ``(o, final_state)``; differentiable with ``jax.grad``, and works under ``jit``/``vmap``.

        With ``ssm_state_indices``, ``initial_state`` is a state pool and the final state is the updated pool
        (``tops_core.ops.pool``)."""
        policy = self.policy(implementation)
        prepared = self.prepare(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, policy.interpret, ssm_state_indices)
        return self._forward(prepared, policy)

    def backward(
        self, q: Array, k: Array, v: Array, g: Array, do: Array, scale: float | None = None,
        initial_state: Array | None = None, dht: Array | None = None, cu_seqlens: Array | None = None,
        ssm_state_indices: Array | None = None, *, implementation: ForceRequest = None,
    ) -> GLAGrads:
        """The explicit VJP: gradients for cotangents ``do`` (and ``dht``, the final state's: the pool's with ``ssm_state_indices``)."""
        policy = self.policy(implementation)
        prepared = self.prepare(q, k, v, g, scale, initial_state, dht is not None, cu_seqlens, policy.interpret, ssm_state_indices)
        do, dht = self.check_cotangents(prepared, do, dht)
        return self._backward(prepared, policy, do, dht)

    def explain(
        self, q: Array, k: Array, v: Array, g: Array, scale: float | None = None, initial_state: Array | None = None,
        output_final_state: bool = False, cu_seqlens: Array | None = None, ssm_state_indices: Array | None = None, *,
        implementation: ForceRequest = None,
    ) -> Explanation:
        """Which implementations the forward and backward of this call would use, and why."""
        policy = self.policy(implementation)
        prepared = self.prepare(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, policy.interpret, ssm_state_indices)
        return self._explain(prepared, policy)

    def prepare(self, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, interpret, ssm_state_indices=None) -> Prepared:
        """Validate a call (docs/ops.md "Invalid input") and derive its call spec."""
        q, k, v, (B, T, H, K, V) = validation.qkv(q, k, v, initial_state_given=initial_state is not None)
        floats = state_dtype(q.dtype)  # the dtype Python numbers and lists become
        g = validation.shape("g", validation.real_array("g", g, floats), (B, T, H, K), "[B, T, H, K]")
        cu_seqlens, N = validation.cu_seqlens(cu_seqlens, B, T)
        initial_state = validation.real_array("initial_state", initial_state, floats, required=False)
        ssm_state_indices = validation.state_indices(ssm_state_indices, initial_state, N, floats)
        if initial_state is not None:
            validation.state_shape(initial_state, ssm_state_indices, N, (H, K, V), "H, K, V")
        arrays = dict(q=q, k=k, v=v, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices)
        options = (("scale", validation.scale(scale, K)), ("output_final_state", validation.flag("output_final_state", output_final_state)))
        return self.make_prepared(arrays, options, N, {}, interpret)

    # simple_gla's count: the per-key decays ride on the operands of the same products.
    counted_flops_per_token = SimpleGLA.counted_flops_per_token

    def call_forward(self, fn: Forward, prepared: Prepared, config: Any):
        a = prepared.arrays
        return fn(
            a["q"], a["k"], a["v"], a["g"], scale=prepared.option("scale"), initial_state=a["initial_state"],
            output_final_state=prepared.option("output_final_state"), cu_seqlens=a["cu_seqlens"], config=config,
        )

    def call_backward(self, fn: Backward, prepared: Prepared, do: Array, dht: Array | None, config: Any):
        a = prepared.arrays
        return fn(
            a["q"], a["k"], a["v"], a["g"], do, scale=prepared.option("scale"), initial_state=a["initial_state"], dht=dht,
            cu_seqlens=a["cu_seqlens"], config=config,
        )
