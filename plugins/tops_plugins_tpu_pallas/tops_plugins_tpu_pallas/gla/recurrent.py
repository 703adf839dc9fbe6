"""``tpu_pallas.recurrent`` for gla (forward only): the decode kernel (``tops_plugins_tpu_pallas.recurrent``) with a
decay per key and no delta rule."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tops_plugins_tpu_pallas import recurrent

_F32 = jnp.float32


def forward(q, k, v, g, *, scale, initial_state, output_final_state, cu_seqlens, config, ssm_state_indices=None):
    """``(o, final_state)`` of gla (the ``Forward`` protocol of ``tops_core.ops.gla``), a state pool served in place
    (``Implementation.serves_pools``); no ``cu_seqlens``."""
    del cu_seqlens  # the capabilities leave packed calls out
    return _forward(q, k, v, g, initial_state, ssm_state_indices, scale=scale, output_final_state=output_final_state, config=config)


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "config"))
def _forward(q, k, v, g, initial_state, ssm_state_indices, *, scale, output_final_state, config):
    return recurrent.run(
        q.astype(_F32) * scale, k.astype(_F32), jnp.exp(g.astype(_F32)), v, None, initial_state, ssm_state_indices,
        output_final_state=output_final_state, config=config,
    )
