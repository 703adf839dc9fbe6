"""xla.chunk for kda beyond the conformance grid: flash-linear-attention's own formulas and the chunk size as
a pure tuning knob (extreme decays and traced boundaries: ``test_xla_extremes.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tops_core
from tops_core.conformance.compare import measure, tolerance

KDA = tops_core.op("kda")
GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")


# -- flash-linear-attention's naive KDA (fla/ops/kda/naive.py), ported to NumPy -----------------
# Their names and steps, without grouped value heads (HV == H); float64 throughout.


def l2norm_fwd(x, eps=1e-6):
    """fla.modules.l2norm: what ``use_qk_l2norm_in_kernel=True`` applies to q and k."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    q = q * scale
    S = np.zeros((B, H, K, V))
    if initial_state is not None:
        S = S + initial_state
    o = np.zeros((B, T, H, V))
    for i in range(T):
        q_i, k_i, v_i, g_i, b_i = q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i]
        S = S * np.exp(g_i)[..., None]
        S = S + np.einsum("bhk,bhv->bhkv", b_i[..., None] * k_i, v_i - (k_i[..., None] * S).sum(-2))
        o[:, i] = np.einsum("bhk,bhkv->bhv", q_i, S)
    return o, S if output_final_state else None


def naive_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64):
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT = chunk_size
    NT = T // BT
    if scale is None:
        scale = K**-0.5
    assert T % BT == 0

    def rearrange(x):  # 'b (n c) h ... -> b h n c ...'
        x = x.reshape(B, NT, BT, H, *x.shape[3:])
        return np.moveaxis(x, 3, 1)

    q, k, v, g, beta = map(rearrange, (q, k, v, g, beta))
    q = q * scale
    g = g.cumsum(-2)
    mask = np.triu(np.ones((BT, BT), bool), 0)
    A = np.zeros((*g.shape[:-1], BT))
    for i in range(BT):
        k_i = k[..., i, :]
        g_i = g[..., i : i + 1, :]
        A[..., i] = np.einsum("...cd,...d->...c", k * np.exp(g - g_i), k_i)
    A = A * beta[..., None]
    A = -np.where(mask, 0, A)
    for i in range(1, BT):  # forward substitution
        A[..., i, :i] = A[..., i, :i] + (A[..., i, :, None] * A[..., :, :i]).sum(-2)
    A = (A + np.eye(BT)) * beta[..., None, :]
    w = A @ (np.exp(g) * k)
    u = A @ v

    S = np.zeros((B, H, K, V))
    if initial_state is not None:
        S = S + initial_state
    o = np.zeros_like(v)
    mask = np.triu(np.ones((BT, BT), bool), 1)
    for i in range(NT):
        q_i, k_i, u_i, g_i, w_i = q[:, :, i], k[:, :, i], u[:, :, i], g[:, :, i], w[:, :, i]
        Aqk = np.zeros((B, H, BT, BT))
        for j in range(BT):
            k_j = k[:, :, i, j]
            g_j = g[:, :, i, j : j + 1, :]
            Aqk[..., j] = np.einsum("...cd,...d->...c", q_i * np.exp(g_i - g_j), k_j)
        Aqk = np.where(mask, 0, Aqk)
        v_i = u_i - w_i @ S
        o[:, :, i] = (q_i * np.exp(g_i)) @ S + Aqk @ v_i
        S = S * np.exp(g_i[:, :, -1])[..., None]
        S = S + np.swapaxes(np.exp(g_i[:, :, -1:] - g_i) * k_i, -1, -2) @ v_i
    o = np.moveaxis(o, 1, 3).reshape(B, T, H, V)
    return o, S if output_final_state else None


def fla_inputs(B=2, T=128, H=2, K=32, V=16, seed=0):
    rng = np.random.default_rng(seed)
    return dict(
        q=rng.standard_normal((B, T, H, K)), k=rng.standard_normal((B, T, H, K)), v=rng.standard_normal((B, T, H, V)),
        g=-np.logaddexp(0, -rng.standard_normal((B, T, H, K))) / 8, beta=1 / (1 + np.exp(-rng.standard_normal((B, T, H)))),
        initial_state=rng.standard_normal((B, H, K, V)),
    )


@pytest.mark.parametrize("use_qk_l2norm_in_kernel", [True, False])
@pytest.mark.parametrize("naive", [naive_recurrent_kda, naive_chunk_kda])
def test_matches_flash_linear_attention_naive_kda(naive, use_qk_l2norm_in_kernel):
    inputs = fla_inputs()
    q, k = inputs["q"], inputs["k"]
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_fwd(q), l2norm_fwd(k)
    else:  # fla expects unit-norm keys from the caller
        q, k = q / np.linalg.norm(q, axis=-1, keepdims=True), k / np.linalg.norm(k, axis=-1, keepdims=True)
        inputs["q"], inputs["k"] = q, k
    want_o, want_state = naive(q, k, inputs["v"], inputs["g"], inputs["beta"], scale=0.3,
                               initial_state=inputs["initial_state"], output_final_state=True)
    with jax.enable_x64(True):
        o, state = KDA.forward(**{name: jnp.asarray(x) for name, x in inputs.items()}, scale=0.3, output_final_state=True,
                               use_qk_l2norm=use_qk_l2norm_in_kernel, implementation="xla.chunk")
        for name, got, want in (("o", o, want_o), ("final_state", state, want_state)):
            assert measure(name, got, jnp.asarray(want), tolerance("float64", gradient=False)).passed


# -- the chunk size ------------------------------------------------------------------------------


@pytest.mark.slow
def test_chunk_size_changes_the_chunking_not_the_result():
    inputs = fla_inputs(B=1, T=100, H=1, seed=3)
    do = np.random.default_rng(4).standard_normal(inputs["v"].shape)
    with jax.enable_x64(True):
        arrays = {name: jnp.asarray(x) for name, x in inputs.items()}
        results = []
        for size in (16, 128):
            with tops_core.use(kda=("xla.chunk", {"chunk_size": size})):
                o, _ = KDA.forward(**arrays, use_qk_l2norm=True)
                grads = KDA.backward(**arrays, do=jnp.asarray(do), use_qk_l2norm=True)
            results.append([o] + [getattr(grads, name) for name in GRADIENTS])
    for name, small, large in zip(("o",) + GRADIENTS, *results):
        assert measure(name, small, large, 1e-12).passed, name

