"""simple_gla reference: SPEC.md's recurrence, token by token, in float64 on the host.

    a_t = g[t] + g_gamma            (a missing term counts as 0)
    S_t = exp(a_t) * S_{t-1} + k_t^T v_t
    o_t = scale * q_t S_t

The backward is ``jax.vjp`` of that same float64 recurrence, so it is the exact VJP by
construction rather than a hand-derived formula.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tops_core import SimpleGLAGrads
from tops_plugins_ref.recurrence import forward_results, on_host_in_float64, scan_sequences, sequence_layout

DIFFERENTIABLE = ("q", "k", "v", "g", "g_gamma", "initial_state")


def forward(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, config):
    """``(o, final_state)`` for ``tops_core.ops.simple_gla.Forward``."""

    def compute(inputs):
        primals, layout = _primals_and_layout(inputs)
        o, final_states = _outputs(*primals, scale, layout)
        return o, final_states if output_final_state else None

    inputs = dict(q=q, k=k, v=v, g=g, g_gamma=g_gamma, initial_state=initial_state, cu_seqlens=cu_seqlens)
    return on_host_in_float64(compute, forward_results(q, v, cu_seqlens, output_final_state), inputs)


def backward(q, k, v, do, *, g, g_gamma, scale, initial_state, dht, cu_seqlens, config):
    """``SimpleGLAGrads`` for ``tops_core.ops.simple_gla.Backward``: a gradient for each given input."""
    given = dict(q=q, k=k, v=v, g=g, g_gamma=g_gamma, initial_state=initial_state)
    grad_specs = {name: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype) for name, x in given.items()}

    def compute(inputs):
        primals, layout = _primals_and_layout(inputs)
        final_state_cotangent = np.zeros_like(primals[-1]) if inputs["dht"] is None else inputs["dht"]
        grads = _gradients(primals, scale, layout, inputs["do"], final_state_cotangent)
        return {name: None if inputs[name] is None else grad for name, grad in zip(DIFFERENTIABLE, grads)}

    grads = on_host_in_float64(compute, grad_specs, dict(given, do=do, dht=dht, cu_seqlens=cu_seqlens))
    return SimpleGLAGrads(**{"d" + name: grads[name] for name in DIFFERENTIABLE})


def _primals_and_layout(inputs):
    """The differentiable inputs in DIFFERENTIABLE order, absent ones as zeros (no decay, a zero
    initial state), and the layout of the sequences."""
    B, T, H, K = inputs["q"].shape
    N = B if inputs["cu_seqlens"] is None else inputs["cu_seqlens"].shape[0] - 1
    absent = dict(g=np.zeros((B, T, H)), g_gamma=np.zeros(()), initial_state=np.zeros((N, H, K, inputs["v"].shape[-1])))
    primals = tuple(absent[name] if inputs[name] is None else inputs[name] for name in DIFFERENTIABLE)
    return primals, sequence_layout(inputs["cu_seqlens"], B, T)


@jax.jit
def _outputs(q, k, v, g, g_gamma, initial_state, scale, layout):
    """``o`` ``[B, T, H, V]`` and the final states ``[N, H, K, V]``."""
    B, T = q.shape[:2]

    def step(state, token):
        q_t, k_t, v_t, a_t = token
        state = jnp.exp(a_t)[:, None, None] * state + k_t[:, :, None] * v_t[:, None, :]
        return state, scale * jnp.einsum("hk,hkv->hv", q_t, state)

    decay = g + g_gamma  # a scalar or [H] g_gamma broadcasts over [B, T, H]
    tokens = tuple(x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, decay))
    o, final_states = scan_sequences(step, tokens, initial_state, layout)
    return o.reshape(v.shape), final_states


@jax.jit
def _gradients(primals, scale, layout, do, dht):
    _, pullback = jax.vjp(lambda *args: _outputs(*args, scale, layout), *primals)
    return pullback((do, dht))
