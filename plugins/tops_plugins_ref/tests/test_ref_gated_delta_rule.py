"""The gated_delta_rule reference against flash-linear-attention's naive recurrence and finite differences.

Expected values come from plain numpy written here (fla's ``naive_recurrent_gated_delta_rule``, ported),
never from the code under test.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import tops_core

pytestmark = pytest.mark.filterwarnings("ignore::tops_core.LayoutWarning")

REF = "ref.recurrent"
H, K, V = 2, 3, 4
SCALE = 0.7

gdn = tops_core.op("gated_delta_rule")


def as_jax(**arrays):
    return {name: None if x is None else jnp.asarray(x) for name, x in arrays.items()}


def naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale, initial_state):
    """fla/ops/gated_delta_rule/naive.py in NumPy: its names and steps (``[B, T, H, .]`` inputs, one value head per head)."""
    B, T, Hh, Kk = k.shape
    h = initial_state.copy()
    o = np.zeros(v.shape)
    q = q * scale
    for i in range(T):
        b_q, b_k, b_v = q[:, i], k[:, i], v[:, i].copy()
        h = h * np.exp(g[:, i])[..., None, None]
        b_v = b_v - (h * b_k[..., None]).sum(-2)
        b_v = b_v * beta[:, i][..., None]
        h = h + b_k[..., None] * b_v[..., None, :]
        o[:, i] = np.einsum("bhd,bhdm->bhm", b_q, h)
    return o, h


def random_call(rng, B=2, T=5, HV=H, cu_seqlens=None):
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    return dict(
        q=unit(rng.normal(size=(B, T, H, K))), k=unit(rng.normal(size=(B, T, H, K))), v=rng.normal(size=(B, T, HV, V)),
        g=-rng.random((B, T, HV)), beta=rng.random((B, T, HV)), initial_state=rng.normal(size=(N, HV, K, V)),
    ), dict(do=rng.normal(size=(B, T, HV, V)), dht=rng.normal(size=(N, HV, K, V)))


def test_matches_flash_linear_attention_naive_recurrence(x64):
    primals, _ = random_call(np.random.default_rng(1))
    o, ht = gdn.forward(**as_jax(**primals), scale=SCALE, output_final_state=True, implementation=REF)
    want_o, want_ht = naive_recurrent_gated_delta_rule(
        primals["q"], primals["k"], primals["v"], primals["beta"], primals["g"], SCALE, primals["initial_state"])
    np.testing.assert_allclose(o, want_o, rtol=1e-12)
    np.testing.assert_allclose(ht, want_ht, rtol=1e-12)


def test_grouped_value_heads_read_their_query_and_key_head(x64):
    primals, _ = random_call(np.random.default_rng(2), HV=2 * H)
    o, ht = gdn.forward(**as_jax(**primals), scale=SCALE, output_final_state=True, implementation=REF)
    repeated = {name: np.repeat(primals[name], 2, axis=2) for name in ("q", "k")}
    want_o, want_ht = naive_recurrent_gated_delta_rule(
        repeated["q"], repeated["k"], primals["v"], primals["beta"], primals["g"], SCALE, primals["initial_state"])
    np.testing.assert_allclose(o, want_o, rtol=1e-12)
    np.testing.assert_allclose(ht, want_ht, rtol=1e-12)


@pytest.mark.parametrize("cu_seqlens", [None, [0, 0, 1, 3, 3, 5]], ids=["batch", "packed"])
def test_every_gradient_matches_finite_differences(x64, finite_difference_errors, cu_seqlens):
    rng = np.random.default_rng(5)
    B, T = (2, 4) if cu_seqlens is None else (1, cu_seqlens[-1])
    primals, cotangents = random_call(rng, B, T, HV=2 * H, cu_seqlens=cu_seqlens)
    extra = dict(scale=SCALE, use_qk_l2norm=True, cu_seqlens=None if cu_seqlens is None else jnp.asarray(cu_seqlens))

    def loss(p):
        o, ht = gdn.forward(**as_jax(**p), output_final_state=True, implementation=REF, **extra)
        return jnp.sum(o * cotangents["do"]) + jnp.sum(ht * cotangents["dht"])

    grads = gdn.backward(**as_jax(**primals, **cotangents), implementation=REF, **extra)
    errors = finite_difference_errors(loss, primals, {name: getattr(grads, "d" + name) for name in primals})
    assert max(errors.values()) < 1e-7, errors
