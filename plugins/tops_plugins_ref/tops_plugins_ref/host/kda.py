"""kda in float64 NumPy: the delta-rule recurrence and its exact VJP as a reverse sweep.

Per sequence and head, with ``D_t = diag(exp(g_t))`` (one decay per key row):

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
"""

from __future__ import annotations

import functools

import numpy as np

from tops_plugins_ref.host import sweep
from tops_plugins_ref.host.sequences import Sequences

L2NORM_EPSILON = 1e-6
"""The op contract's ``tops_core.ops.kda.L2NORM_EPSILON``, written out: the host package imports nothing of JAX (a test checks they agree)."""


def forward(inputs: dict, *, scale: float, output_final_state: bool, use_qk_l2norm: bool) -> dict:
    """``o`` ``[B, T, H, V]`` and ``final_state`` ``[N, H, K, V]`` (None unless requested)."""
    sequences, tokens, initial_states, _ = _prepare(inputs, use_qk_l2norm)
    o, final_states = sweep.run(functools.partial(_step, scale=scale), tokens, initial_states, sequences.valid)
    return {"o": sequences.unpad(o), "final_state": final_states if output_final_state else None}


def backward(inputs: dict, *, scale: float, use_qk_l2norm: bool) -> dict:
    """``dq``, ``dk``, ``dv``, ``dg``, ``dbeta`` and ``dinitial_state``; ``dht`` None means zero."""
    sequences, tokens, initial_states, norms = _prepare(inputs, use_qk_l2norm)
    dfinal_states = np.zeros_like(initial_states) if inputs["dht"] is None else inputs["dht"]
    grads, dinitial_states = sweep.vjp(
        functools.partial(_step, scale=scale), functools.partial(_step_vjp, scale=scale),
        tokens, initial_states, sequences.valid, sequences.pad(inputs["do"]), dfinal_states,
    )
    dq, dk, dv, dg, dbeta = (sequences.unpad(x) for x in grads)
    if use_qk_l2norm:
        (q, q_norm), (k, k_norm) = norms
        dq, dk = _l2norm_vjp(q, q_norm, dq), _l2norm_vjp(k, k_norm, dk)
    return {"dq": dq, "dk": dk, "dv": dv, "dg": dg, "dbeta": dbeta, "dinitial_state": dinitial_states}


def _prepare(inputs: dict, use_qk_l2norm: bool):
    """The sequences, the padded ``(q, k, v, g, beta)`` (q and k normalised when asked), the
    initial states (zeros when absent), and for the backward each normalised ``(x^, n)``."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    B, T, H, K = q.shape
    sequences = Sequences(inputs["cu_seqlens"], B, T)
    norms = None
    if use_qk_l2norm:
        norms = (_l2norm(q), _l2norm(k))
        (q, _), (k, _) = norms
    initial_states = inputs["initial_state"]
    if initial_states is None:
        initial_states = np.zeros((sequences.count, H, K, v.shape[-1]))
    tokens = tuple(sequences.pad(x) for x in (q, k, v, inputs["g"], inputs["beta"]))
    return sequences, tokens, initial_states, norms


def _l2norm(x):
    norm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPSILON)
    return x / norm, norm


def _l2norm_vjp(normalised, norm, dnormalised):
    return (dnormalised - normalised * np.sum(normalised * dnormalised, axis=-1, keepdims=True)) / norm


def _step(state, token, *, scale):
    q, k, v, g, beta = token  # [N, H, K] (q, k, g), [N, H, V], [N, H]
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
