"""gated_delta_rule in float64 NumPy: kda's recurrence and reverse sweep with one gate for every key.

``S_t' = exp(g_t) S_{t-1}`` is kda's ``diag(exp(g_t)) S_{t-1}`` with ``g_t`` on every key, so the sweeps
are ``tops_plugins_ref.host.kda``'s on ``g`` repeated over ``K``; the gradient of a gate shared by the
keys is the sum of the per-key gradients (the transpose of the repeat).
"""

from __future__ import annotations

import numpy as np

from tops_plugins_ref.host import kda


def forward(inputs: dict, *, scale: float, output_final_state: bool, use_qk_l2norm: bool) -> dict:
    """``o`` ``[B, T, HV, V]`` and ``final_state`` ``[N, HV, K, V]`` (None unless requested)."""
    return kda.forward(_per_key(inputs), scale=scale, output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm)


def backward(inputs: dict, *, scale: float, use_qk_l2norm: bool) -> dict:
    """``dq``, ``dk``, ``dv``, ``dg``, ``dbeta`` and ``dinitial_state``; ``dht`` None means zero."""
    grads = kda.backward(_per_key(inputs), scale=scale, use_qk_l2norm=use_qk_l2norm)
    return {**grads, "dg": np.sum(grads["dg"], axis=-1)}


def _per_key(inputs: dict) -> dict:
    K = inputs["q"].shape[-1]
    return {**inputs, "g": np.repeat(inputs["g"][..., None], K, axis=-1), "A_log": None, "dt_bias": None}
