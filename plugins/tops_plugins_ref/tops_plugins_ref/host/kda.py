"""kda in float64 NumPy: the delta-rule recurrence and its exact VJP as a reverse sweep.

Per sequence and value head, with ``D_t = diag(exp(g_t))`` (one decay per key row):

    S'_t = D_t S_{t-1}
    r_t  = v_t - k_t S'_t                  what the decayed state does not yet recall for k_t
    S_t  = S'_t + beta_t k_t^T r_t
    o_t  = scale q_t S_t

With ``G_t = dS_t + scale q_t^T do_t`` the total cotangent of ``S_t`` (``dS_t`` from the future,
``dht`` after the last token), reverse the lines one at a time:

    dq_t     = scale S_t do_t^T
    u_t      = G_t r_t^T                   [K]
    dbeta_t  = k_t . u_t
    dr_t     = beta_t k_t G_t              [V];   dv_t = dr_t
    dk_t     = beta_t u_t - S'_t dr_t^T
    dS'_t    = G_t - k_t^T dr_t
    dg_t     = sum over V of dS'_t * S'_t  [K]   (d exp(g) = exp(g) dg, and exp(g) S_{t-1} = S'_t)
    dS_{t-1} = D_t dS'_t

With ``use_qk_l2norm`` the recurrence sees ``x^ = x / n``, ``n = sqrt(sum over K of x^2 + 1e-6)``,
for ``x`` = ``q`` and ``k``; its Jacobian is ``(I - x^ x^T) / n`` (symmetric), so
``dx = (dx^ - x^ (x^ . dx^)) / n``.

Value head ``j`` of ``HV = G H`` reads query/key head ``j // G``: the sweep runs on ``q`` and ``k``
repeated ``G`` times along the heads, so ``dq`` and ``dk`` sum over each group.

With ``use_gate`` the sweep's ``g`` is the gate of the raw ``g``: with ``x = g + dt_bias`` and
``a = exp(A_log)`` (``dt_bias`` 0 and ``a`` 1 when absent), since ``softplus' = sigmoid``,
``sigmoid'(z) = s (1 - s)`` for ``s = sigmoid(z)``, and ``d a / d A_log = a``:

    g_eff = -a softplus(x)            dx = -a sigmoid(x) dg_eff              dA_log = sum of g_eff dg_eff
    g_eff = lower_bound sigmoid(z)    dz = lower_bound s (1 - s) dg_eff
      with z = a x                    dx = a dz                              dA_log = sum of z dz

and ``dg = dx``; ``ddt_bias`` sums ``dx`` over the tokens, ``dA_log`` over the keys too. With
``use_beta_sigmoid`` the sweep's ``beta`` is ``c sigmoid(beta)`` (``c = 2`` with
``allow_neg_eigval``, else 1), so ``dbeta = c s (1 - s) dbeta_eff``.
"""

from __future__ import annotations

import functools

import numpy as np

from tops_plugins_ref.host import sweep
from tops_plugins_ref.host.sequences import Sequences

L2NORM_EPSILON = 1e-6
"""The op contract's ``tops_core.ops.kda.L2NORM_EPSILON``, written out: the host package imports nothing of JAX (a test checks they agree)."""


def forward(
    inputs: dict, *, scale: float, output_final_state: bool, use_qk_l2norm: bool, use_gate: bool = False,
    lower_bound: float | None = None, use_beta_sigmoid: bool = False, allow_neg_eigval: bool = False,
) -> dict:
    """``o`` ``[B, T, HV, V]`` and ``final_state`` ``[N, HV, K, V]`` (None unless requested)."""
    g, beta = _activated(inputs, use_gate, lower_bound, use_beta_sigmoid, allow_neg_eigval)
    sequences, tokens, initial_states, _ = _prepare(inputs, g, beta, use_qk_l2norm)
    return sweep.outputs(sequences, functools.partial(_step, scale=scale), tokens, initial_states, output_final_state)


def backward(
    inputs: dict, *, scale: float, use_qk_l2norm: bool, use_gate: bool = False, lower_bound: float | None = None,
    use_beta_sigmoid: bool = False, allow_neg_eigval: bool = False,
) -> dict:
    """``dq``, ``dk``, ``dv``, ``dg``, ``dbeta``, ``dinitial_state``, ``dA_log`` and ``ddt_bias`` (None
    for an absent input); ``dht`` None means zero."""
    g, beta = _activated(inputs, use_gate, lower_bound, use_beta_sigmoid, allow_neg_eigval)
    sequences, tokens, initial_states, norms = _prepare(inputs, g, beta, use_qk_l2norm)
    (dq, dk, dv, dg, dbeta), dinitial_states = sweep.token_gradients(
        sequences, functools.partial(_step, scale=scale), functools.partial(_step_vjp, scale=scale),
        tokens, initial_states, inputs["do"], inputs["dht"],
    )
    heads = inputs["q"].shape[2]
    dq, dk = _group_sum(dq, heads), _group_sum(dk, heads)
    if use_qk_l2norm:
        (q, q_norm), (k, k_norm) = norms
        dq, dk = _l2norm_vjp(q, q_norm, dq), _l2norm_vjp(k, k_norm, dk)
    dA_log = ddt_bias = None
    if use_gate:
        dg, dA_log, ddt_bias = _gate_vjp(inputs["g"], inputs["A_log"], inputs["dt_bias"], lower_bound, dg)
    if use_beta_sigmoid:
        dbeta = _beta_sigmoid_vjp(inputs["beta"], allow_neg_eigval, dbeta)
    return {"dq": dq, "dk": dk, "dv": dv, "dg": dg, "dbeta": dbeta, "dinitial_state": dinitial_states,
            "dA_log": dA_log, "ddt_bias": ddt_bias}


