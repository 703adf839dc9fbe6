"""Test data as docs/ops.md prescribes, deterministic per case.

``q, k`` unit-normal times ``K ** -0.5`` (kda: L2-normalised unless the kernel normalises),
``v`` unit-normal, ``g = log_sigmoid(normal) / 16`` (per token and head; per key for kda and gla),
``g_gamma`` from ALiBi slopes (kda's gate
computed in the op: raw ``normal - 3`` in the inputs' dtype, ``A_log = log(uniform(0.5, 2))``,
``dt_bias`` normal / 2, ``lower_bound = -5``; beta logits unit-normal), and strong
decays (``g_gamma = -1``; ``g <= -1``; per-key gates' every other key at ``-10``) that overflow a naive ``exp`` of the masked triangle,
weak ones (``g_gamma = -2**-8``; ``g`` 16 times weaker than the default) under which the decay gradient cancels,
and gates of ``-inf`` (``reset_mask``), which reset the state.
"""

from __future__ import annotations

import zlib
from typing import Any

import jax.numpy as jnp
import numpy as np

from tops_core.conformance.cases import Case


def alibi_g_gamma(heads: int, layer: int = 0, layers: int = 2) -> np.ndarray:
    """Per-head log decays ``-slope_h * (1 - layer / (layers - 1) + 1e-5)``, ``slope_h = 2 ** (-8 (h + 1) / H)``."""
    slopes = 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)
    return -slopes * (1 - layer / (layers - 1) + 1e-5)


def _rng(case: Case, salt: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(f"{case.op}/{case.name}/{case.dtype}/{salt}".encode()))


def _gate_dtype(case: Case) -> Any:
    return jnp.float64 if case.dtype == "float64" else jnp.float32


def _num_seqs(case: Case) -> int:
    return len(case.seqlens) if case.seqlens is not None else case.batch


def _state_rows(case: Case) -> int:
    """The rows of ``initial_state`` and of the final state: the pool's, or one per sequence."""
    return case.pool_rows if case.pool_rows is not None else _num_seqs(case)


def pool_indices(num_seqs: int, pool_rows: int) -> np.ndarray:
    """``ssm_state_indices`` of a pool case: sequence ``n`` at row ``pool_rows - 1 - 2 n``, the second a padding slot (-1)."""
    indices = pool_rows - 1 - 2 * np.arange(num_seqs)
    if num_seqs > 1:
        indices[1] = -1
    return indices


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


RESET_TOKENS = (0, 37, 38, 100, 128)
"""Where ``reset_mask`` puts ``-inf`` gates in the first row and head: a sequence's first token, two in a row,
one inside a chunk of 64 and one on the chunk grid of 64 and 128."""


def reset_mask(shape: tuple[int, ...]) -> np.ndarray:
    """Where a reset case's ``g`` (``[B, T, H]``, or kda's ``[B, T, H, K]``) is ``-inf``: ``RESET_TOKENS`` in the
    first row and head, the last token in the last row and head (kda: the first half of the keys there), and
    token 100 everywhere."""
    B, T, H = shape[:3]
    keys = (slice(0, max(1, shape[3] // 2)),) if len(shape) == 4 else ()
    mask = np.zeros(shape, bool)
    mask[(0, [t for t in RESET_TOKENS if t < T], 0, *keys)] = True
    mask[(B - 1, T - 1, H - 1, *keys)] = True
    if T > 100:
        mask[:, 100] = True
    return mask


LOWER_BOUND = -5.0
"""kda's ``lower_bound`` in the cases that declare one: Kimi Linear's."""


def forward_inputs(case: Case) -> dict[str, Any]:
    """Keyword arguments of ``op(case.op).forward`` for this case (without ``implementation``)."""
    rng = _rng(case, "inputs")
    B, T, H, K, V = case.batch, case.seq_len, case.heads, case.key_dim, case.value_dim
    HV = case.value_heads
    dtype, gate_dtype = jnp.dtype(case.dtype), _gate_dtype(case)
    q, k, v = rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, HV, V))
    features = case.features
    inputs: dict[str, Any] = {"output_final_state": "output_final_state" in features}
    if case.scale is not None:
        inputs["scale"] = case.scale
    if case.op == "simple_gla":
        q, k = q * K**-0.5, k * K**-0.5
        if "g" in features:
            inputs["g"] = _per_head_log_decay(case, rng, (B, T, H))
        if "g_gamma" in features:
            g_gamma = -np.ones(H) if case.strong_decay else np.full(H, -(2.0**-8)) if case.weak_decay else alibi_g_gamma(H)
            if case.reset and "g" not in features:
                g_gamma[0] = -np.inf
            inputs["g_gamma"] = jnp.asarray(g_gamma[0] if dict(case.ndims).get("g_gamma") == 0 else g_gamma, gate_dtype)
    elif case.op == "gla":
        q, k = q * K**-0.5, k * K**-0.5
        inputs["g"] = _per_key_log_decay(case, rng, (B, T, H, K))
    else:  # the delta rule: kda, gated_delta_rule
        if "use_qk_l2norm" in features:
            inputs["use_qk_l2norm"] = True
        else:
            q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
        if case.op == "kda":
            inputs.update(_kda_gate_and_beta(case, rng, (B, T, HV, K)))
        else:
            inputs.update(g=_per_head_log_decay(case, rng, (B, T, HV)),
                          beta=jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((B, T, HV)))), gate_dtype))
    inputs.update(q=jnp.asarray(q, dtype), k=jnp.asarray(k, dtype), v=jnp.asarray(v, dtype))
    if "initial_state" in features:
        inputs["initial_state"] = jnp.asarray(rng.standard_normal((_state_rows(case), HV, K, V)), gate_dtype)
    if case.pool_rows is not None:
        inputs["ssm_state_indices"] = jnp.asarray(pool_indices(_num_seqs(case), case.pool_rows), jnp.int32)
    if "cu_seqlens" in features:
        inputs["cu_seqlens"] = jnp.asarray(np.cumsum((0,) + tuple(case.seqlens)), jnp.int32)
    return inputs


