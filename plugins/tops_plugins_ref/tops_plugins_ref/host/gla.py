"""gla in float64 NumPy: the forward recurrence and its exact VJP as a reverse sweep.

Per sequence and head, with ``D_t = diag(exp(g_t))`` (one decay per key row):

    S_t = D_t S_{t-1} + k_t^T v_t,    o_t = scale q_t S_t

With ``G_t = dS_t + scale q_t^T do_t`` the total cotangent of ``S_t`` (``dS_t`` from the future,
``dht`` after the last token), term by term:

    dq_t = scale S_t do_t^T          dk_t = G_t v_t^T          dv_t = k_t G_t
    dg_t = exp(g_t) * (sum over V of G_t * S_{t-1})            [K]
    dS_{t-1} = D_t G_t
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
    """``dq``, ``dk``, ``dv``, ``dg`` and ``dinitial_state``; ``dht`` None means zero."""
    sequences, tokens, initial_states = _prepare(inputs)
    (dq, dk, dv, dg), dinitial_states = sweep.token_gradients(
        sequences, functools.partial(_step, scale=scale), functools.partial(_step_vjp, scale=scale),
        tokens, initial_states, inputs["do"], inputs["dht"],
    )
    return {"dq": dq, "dk": dk, "dv": dv, "dg": dg, "dinitial_state": dinitial_states}


def _prepare(inputs: dict) -> tuple[Sequences, tuple[np.ndarray, ...], np.ndarray]:
    q, v = inputs["q"], inputs["v"]
    B, T, H, K = q.shape
    sequences = Sequences(inputs["cu_seqlens"], B, T)
    initial_states = inputs["initial_state"]
    if initial_states is None:
        initial_states = np.zeros((sequences.count, H, K, v.shape[-1]))
    return sequences, tuple(sequences.pad(x) for x in (q, inputs["k"], v, inputs["g"])), initial_states


def _step(state, token, *, scale):
    q, k, v, g = token  # [N, H, K], [N, H, K], [N, H, V], [N, H, K]
    state = np.exp(g)[..., None] * state + k[..., :, None] * v[..., None, :]
    return state, scale * (q[..., None, :] @ state)[..., 0, :]


def _step_vjp(state, next_state, token, dnext_state, do, *, scale):
    q, k, v, g = token
    decay = np.exp(g)[..., None]  # [N, H, K, 1]
    total = dnext_state + scale * q[..., :, None] * do[..., None, :]
    dq = scale * (next_state @ do[..., :, None])[..., 0]
    dk = (total @ v[..., :, None])[..., 0]
    dv = (k[..., None, :] @ total)[..., 0, :]
    dg = decay[..., 0] * np.sum(total * state, axis=-1)
    return (dq, dk, dv, dg), decay * total
