"""simple_gla in float64 NumPy: the forward recurrence and its exact VJP as a reverse sweep.

Per sequence and head, with ``lambda_t = exp(a_t)`` and ``a_t = g_t + g_gamma``:

    S_t = lambda_t S_{t-1} + k_t^T v_t,    o_t = scale q_t S_t

Write ``dS_t`` for the cotangent of ``S_t`` coming from the future (``dht`` after the last token).
The step's own output adds ``scale q_t^T do_t``, so the total is ``G_t = dS_t + scale q_t^T do_t``,
and differentiating the two lines term by term:

    dq_t = scale S_t do_t^T         dk_t = G_t v_t^T         dv_t = k_t G_t
    da_t = lambda_t <G_t, S_{t-1}>  (<,> the sum of the elementwise product)
    dS_{t-1} = lambda_t G_t

``dinitial_state`` is ``dS_0``; ``dg = da``, and ``dg_gamma`` is ``da`` summed over the batch and
the tokens (and over the heads too for a scalar ``g_gamma``).
"""

from __future__ import annotations

import functools

import numpy as np

from tops_plugins_ref.host import sweep
from tops_plugins_ref.host.sequences import Sequences


def forward(inputs: dict, *, scale: float, output_final_state: bool) -> dict:
    """``o`` ``[B, T, H, V]`` and ``final_state`` ``[N, H, K, V]`` (None unless requested)."""
    sequences, tokens, initial_states = _prepare(inputs)
    return sweep.outputs(sequences, functools.partial(_step, scale=scale), tokens, initial_states, output_final_state)


def backward(inputs: dict, *, scale: float) -> dict:
    """``dq``, ``dk``, ``dv``, ``dg``, ``dg_gamma`` and ``dinitial_state``; ``dht`` None means zero."""
    sequences, tokens, initial_states = _prepare(inputs)
    (dq, dk, dv, da), dinitial_states = sweep.token_gradients(
        sequences, functools.partial(_step, scale=scale), functools.partial(_step_vjp, scale=scale),
        tokens, initial_states, inputs["do"], inputs["dht"],
    )
    g_gamma = inputs["g_gamma"]  # da is [B, T, H], padding dropped before anything is summed
    dg_gamma = None if g_gamma is None else np.sum(da, axis=tuple(range(da.ndim - g_gamma.ndim)))
    return {"dq": dq, "dk": dk, "dv": dv, "dg": da, "dg_gamma": dg_gamma, "dinitial_state": dinitial_states}


def _prepare(inputs: dict) -> tuple[Sequences, tuple[np.ndarray, ...], np.ndarray]:
    """The sequences, the padded ``(q, k, v, a)`` and the initial states, absent terms as zeros."""
    q, v = inputs["q"], inputs["v"]
    B, T, H, K = q.shape
    sequences = Sequences(inputs["cu_seqlens"], B, T)
    a = np.zeros((B, T, H))
    for log_decay in (inputs["g"], inputs["g_gamma"]):  # g [B, T, H]; g_gamma [H] or a scalar broadcasts
        if log_decay is not None:
            a = a + log_decay
    initial_states = inputs["initial_state"]
    if initial_states is None:
        initial_states = np.zeros((sequences.count, H, K, v.shape[-1]))
    return sequences, tuple(sequences.pad(x) for x in (q, inputs["k"], v, a)), initial_states


def _step(state, token, *, scale):
    q, k, v, a = token  # [N, H, K], [N, H, K], [N, H, V], [N, H]
    state = np.exp(a)[..., None, None] * state + k[..., :, None] * v[..., None, :]
    return state, scale * (q[..., None, :] @ state)[..., 0, :]


def _step_vjp(state, next_state, token, dnext_state, do, *, scale):
    q, k, v, a = token
    decay = np.exp(a)
    total = dnext_state + scale * q[..., :, None] * do[..., None, :]
    dq = scale * (next_state @ do[..., :, None])[..., 0]
    dk = (total @ v[..., :, None])[..., 0]
    dv = (k[..., None, :] @ total)[..., 0, :]
    da = decay * np.einsum("...kv,...kv->...", total, state)
    return (dq, dk, dv, da), decay[..., None, None] * total
