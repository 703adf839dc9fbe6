"""gated_delta_rule, chunked, in plain jax.numpy: the op's entry points into the delta rule's sweeps
(``tops_plugins_xla.delta_rule``) with its gate as one of width 1 (``[B, T, HV, 1]``), so that every chunk's
pair products are dense (``tops_plugins_xla.intra_per_head``) rather than kda's level by level."""

from __future__ import annotations

from tops_core import GatedDeltaRuleGrads
from tops_core.ops.kda import Activations
from tops_plugins_xla.delta_rule import run_backward, run_forward

_AS_GIVEN = Activations()  # g and beta are the log decay and the write strength themselves


def forward(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, config):
    """``(o, final_state)`` of gated_delta_rule (the ``Forward`` protocol of ``tops_core.ops.gated_delta_rule``)."""
    return run_forward(q, k, v, g[..., None], beta, None, None, initial_state, cu_seqlens, scale=scale,
                       output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm, chunk_size=config.chunk_size,
                       activations=_AS_GIVEN)


def backward(q, k, v, g, beta, do, *, scale, initial_state, dht, cu_seqlens, use_qk_l2norm, config):
    """The VJP of gated_delta_rule (the ``Backward`` protocol of ``tops_core.ops.gated_delta_rule``)."""
    grads = run_backward(q, k, v, g[..., None], beta, None, None, do, initial_state, dht, cu_seqlens, scale=scale,
                         use_qk_l2norm=use_qk_l2norm, chunk_size=config.chunk_size, activations=_AS_GIVEN)
    return GatedDeltaRuleGrads(dq=grads.dq, dk=grads.dk, dv=grads.dv, dg=grads.dg[..., 0], dbeta=grads.dbeta,
                               dinitial_state=grads.dinitial_state)
