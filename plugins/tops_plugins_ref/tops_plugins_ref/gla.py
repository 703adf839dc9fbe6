"""gla reference: the op's entry points, computed by ``tops_plugins_ref.host.gla``.

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t
    o_t = scale * q_t S_t

token by token in float64 NumPy on the host; the backward is a hand-written reverse sweep, the
exact VJP of that recurrence (its derivation is in the host module).
"""

from __future__ import annotations

import functools

from tops_core import GLAGrads
from tops_plugins_ref.callback import forward_results, gradient_results, on_host_in_float64
from tops_plugins_ref.host import gla as host


def forward(q, k, v, g, *, scale, initial_state, output_final_state, cu_seqlens, config):
    """``(o, final_state)`` for ``tops_core.ops.gla.Forward``."""
    inputs = dict(q=q, k=k, v=v, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens)
    compute = functools.partial(host.forward, scale=scale, output_final_state=output_final_state)
    results = on_host_in_float64(compute, forward_results(q, v, cu_seqlens, output_final_state), inputs)
    return results["o"], results["final_state"]


def backward(q, k, v, g, do, *, scale, initial_state, dht, cu_seqlens, config):
    """``GLAGrads`` for ``tops_core.ops.gla.Backward``: a gradient for each given input."""
    given = dict(q=q, k=k, v=v, g=g, initial_state=initial_state)
    compute = functools.partial(host.backward, scale=scale)
    grads = on_host_in_float64(compute, gradient_results(given), dict(given, do=do, dht=dht, cu_seqlens=cu_seqlens))
    return GLAGrads(**grads)
