"""The gla reference against numbers worked out independently and finite differences.

Expected values come from closed forms or plain numpy written here, never from the code under test.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import tops_core

# Cases of one token and two heads are time-major by construction; the head-first hint does not apply.
pytestmark = pytest.mark.filterwarnings("ignore::tops_core.LayoutWarning")

REF = "ref.recurrent"
H, K, V = 2, 3, 4
SCALE = 0.7

gla = tops_core.op("gla")


def normal(rng, *shape):
    return rng.normal(size=shape)


def as_jax(**arrays):
    return {name: None if x is None else jnp.asarray(x) for name, x in arrays.items()}


def forward(**kwargs):
    return gla.forward(**kwargs, implementation=REF)


def backward(**kwargs):
    return gla.backward(**kwargs, implementation=REF)


def random_call(rng, B=2, T=4, cu_seqlens=None):
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    return dict(
        q=normal(rng, B, T, H, K), k=normal(rng, B, T, H, K), v=normal(rng, B, T, H, V),
        g=np.log(1 / (1 + np.exp(-normal(rng, B, T, H, K)))) / 4, initial_state=normal(rng, N, H, K, V),
    ), dict(do=normal(rng, B, T, H, V), dht=normal(rng, N, H, K, V))


def test_one_token_matches_the_closed_form_and_its_gradients(x64):
    rng = np.random.default_rng(1)
    primals, cotangents = random_call(rng, B=1, T=1)
    q, k, v, g, s0 = (primals[name] for name in ("q", "k", "v", "g", "initial_state"))
    do = cotangents["do"]

    o, ht = forward(**as_jax(**primals), scale=SCALE, output_final_state=True)
    grads = backward(**as_jax(**primals), do=jnp.asarray(do), scale=SCALE)

    for h in range(H):
        decay = np.exp(g[0, 0, h])
        q1, k1, v1, do1 = q[0, 0, h], k[0, 0, h], v[0, 0, h], do[0, 0, h]
        s1 = decay[:, None] * s0[0, h] + np.outer(k1, v1)
        np.testing.assert_allclose(ht[0, h], s1, rtol=1e-13)
        np.testing.assert_allclose(o[0, 0, h], SCALE * q1 @ s1, rtol=1e-13)
        # loss = do . (scale q S_1), S_1 = diag(e^g) S_0 + k^T v: d/dg_d = scale q_d e^{g_d} (S_0 do)_d
        np.testing.assert_allclose(grads.dq[0, 0, h], SCALE * s1 @ do1, rtol=1e-13)
        np.testing.assert_allclose(grads.dk[0, 0, h], SCALE * q1 * (v1 @ do1), rtol=1e-13)
        np.testing.assert_allclose(grads.dv[0, 0, h], SCALE * (q1 @ k1) * do1, rtol=1e-13)
        np.testing.assert_allclose(grads.dg[0, 0, h], SCALE * q1 * decay * (s0[0, h] @ do1), rtol=1e-13)
        np.testing.assert_allclose(grads.dinitial_state[0, h], SCALE * np.outer(q1 * decay, do1), rtol=1e-13)


def test_unrolled_it_is_masked_attention_with_per_key_decays(x64):
    """``o_t = scale (sum_{s<=t} (q_t * exp(A_t - A_s)) . k_s v_s + (q_t * exp(A_t)) S_0)``, ``A`` the cumulative gates."""
    rng = np.random.default_rng(2)
    primals, _ = random_call(rng, B=2, T=5)
    q, k, v, g, s0 = (primals[name] for name in ("q", "k", "v", "g", "initial_state"))
    o, ht = forward(**as_jax(**primals), scale=SCALE, output_final_state=True)

    A = np.cumsum(g, axis=1)  # [B, T, H, K]
    decays = np.exp(A[:, :, None] - A[:, None, :])  # [B, t, s, H, K]
    scores = np.einsum("bthk,btshk,bshk->btsh", q, decays, k) * np.tril(np.ones((5, 5)))[None, :, :, None]
    expected = SCALE * (np.einsum("btsh,bshv->bthv", scores, v) + np.einsum("bthk,bhkv->bthv", q * np.exp(A), s0))
    np.testing.assert_allclose(o, expected, rtol=1e-12)
    final = np.einsum("bshk,bshv->bhkv", np.exp(A[:, -1:] - A) * k, v) + np.exp(A[:, -1])[..., None] * s0
    np.testing.assert_allclose(ht, final, rtol=1e-12)


@pytest.mark.parametrize("cu_seqlens", [None, [0, 0, 1, 3, 3, 5]], ids=["batch", "packed"])
def test_every_gradient_matches_finite_differences(x64, finite_difference_errors, cu_seqlens):
    rng = np.random.default_rng(5)
    B, T = (2, 4) if cu_seqlens is None else (1, cu_seqlens[-1])
    primals, cotangents = random_call(rng, B, T, cu_seqlens)
    extra = dict(scale=SCALE, cu_seqlens=None if cu_seqlens is None else jnp.asarray(cu_seqlens))

    def loss(p):
        o, ht = forward(**as_jax(**p), output_final_state=True, **extra)
        return jnp.sum(o * cotangents["do"]) + jnp.sum(ht * cotangents["dht"])

    grads = backward(**as_jax(**primals, **cotangents), **extra)
    errors = finite_difference_errors(loss, primals, {name: getattr(grads, "d" + name) for name in primals})
    assert max(errors.values()) < 1e-7, errors


def test_packed_sequences_equal_separate_calls_and_a_gate_of_minus_inf_clears_its_key_row(x64):
    """Lengths 0, 1, 2, 0, 2; and key 0 of head 1 at token 3 gated by ``-inf``: its row of the state restarts there."""
    cu_seqlens = [0, 0, 1, 3, 3, 5]
    rng = np.random.default_rng(8)
    primals, _ = random_call(rng, 1, 5, cu_seqlens)
    primals["g"][0, 3, 1, 0] = -np.inf
    packed_o, packed_ht = forward(**as_jax(**primals), scale=SCALE, output_final_state=True, cu_seqlens=jnp.asarray(cu_seqlens))
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        state = primals["initial_state"][n].copy()
        for t in range(start, end):
            state = np.exp(primals["g"][0, t])[..., None] * state + np.einsum("hk,hv->hkv", primals["k"][0, t], primals["v"][0, t])
            np.testing.assert_allclose(packed_o[0, t], SCALE * np.einsum("hk,hkv->hv", primals["q"][0, t], state), rtol=1e-13)
        np.testing.assert_allclose(packed_ht[n], state, rtol=1e-13)
    np.testing.assert_allclose(packed_ht[4, 1, 0], primals["k"][0, 4, 1, 0] * primals["v"][0, 4, 1]
                               + np.exp(primals["g"][0, 4, 1, 0]) * primals["k"][0, 3, 1, 0] * primals["v"][0, 3, 1], rtol=1e-13)
