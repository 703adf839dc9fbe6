"""kda token by token (``xla.recurrent``, forward only): the decode step of ``tops_plugins_xla.recurrent``.

Per token, all rows and value heads at once, in float32 (float64 for float64 inputs), with the gate
and beta activated and ``q, k`` normalised and repeated to the value heads as ``xla.chunk`` does::

    S = diag(exp(g_t)) S,    S = S + k_t^T (beta_t * (v_t - k_t S)),    o_t = scale * q_t S
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tops_core.ops.base import state_dtype
from tops_core.ops.kda import Activations, token_inputs
from tops_plugins_xla import recurrent
from tops_plugins_xla.sweep import einsum


def forward(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, config,
            use_gate=False, A_log=None, dt_bias=None, lower_bound=None, use_beta_sigmoid=False, allow_neg_eigval=False):
    """``(o, final_state)`` of kda (the ``Forward`` protocol of ``tops_core.ops.kda``); no ``cu_seqlens``."""
    del cu_seqlens, config  # the capabilities leave packed calls out; nothing to tune
    return step_all(q, k, v, g, beta, A_log, dt_bias, initial_state, scale=scale, output_final_state=output_final_state,
                    use_qk_l2norm=use_qk_l2norm, activations=Activations.of(use_gate, lower_bound, use_beta_sigmoid, allow_neg_eigval))


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "use_qk_l2norm", "activations"))
def step_all(q, k, v, g, beta, A_log, dt_bias, initial_state, *, scale, output_final_state, use_qk_l2norm, activations):
    """Every token in turn: ``g`` per key ``[B, T, HV, K]``, or ``[B, T, HV, 1]`` one gate per head."""
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    dtype = state_dtype(q.dtype)
    q, k, g, beta = token_inputs(q, k, g, beta, A_log, dt_bias, activations=activations, use_qk_l2norm=use_qk_l2norm, dtype=dtype)
    state = jnp.zeros((B, HV, K, V), dtype) if initial_state is None else initial_state.astype(dtype)

    def step(state, token):
        q_t, k_t, v_t, g_t, beta_t = token
        q_t, k_t = (jnp.repeat(x, HV // H, axis=1) for x in (q_t, k_t))  # value head j reads key head j // (HV / H)
        state = jnp.exp(g_t)[..., :, None] * state
        delta = beta_t[..., None] * (v_t - einsum("bhk,bhkv->bhv", k_t, state))
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, einsum("bhk,bhkv->bhv", q_t, state)

    tokens = (q * scale, k, v.astype(dtype), g, beta)
    state, o = recurrent.scan(step, state, tokens)
    return o.astype(v.dtype), state if output_final_state else None
