"""``tpu_pallas.recurrent`` for kda (forward only): the decode kernel (``tops_plugins_tpu_pallas.recurrent``) with the
delta rule. The gate and beta are activated, ``q, k`` normalised and repeated to the value heads before it: per
token, a few vectors of ``K`` beside each head's ``K x V`` state."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from tops_core.ops.kda import Activations, token_inputs

from tops_plugins_tpu_pallas import recurrent

_F32 = jnp.float32


def forward(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, config,
            use_gate=False, A_log=None, dt_bias=None, lower_bound=None, use_beta_sigmoid=False, allow_neg_eigval=False,
            ssm_state_indices=None):
    """``(o, final_state)`` of kda (the ``Forward`` protocol of ``tops_core.ops.kda``), a state pool served in place
    (``Implementation.serves_pools``); no ``cu_seqlens``."""
    del cu_seqlens  # the capabilities leave packed calls out
    activations = Activations.of(use_gate, lower_bound, use_beta_sigmoid, allow_neg_eigval)
    return run(q, k, v, g, beta, A_log, dt_bias, initial_state, ssm_state_indices, scale=scale,
               output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm, activations=activations, config=config)


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "use_qk_l2norm", "activations", "config"))
def run(q, k, v, g, beta, A_log, dt_bias, initial_state, ssm_state_indices, *, scale, output_final_state, use_qk_l2norm,
        activations, config):
    """The decode kernel on ``g`` per key ``[B, T, HV, K]`` as the call gives it (raw with ``activations.use_gate``)."""
    groups = v.shape[2] // q.shape[2]
    q, k, log_decay, strength = token_inputs(
        q, k, g, beta, A_log, dt_bias, activations=activations, use_qk_l2norm=use_qk_l2norm, dtype=_F32,
    )
    q, k = (jnp.repeat(x, groups, axis=2) for x in (q, k))  # value head j reads key head j // groups
    return recurrent.run(
        q * scale, k, jnp.exp(log_decay), v, strength[..., None] * k, initial_state, ssm_state_indices,
        output_final_state=output_final_state, config=config,
    )
