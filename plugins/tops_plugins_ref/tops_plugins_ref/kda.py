"""kda reference: SPEC.md's Kimi Delta Attention recurrence, token by token, in float64 on the host.

    S_t' = diag(exp(g_t)) S_{t-1}
    S_t  = S_t' + beta_t * k_t^T (v_t - k_t S_t')
    o_t  = scale * q_t S_t

with ``q`` and ``k`` first normalised over ``K`` when ``use_qk_l2norm``:
``x / sqrt(sum(x^2) + 1e-6)``, flash-linear-attention's epsilon (docs/ops.md "kda"). The backward is ``jax.vjp`` of the same float64
computation, normalisation included.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tops_core import KDAGrads
from tops_plugins_ref.recurrence import forward_results, on_host_in_float64, scan_sequences, sequence_layout

DIFFERENTIABLE = ("q", "k", "v", "g", "beta", "initial_state")
L2NORM_EPSILON = 1e-6


def forward(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, config):
    """``(o, final_state)`` for ``tops_core.ops.kda.Forward``."""

    def compute(inputs):
        primals, layout = _primals_and_layout(inputs)
        o, final_states = _outputs(*primals, scale, layout, use_qk_l2norm)
        return o, final_states if output_final_state else None

    inputs = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens)
    return on_host_in_float64(compute, forward_results(q, v, cu_seqlens, output_final_state), inputs)


def backward(q, k, v, g, beta, do, *, scale, initial_state, dht, cu_seqlens, use_qk_l2norm, config):
    """``KDAGrads`` for ``tops_core.ops.kda.Backward``."""
    given = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    grad_specs = {name: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype) for name, x in given.items()}

    def compute(inputs):
        primals, layout = _primals_and_layout(inputs)
        final_state_cotangent = np.zeros_like(primals[-1]) if inputs["dht"] is None else inputs["dht"]
        grads = _gradients(primals, scale, layout, use_qk_l2norm, inputs["do"], final_state_cotangent)
        return {name: None if inputs[name] is None else grad for name, grad in zip(DIFFERENTIABLE, grads)}

    grads = on_host_in_float64(compute, grad_specs, dict(given, do=do, dht=dht, cu_seqlens=cu_seqlens))
    return KDAGrads(**{"d" + name: grads[name] for name in DIFFERENTIABLE})


def _primals_and_layout(inputs):
    """The differentiable inputs in DIFFERENTIABLE order (a zero initial state when none was
    given), and the layout of the sequences."""
    B, T, H, K = inputs["q"].shape
    N = B if inputs["cu_seqlens"] is None else inputs["cu_seqlens"].shape[0] - 1
    initial_state = inputs["initial_state"]
    if initial_state is None:
        initial_state = np.zeros((N, H, K, inputs["v"].shape[-1]))
    primals = tuple(initial_state if name == "initial_state" else inputs[name] for name in DIFFERENTIABLE)
    return primals, sequence_layout(inputs["cu_seqlens"], B, T)


@functools.partial(jax.jit, static_argnames="use_qk_l2norm")
def _outputs(q, k, v, g, beta, initial_state, scale, layout, use_qk_l2norm):
    """``o`` ``[B, T, H, V]`` and the final states ``[N, H, K, V]``."""
    B, T = q.shape[:2]
    if use_qk_l2norm:
        q = q / jnp.sqrt(jnp.sum(q * q, axis=-1, keepdims=True) + L2NORM_EPSILON)
        k = k / jnp.sqrt(jnp.sum(k * k, axis=-1, keepdims=True) + L2NORM_EPSILON)

    def step(state, token):
        q_t, k_t, v_t, g_t, beta_t = token
        state = jnp.exp(g_t)[:, :, None] * state
        # The delta rule writes only what the decayed state does not already recall for k_t.
        surprise = v_t - jnp.einsum("hk,hkv->hv", k_t, state)
        state = state + beta_t[:, None, None] * k_t[:, :, None] * surprise[:, None, :]
        return state, scale * jnp.einsum("hk,hkv->hv", q_t, state)

    tokens = tuple(x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    o, final_states = scan_sequences(step, tokens, initial_state, layout)
    return o.reshape(v.shape), final_states


@functools.partial(jax.jit, static_argnames="use_qk_l2norm")
def _gradients(primals, scale, layout, use_qk_l2norm, do, dht):
    _, pullback = jax.vjp(lambda *args: _outputs(*args, scale, layout, use_qk_l2norm), *primals)
    return pullback((do, dht))