def _per_head_log_decay(case: Case, rng: np.random.Generator, shape: tuple[int, ...]) -> Any:
    """A log decay per token and head ``[B, T, H]`` (simple_gla's ``g``, gated_delta_rule's), in float32 (float64)."""
    g = -1.0 - np.abs(rng.standard_normal(shape)) if case.strong_decay else _log_sigmoid(rng.standard_normal(shape)) / 16
    g = g / 16 if case.weak_decay else g
    return jnp.asarray(np.where(reset_mask(g.shape), -np.inf, g) if case.reset else g, _gate_dtype(case))


def _per_key_log_decay(case: Case, rng: np.random.Generator, shape: tuple[int, ...]) -> Any:
    """A log decay per key ``[B, T, H, K]`` (kda's given as it is, gla's), in float32 (float64)."""
    g = -1.0 - np.abs(rng.standard_normal(shape)) if case.strong_decay else _log_sigmoid(rng.standard_normal(shape)) / 16
    if case.strong_decay:  # and every other key at -10: exp of its chunk sum underflows, of its negation overflows
        g[..., ::2] = -10.0
    if case.single_strong_token:  # each key's own token of every 64
        strong = rng.integers(0, 64, size=(shape[0], 1, *shape[2:]))
        g = np.where(np.arange(shape[1]).reshape(1, -1, 1, 1) % 64 == strong, -39.5, 0.0)
    if case.steady_sub_chunk_decay:
        g = np.full(shape, -39.5 / 32)
    return jnp.asarray(np.where(reset_mask(g.shape), -np.inf, g) if case.reset else g, _gate_dtype(case))


def _kda_gate_and_beta(case: Case, rng: np.random.Generator, shape: tuple[int, ...]) -> dict[str, Any]:
    """kda's ``g`` and ``beta`` ``[B, T, HV, K]``, ``[B, T, HV]``, and the gate's parameters and options.

    The raw gate and beta logits come in the inputs' dtype (a model's projections), a log decay and a
    beta given as they are in float32 (float64); ``A_log`` and ``dt_bias`` are float32 parameters.
    """
    dtype, gate_dtype = jnp.dtype(case.dtype), _gate_dtype(case)
    features = case.features
    inputs: dict[str, Any] = {}
    if "use_gate" in features:
        inputs.update(use_gate=True, g=jnp.asarray(rng.standard_normal(shape) - 3, dtype))
        if "A_log" in features:
            inputs["A_log"] = jnp.asarray(np.log(rng.uniform(0.5, 2.0, shape[2])), gate_dtype)
        if "dt_bias" in features:
            inputs["dt_bias"] = jnp.asarray(rng.standard_normal(shape[2] * shape[3]) / 2, gate_dtype)
    else:
        inputs["g"] = _per_key_log_decay(case, rng, shape)
    if "lower_bound" in features:
        inputs["lower_bound"] = LOWER_BOUND
    logits = rng.standard_normal(shape[:3])
    if "use_beta_sigmoid" in features:
        inputs.update(use_beta_sigmoid=True, beta=jnp.asarray(logits, dtype))
        if "allow_neg_eigval" in features:
            inputs["allow_neg_eigval"] = True
    else:
        inputs["beta"] = jnp.asarray(1 / (1 + np.exp(-logits)), gate_dtype)
    return inputs


def backward_inputs(case: Case, forward: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of ``op(case.op).backward``: the forward's plus cotangents ``do`` and ``dht``."""
    rng = _rng(case, "cotangents")
    inputs = {name: value for name, value in forward.items() if name != "output_final_state"}
    v = forward["v"]
    inputs["do"] = jnp.asarray(rng.standard_normal(v.shape), v.dtype)
    if forward["output_final_state"]:
        shape = (_state_rows(case), case.value_heads, case.key_dim, case.value_dim)
        inputs["dht"] = jnp.asarray(rng.standard_normal(shape), _gate_dtype(case))
    return inputs
