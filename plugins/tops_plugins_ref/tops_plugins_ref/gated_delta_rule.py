"""gated_delta_rule reference: the op's entry points, computed by ``tops_plugins_ref.host.gated_delta_rule``.

    S_t' = exp(g_t) S_{t-1}
    S_t  = S_t' + beta_t * k_t^T (v_t - k_t S_t')
    o_t  = scale * q_t S_t

per value head (grouped value heads and ``use_qk_l2norm`` as kda's), token by token in float64 NumPy on
the host; the backward is kda's hand-written reverse sweep.
"""

from __future__ import annotations

import functools

from tops_core import GatedDeltaRuleGrads
from tops_plugins_ref.callback import forward_results, gradient_results, on_host_in_float64
from tops_plugins_ref.host import gated_delta_rule as host


def forward(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, config):
    """``(o, final_state)`` for ``tops_core.ops.gated_delta_rule.Forward``."""
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens)
    compute = functools.partial(host.forward, scale=scale, output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm)
    results = on_host_in_float64(compute, forward_results(q, v, cu_seqlens, output_final_state), inputs)
    return results["o"], results["final_state"]


def backward(q, k, v, g, beta, do, *, scale, initial_state, dht, cu_seqlens, use_qk_l2norm, config):
    """``GatedDeltaRuleGrads`` for ``tops_core.ops.gated_delta_rule.Backward``: a gradient for each given input."""
    given = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    compute = functools.partial(host.backward, scale=scale, use_qk_l2norm=use_qk_l2norm)
    grads = on_host_in_float64(compute, gradient_results(given), dict(given, do=do, dht=dht, cu_seqlens=cu_seqlens))
    return GatedDeltaRuleGrads(**grads)
