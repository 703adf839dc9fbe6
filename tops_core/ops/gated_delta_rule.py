"""gated_delta_rule: the gated delta rule (docs/ops.md "gated_delta_rule"; flash-linear-attention's
``chunk_gated_delta_rule``, Gated DeltaNet as in Qwen3-Next).

For each sequence and value head, with ``S_0 = initial_state`` (zeros if None)::

    S_t' = exp(g_t) S_{t-1}                                 # one decay per head and token
    S_t  = S_t' + beta_t * k_t^T (v_t - k_t S_t')            # delta rule
    o_t  = scale * q_t S_t

with ``q, k`` L2-normalised over ``K`` first when ``use_qk_l2norm`` (kda's epsilon), and value head ``j``
of ``HV`` reading query/key head ``j // (HV // H)`` (grouped value heads, as kda). kda's recurrence with
one gate for every key: implementations follow ``Forward`` and ``Backward`` below, and receive validated
arguments, as for simple_gla.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

from tops_core.ops import delta_sequence, validation
from tops_core.ops.base import Explanation, OpContract, Prepared, nan_where, state_dtype
from tops_core.ops.kda import KDA
from tops_core.policy import ForceRequest
from tops_core.signatures import GATED_DELTA_RULE

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GatedDeltaRuleGrads:
    """Gradients of gated_delta_rule; ``dinitial_state`` is None exactly when no initial state was given."""

    dq: Array
    dk: Array
    dv: Array
    dg: Array
    dbeta: Array
    dinitial_state: Array | None = None


class Forward(Protocol):
    def __call__(
        self, q: Array, k: Array, v: Array, g: Array, beta: Array, *, scale: float, initial_state: Array | None,
        output_final_state: bool, cu_seqlens: Array | None, use_qk_l2norm: bool, config: Any,
    ) -> tuple[Array, Array | None]:
        """Return ``o`` ``[B, T, HV, V]`` (dtype of ``v``) and the final state ``[N, HV, K, V]`` or None."""


class Backward(Protocol):
    def __call__(
        self, q: Array, k: Array, v: Array, g: Array, beta: Array, do: Array, *, scale: float,
        initial_state: Array | None, dht: Array | None, cu_seqlens: Array | None, use_qk_l2norm: bool, config: Any,
    ) -> GatedDeltaRuleGrads:
        """Return the exact VJP for cotangents ``do`` and ``dht`` (None: no final-state cotangent)."""


class GatedDeltaRule(OpContract, signature=GATED_DELTA_RULE):
    differentiable = ("q", "k", "v", "g", "beta", "initial_state")
    grads_type = GatedDeltaRuleGrads
    dims = {
        "q": "b t h k", "k": "b t h k", "v": "b t h v", "g": "b t h", "beta": "b t h", "initial_state": "n h k v",
        "cu_seqlens": "c",
    }
    sequence_parallel = delta_sequence

    def forward(
        self, q: Array, k: Array, v: Array, g: Array, beta: Array, scale: float | None = None,
        initial_state: Array | None = None, output_final_state: bool = False, cu_seqlens: Array | None = None,
        use_qk_l2norm: bool = False, ssm_state_indices: Array | None = None, *, implementation: ForceRequest = None,
    ) -> tuple[Array, Array | None]:
        """Compute ``(o, final_state)``; differentiable with ``jax.grad``, and works under ``jit``/``vmap``.

        With ``ssm_state_indices``, ``initial_state`` is a state pool and the final state is the updated pool
        (``tops_core.ops.pool``)."""
        policy = self.policy(implementation)
        prepared = self.prepare(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
                                policy.interpret, ssm_state_indices)
        return self._forward(prepared, policy)

    def backward(
        self, q: Array, k: Array, v: Array, g: Array, beta: Array, do: Array, scale: float | None = None,
        initial_state: Array | None = None, dht: Array | None = None, cu_seqlens: Array | None = None,
        use_qk_l2norm: bool = False, ssm_state_indices: Array | None = None, *, implementation: ForceRequest = None,
    ) -> GatedDeltaRuleGrads:
        """The explicit VJP: gradients for cotangents ``do`` (and ``dht``, the final state's: the pool's with ``ssm_state_indices``)."""
        policy = self.policy(implementation)
        prepared = self.prepare(q, k, v, g, beta, scale, initial_state, dht is not None, cu_seqlens, use_qk_l2norm,
                                policy.interpret, ssm_state_indices)
        do, dht = self.check_cotangents(prepared, do, dht)
        return self._backward(prepared, policy, do, dht)

    def explain(
        self, q: Array, k: Array, v: Array, g: Array, beta: Array, scale: float | None = None,
        initial_state: Array | None = None, output_final_state: bool = False, cu_seqlens: Array | None = None,
        use_qk_l2norm: bool = False, ssm_state_indices: Array | None = None, *, implementation: ForceRequest = None,
    ) -> Explanation:
        """Which implementations the forward and backward of this call would use, and why."""
        policy = self.policy(implementation)
        prepared = self.prepare(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
                                policy.interpret, ssm_state_indices)
        return self._explain(prepared, policy)

    def prepare(self, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, interpret,
                ssm_state_indices=None) -> Prepared:
        """Validate a call (docs/ops.md "Invalid input") and derive its call spec."""
        q, k, v, (B, T, H, K, V) = validation.qkv(q, k, v, initial_state_given=initial_state is not None, grouped_values=True)
        HV = v.shape[2]
        floats = state_dtype(q.dtype)  # the dtype Python numbers and lists become
        g = validation.shape("g", validation.real_array("g", g, floats), (B, T, HV), "[B, T, HV]")
        beta = validation.shape("beta", validation.real_array("beta", beta, floats), (B, T, HV), "[B, T, HV]")
        cu_seqlens, N = validation.cu_seqlens(cu_seqlens, B, T)
        initial_state = validation.real_array("initial_state", initial_state, floats, required=False)
        ssm_state_indices = validation.state_indices(ssm_state_indices, initial_state, N, floats)
        if initial_state is not None:
            validation.state_shape(initial_state, ssm_state_indices, N, (HV, K, V), "HV, K, V")
        options = (
            ("scale", validation.scale(scale, K)),
            ("output_final_state", validation.flag("output_final_state", output_final_state)),
            ("use_qk_l2norm", validation.flag("use_qk_l2norm", use_qk_l2norm)),
        )
        arrays = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                      ssm_state_indices=ssm_state_indices)
        return self.make_prepared(arrays, options, N, {}, interpret)

    # kda's count: the delta rule's products and the blocked inverse; the scalar gate adds none.
    counted_flops_per_token = KDA.counted_flops_per_token

    def poisoned(self, arrays, bad):
        """``g`` (``[B, T, HV]``): a NaN decay makes the state NaN."""
        return {**arrays, "g": nan_where(bad, arrays["g"])}

    def call_forward(self, fn: Forward, prepared: Prepared, config: Any):
        a = prepared.arrays
        return fn(
            a["q"], a["k"], a["v"], a["g"], a["beta"], scale=prepared.option("scale"), initial_state=a["initial_state"],
            output_final_state=prepared.option("output_final_state"), cu_seqlens=a["cu_seqlens"],
            use_qk_l2norm=prepared.option("use_qk_l2norm"), config=config,
        )

    def call_backward(self, fn: Backward, prepared: Prepared, do: Array, dht: Array | None, config: Any):
        a = prepared.arrays
        return fn(
            a["q"], a["k"], a["v"], a["g"], a["beta"], do, scale=prepared.option("scale"), initial_state=a["initial_state"],
            dht=dht, cu_seqlens=a["cu_seqlens"], use_qk_l2norm=prepared.option("use_qk_l2norm"), config=config,
        )
