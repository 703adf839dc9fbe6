"""gated_delta_rule token by token (``xla.recurrent``, forward only): kda's decode step with the gate of width 1."""

from __future__ import annotations

from tops_core.ops.kda import Activations
from tops_plugins_xla.kda import recurrent as kda_recurrent


def forward(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, config):
    """``(o, final_state)`` of gated_delta_rule (the ``Forward`` protocol of ``tops_core.ops.gated_delta_rule``); no ``cu_seqlens``."""
    del cu_seqlens, config  # the capabilities leave packed calls out; nothing to tune
    return kda_recurrent.step_all(q, k, v, g[..., None], beta, None, None, initial_state, scale=scale,
                                  output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm, activations=Activations())
