"""KDA, chunked, in plain jax.numpy: the op's entry points into the delta rule's sweeps (``tops_plugins_xla.delta_rule``),
with gates per key, the gate and beta activations of ``tops_core.ops.kda.Activations``."""

from __future__ import annotations

from tops_core.ops.kda import Activations
from tops_plugins_xla.delta_rule import run_backward, run_forward


def forward(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, config,
            use_gate=False, A_log=None, dt_bias=None, lower_bound=None, use_beta_sigmoid=False, allow_neg_eigval=False):
    """``(o, final_state)`` of kda (the ``Forward`` protocol of ``tops_core.ops.kda``)."""
    return run_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale=scale,
                       output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm, chunk_size=config.chunk_size,
                       activations=Activations.of(use_gate, lower_bound, use_beta_sigmoid, allow_neg_eigval))


def backward(q, k, v, g, beta, do, *, scale, initial_state, dht, cu_seqlens, use_qk_l2norm, config,
             use_gate=False, A_log=None, dt_bias=None, lower_bound=None, use_beta_sigmoid=False, allow_neg_eigval=False):
    """The VJP of kda (the ``Backward`` protocol of ``tops_core.ops.kda``)."""
    return run_backward(q, k, v, g, beta, A_log, dt_bias, do, initial_state, dht, cu_seqlens, scale=scale,
                        use_qk_l2norm=use_qk_l2norm, chunk_size=config.chunk_size,
                        activations=Activations.of(use_gate, lower_bound, use_beta_sigmoid, allow_neg_eigval))
