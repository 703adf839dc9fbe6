"""kda reference: the op's entry points, computed by ``tops_plugins_ref.host.kda``.

    S_t' = diag(exp(g_t)) S_{t-1}
    S_t  = S_t' + beta_t * k_t^T (v_t - k_t S_t')
    o_t  = scale * q_t S_t

per value head, reading query/key head ``j // G`` for value head ``j`` of ``HV = G H``; with ``q``
and ``k`` first normalised over ``K`` when ``use_qk_l2norm``: ``x / sqrt(sum(x^2) + 1e-6)``,
flash-linear-attention's epsilon (docs/ops.md "kda"); with ``g`` the output of the in-op gate when
``use_gate`` and ``beta`` that of the sigmoid when ``use_beta_sigmoid``. Token by token in float64
NumPy on the host; the backward is a hand-written reverse sweep, the exact VJP through the
normalisation and the activations too (their derivation is in the host module).
"""

from __future__ import annotations

import functools

from tops_core import KDAGrads
from tops_plugins_ref.callback import forward_results, gradient_results, on_host_in_float64
from tops_plugins_ref.host import kda as host


# The op always passes every argument; the gate's and beta's default to off for direct callers (the plugin's tests).
def forward(
    q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, use_gate=False, A_log=None,
    dt_bias=None, lower_bound=None, use_beta_sigmoid=False, allow_neg_eigval=False, config,
):
    """``(o, final_state)`` for ``tops_core.ops.kda.Forward``."""
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, A_log=A_log, dt_bias=dt_bias,
                  cu_seqlens=cu_seqlens)
    compute = functools.partial(
        host.forward, scale=scale, output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm, use_gate=use_gate,
        lower_bound=lower_bound, use_beta_sigmoid=use_beta_sigmoid, allow_neg_eigval=allow_neg_eigval,
    )
    results = on_host_in_float64(compute, forward_results(q, v, cu_seqlens, output_final_state), inputs)
    return results["o"], results["final_state"]


def backward(
    q, k, v, g, beta, do, *, scale, initial_state, dht, cu_seqlens, use_qk_l2norm, use_gate=False, A_log=None,
    dt_bias=None, lower_bound=None, use_beta_sigmoid=False, allow_neg_eigval=False, config,
):
    """``KDAGrads`` for ``tops_core.ops.kda.Backward``: a gradient for each given input."""
    given = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, A_log=A_log, dt_bias=dt_bias)
    compute = functools.partial(
        host.backward, scale=scale, use_qk_l2norm=use_qk_l2norm, use_gate=use_gate, lower_bound=lower_bound,
        use_beta_sigmoid=use_beta_sigmoid, allow_neg_eigval=allow_neg_eigval,
    )
    grads = on_host_in_float64(compute, gradient_results(given), dict(given, do=do, dht=dht, cu_seqlens=cu_seqlens))
    return KDAGrads(**grads)
