"""``tpu_pallas.recurrent`` for simple_gla (forward only): the decode kernel (``tops_plugins_tpu_pallas.recurrent``)
with the decay ``exp(g_t + g_gamma)`` the same for every key and no delta rule."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from tops_core.ops.simple_gla import log_decay

from tops_plugins_tpu_pallas import recurrent

_F32 = jnp.float32


def forward(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, config, ssm_state_indices=None):
    """``(o, final_state)`` of simple_gla (the ``Forward`` protocol of ``tops_core.ops.simple_gla``), a state pool served
    in place (``Implementation.serves_pools``); no ``cu_seqlens``."""
    del cu_seqlens  # the capabilities leave packed calls out
    return _forward(q, k, v, g, g_gamma, initial_state, ssm_state_indices, scale=scale, output_final_state=output_final_state, config=config)


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "config"))
def _forward(q, k, v, g, g_gamma, initial_state, ssm_state_indices, *, scale, output_final_state, config):
    decay = jnp.broadcast_to(jnp.exp(log_decay(g, g_gamma, q.shape[:3], _F32))[..., None], q.shape)
    return recurrent.run(
        q.astype(_F32) * scale, k.astype(_F32), decay, v, None, initial_state, ssm_state_indices,
        output_final_state=output_final_state, config=config,
    )
