"""``tpu_pallas.recurrent`` for gated_delta_rule (forward only): kda's decode step (``kda/recurrent.py``) with the
gate, one per head and token, given to every key."""

from __future__ import annotations

import jax.numpy as jnp
from tops_core.ops.kda import Activations

from tops_plugins_tpu_pallas.kda import recurrent as kda_recurrent


def forward(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, config,
            ssm_state_indices=None):
    """``(o, final_state)`` of gated_delta_rule (the ``Forward`` protocol of ``tops_core.ops.gated_delta_rule``), a state
    pool served in place; no ``cu_seqlens``."""
    del cu_seqlens  # the capabilities leave packed calls out
    per_key = jnp.broadcast_to(g[..., None], (*g.shape, q.shape[-1]))  # a few bytes per token beside each K x V state
    return kda_recurrent.run(q, k, v, per_key, beta, None, None, initial_state, ssm_state_indices, scale=scale,
                             output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm, activations=Activations(),
                             config=config)
