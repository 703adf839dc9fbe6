"""gla token by token (``xla.recurrent``, forward only): the decode step of ``tops_plugins_xla.recurrent``.

Per token, all rows and heads at once, in float32 (float64 for float64 inputs)::

    S = diag(exp(g_t)) S + k_t^T v_t,    o_t = scale * q_t S
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tops_core.ops.base import state_dtype
from tops_plugins_xla import recurrent
from tops_plugins_xla.sweep import einsum


def forward(q, k, v, g, *, scale, initial_state, output_final_state, cu_seqlens, config):
    """``(o, final_state)`` of gla (the ``Forward`` protocol of ``tops_core.ops.gla``); no ``cu_seqlens``."""
    del cu_seqlens, config  # the capabilities leave packed calls out; nothing to tune
    return _forward(q, k, v, g, initial_state, scale=scale, output_final_state=output_final_state)


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state"))
def _forward(q, k, v, g, initial_state, *, scale, output_final_state):
    B, T, H, K = q.shape
    dtype = state_dtype(q.dtype)
    state = jnp.zeros((B, H, K, v.shape[-1]), dtype) if initial_state is None else initial_state.astype(dtype)

    def step(state, token):
        q_t, k_t, v_t, g_t = token
        state = jnp.exp(g_t)[..., None] * state + k_t[..., :, None] * v_t[..., None, :]
        return state, einsum("bhk,bhkv->bhv", q_t * scale, state)

    state, o = recurrent.scan(step, state, tuple(x.astype(dtype) for x in (q, k, v, g)))
    return o.astype(v.dtype), state if output_final_state else None