def _activated(inputs: dict, use_gate: bool, lower_bound: float | None, use_beta_sigmoid: bool, allow_neg_eigval: bool):
    """The log decay and the write strength the sweep runs on."""
    g, beta = inputs["g"], inputs["beta"]
    if use_gate:
        g = _gate(g, inputs["A_log"], inputs["dt_bias"], lower_bound)
    if use_beta_sigmoid:
        beta = (2 if allow_neg_eigval else 1) * _sigmoid(beta)
    return g, beta


def _prepare(inputs: dict, g: np.ndarray, beta: np.ndarray, use_qk_l2norm: bool):
    """The sequences, the padded ``(q, k, v, g, beta)`` (q and k normalised when asked, and repeated
    per value head), the initial states (zeros when absent), and for the backward each normalised ``(x^, n)``."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    B, T, H, K = q.shape
    HV = v.shape[2]
    sequences = Sequences(inputs["cu_seqlens"], B, T)
    norms = None
    if use_qk_l2norm:
        norms = (_l2norm(q), _l2norm(k))
        (q, _), (k, _) = norms
    # np.repeat repeats each head in place: value heads h G .. h G + G - 1 read head h.
    q, k = np.repeat(q, HV // H, axis=2), np.repeat(k, HV // H, axis=2)
    initial_states = inputs["initial_state"]
    if initial_states is None:
        initial_states = np.zeros((sequences.count, HV, K, v.shape[-1]))
    tokens = tuple(sequences.pad(x) for x in (q, k, v, g, beta))
    return sequences, tokens, initial_states, norms


def _group_sum(dx, heads):
    """``[B, T, HV, K]`` cotangents of the repeated heads to ``[B, T, H, K]``."""
    B, T, HV, K = dx.shape
    return dx.reshape(B, T, heads, HV // heads, K).sum(axis=3)


def _sigmoid(x):
    return np.exp(-np.logaddexp(0, -x))  # no overflow for large negative x


def _sigmoid_derivative(x):
    return _sigmoid(x) * _sigmoid(-x)  # s (1 - s) without 1 - s cancelling for large x


def _gate_terms(g, A_log, dt_bias):
    """``x = g + dt_bias`` ``[..., HV, K]`` and ``a = exp(A_log)`` ``[HV, 1]``, 0 and 1 when absent."""
    HV, K = g.shape[-2:]
    x = g if dt_bias is None else g + dt_bias.reshape(HV, K)
    a = np.ones((HV, 1)) if A_log is None else np.exp(A_log)[:, None]
    return x, a


def _gate(g, A_log, dt_bias, lower_bound):
    x, a = _gate_terms(g, A_log, dt_bias)
    if lower_bound is None:
        return -a * np.logaddexp(0, x)
    return lower_bound * _sigmoid(a * x)


def _gate_vjp(g, A_log, dt_bias, lower_bound, dg_eff):
    """``(dg, dA_log, ddt_bias)`` from the gate's cotangent, None for an absent ``A_log`` or ``dt_bias``."""
    x, a = _gate_terms(g, A_log, dt_bias)
    if lower_bound is None:
        dx = -a * _sigmoid(x) * dg_eff
        dlog_a = -a * np.logaddexp(0, x) * dg_eff
    else:
        z = a * x
        dz = lower_bound * _sigmoid_derivative(z) * dg_eff
        dx = a * dz
        dlog_a = dz * z
    dA_log = None if A_log is None else dlog_a.sum(axis=(0, 1, 3))
    ddt_bias = None if dt_bias is None else dx.sum(axis=(0, 1)).reshape(-1)
    return dx, dA_log, ddt_bias


def _beta_sigmoid_vjp(beta, allow_neg_eigval, dbeta_eff):
    return (2 if allow_neg_eigval else 1) * _sigmoid_derivative(beta) * dbeta_eff


def _l2norm(x):
    norm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPSILON)
    return x / norm, norm


def _l2norm_vjp(normalised, norm, dnormalised):
    return (dnormalised - normalised * np.sum(normalised * dnormalised, axis=-1, keepdims=True)) / norm


def _step(state, token, *, scale):
    q, k, v, g, beta = token  # [N, HV, K] (q, k, g), [N, HV, V], [N, HV]
    decayed = np.exp(g)[..., :, None] * state
    residual = v - (k[..., None, :] @ decayed)[..., 0, :]
    state = decayed + beta[..., None, None] * k[..., :, None] * residual[..., None, :]
    return state, scale * (q[..., None, :] @ state)[..., 0, :]


def _step_vjp(state, next_state, token, dnext_state, do, *, scale):
    q, k, v, g, beta = token
    decay = np.exp(g)[..., :, None]
    decayed = decay * state
    residual = v - (k[..., None, :] @ decayed)[..., 0, :]
    total = dnext_state + scale * q[..., :, None] * do[..., None, :]
    dq = scale * (next_state @ do[..., :, None])[..., 0]
    u = (total @ residual[..., :, None])[..., 0]
    dbeta = np.sum(k * u, axis=-1)
    dresidual = beta[..., None] * (k[..., None, :] @ total)[..., 0, :]
    dk = beta[..., None] * u - (decayed @ dresidual[..., :, None])[..., 0]
    ddecayed = total - k[..., :, None] * dresidual[..., None, :]
    dg = np.einsum("...kv,...kv->...k", ddecayed, decayed)
    return (dq, dk, dresidual, dg, dbeta), decay * ddecayed
