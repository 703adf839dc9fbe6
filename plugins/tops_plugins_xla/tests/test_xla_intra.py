"""One chunk of per-key decays (kda, gla): decays, pair products and the triangular inverse against direct formulas,
along the halving (``intra``) and in the dense form for mild chunks (``intra_mild``).

The direct formulas take ``exp(b_i - b_j)`` per pair and key, in float64 NumPy; the inverse is
checked against ``numpy.linalg.inv``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tops_plugins_xla import intra, intra_mild


def chunk_inputs(C, K=8, lead=(2, 3), g_scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((*lead, C, K)), rng.standard_normal((*lead, C, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = -g_scale * np.abs(rng.standard_normal((*lead, C, K)))
    beta = rng.uniform(size=(*lead, C))
    return q, k, g, beta


def direct_pairs(q, k, g, xp=np):
    """``Aqk`` (on and below the diagonal) and ``Akk`` (strictly below) from cumulative gates."""
    C = q.shape[-2]
    b = xp.cumsum(g, axis=-2)
    below = np.tril(np.ones((C, C), bool))[..., None]
    decay = xp.exp(xp.where(below, b[..., :, None, :] - b[..., None, :, :], -np.inf))
    aqk = xp.einsum("...id,...jd,...ijd->...ij", q, k, decay)
    akk = xp.einsum("...id,...jd,...ijd->...ij", k, k, decay) * (1 - np.eye(C))
    return aqk, akk


@jax.jit
def run_pairs(q, k, g, beta):
    decays = intra.decays(g)
    return decays, intra.pairs(q, k, decays.levels, beta)


@jax.jit
def run_backward(q, k, g, daqk, dakk, d_to_token, d_to_end, d_whole):
    decays = intra.decays(g)
    dq, dk, d_later, d_earlier = intra.pairs_backward(q, k, decays.levels, daqk, dakk)
    dg = intra.decays_backward(intra.DecayCotangents(
        later=d_later, earlier=d_earlier, to_token=d_to_token * decays.to_token,
        to_end=d_to_end * decays.to_end, whole=d_whole * decays.whole))
    return dq, dk, dg


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


@pytest.mark.parametrize("C", [16, 64, 128])
def test_inverse_is_the_exact_inverse(C):
    q, k, g, beta = chunk_inputs(C, g_scale=0.05)
    _, pairs = run_pairs(q, k, g, beta)
    _, akk = direct_pairs(q, k, g)
    matrix = np.eye(C) + beta[..., None] * akk
    np.testing.assert_allclose(pairs.inverse, np.linalg.inv(matrix), rtol=0, atol=1e-12)
    assert np.all(np.triu(np.asarray(pairs.inverse), 1) == 0)


def test_inverse_is_exact_where_a_truncated_series_is_not():
    """Keys nearly parallel, beta near 1, no decay: entries of Akk near 1, so the terms of the
    Neumann series I - L + L^2 - ... shrink slowly and any truncation is visibly wrong."""
    C, K = 32, 4
    rng = np.random.default_rng(1)
    k = np.ones((1, C, K)) + 0.05 * rng.standard_normal((1, C, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g, beta = np.zeros((1, C, K)), np.full((1, C), 0.9)
    _, pairs = run_pairs(k, k, g, beta)
    matrix = np.eye(C) + beta[..., None] * direct_pairs(k, k, g)[1]
    strict = matrix - np.eye(C)
    second_order = np.eye(C) - strict + strict @ strict
    exact = np.linalg.inv(matrix)
    assert np.abs(second_order - exact).max() > 1  # the series would be far off here
    np.testing.assert_allclose(pairs.inverse, exact, rtol=0, atol=1e-10 * np.abs(exact).max())


@pytest.mark.parametrize("C", [16, 64])
def test_pair_products_and_decays_match_the_direct_formulas(C):
    q, k, g, beta = chunk_inputs(C)
    decays, pairs = run_pairs(q, k, g, beta)
    aqk, akk = direct_pairs(q, k, g)
    np.testing.assert_allclose(pairs.aqk, aqk, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(pairs.akk, akk, rtol=1e-12, atol=1e-14)
    b = np.cumsum(g, axis=-2)
    np.testing.assert_allclose(decays.to_token, np.exp(b), rtol=1e-12)
    np.testing.assert_allclose(decays.to_end, np.exp(b[..., -1:, :] - b), rtol=1e-12)
    np.testing.assert_allclose(decays.whole, np.exp(b[..., -1:, :]), rtol=1e-12)
    assert len(decays.levels) == int(np.log2(C))


@pytest.mark.parametrize("C", [16, 32])
def test_backward_matches_autodiff_of_the_direct_formulas(C):
    q, k, g, beta = chunk_inputs(C, seed=2)
    rng = np.random.default_rng(3)
    daqk, dakk = rng.standard_normal((2, *q.shape[:-2], C, C))
    d_to_token, d_to_end = rng.standard_normal((2, *q.shape))
    d_whole = rng.standard_normal((*q.shape[:-2], 1, q.shape[-1]))

    def direct(q, k, g):
        b = jnp.cumsum(g, axis=-2)
        return (*direct_pairs(q, k, g, xp=jnp), jnp.exp(b), jnp.exp(b[..., -1:, :] - b), jnp.exp(b[..., -1:, :]))

    @jax.jit
    def autodiff(q, k, g):
        _, pullback = jax.vjp(direct, q, k, g)
        return pullback((jnp.tril(daqk), jnp.tril(dakk, -1), d_to_token, d_to_end, d_whole))

    want = autodiff(q, k, g)
    got = run_backward(q, k, g, daqk, dakk, d_to_token, d_to_end, d_whole)
    for got, expected in zip(got, want):
        np.testing.assert_allclose(got, expected, rtol=1e-11, atol=1e-12 * np.abs(expected).max())


@pytest.mark.parametrize("log_decay", [-10.0, -100.0])
def test_float32_strong_decays_stay_finite_and_accurate(log_decay):
    """g as low as -10 per token and key (-640 across a chunk of 64), and far below: no overflow."""
    C = 64
    q, k, _, beta = chunk_inputs(C)
    rng = np.random.default_rng(4)
    # Strong decays on some keys and tokens, none on others: decays near 1 sit beside huge sums.
    g = np.where(rng.uniform(size=q.shape) < 0.5, log_decay, -1e-3 * rng.uniform(size=q.shape))
    with jax.enable_x64(False):
        decays, pairs = run_pairs(*(x.astype(np.float32) for x in (q, k, g, beta)))
    aqk, akk = direct_pairs(q, k, g)
    for got, want in ((pairs.aqk, aqk), (pairs.akk, akk)):
        assert np.isfinite(np.asarray(got)).all()
        assert np.sqrt(np.mean((np.asarray(got, np.float64) - want) ** 2) / np.mean(want**2)) < 1e-6
    for factor in (decays.to_token, decays.to_end, decays.whole, *(f for level in decays.levels for f in (level.later_decay, level.earlier_decay))):
        assert np.isfinite(np.asarray(factor)).all() and np.asarray(factor).max() <= 1


# -- mild chunks: intra_mild's dense form ---------------------------------------------------------


def mild_gates(C, K=8, lead=(2, 3), seed=0):
    """Gates whose chunk sum sits just inside the bound in every key: one token at -39 and the rest near 0."""
    rng = np.random.default_rng(seed)
    g = -1e-3 * rng.uniform(size=(*lead, C, K))
    strong = rng.integers(0, C, size=(*lead, 1, K))
    return np.where(np.arange(C)[:, None] == strong, -39.0, g)


@jax.jit
def run_mild(q, k, g, daqk, d_to_token, d_to_end, d_whole):
    decays = intra_mild.decays(g)
    dq, dk, d_pairs = intra_mild.pairs_backward(q, k, decays, daqk)
    dg = intra_mild.decays_backward(intra.DecayCotangents(
        later=(), earlier=(), to_token=d_to_token * decays.to_token,
        to_end=d_to_end * decays.to_end + d_pairs, whole=d_whole * decays.whole))
    return decays, intra_mild.query_pairs(q, k, decays), (dq, dk, dg)


def direct_backward(q, k, g, daqk, d_to_token, d_to_end, d_whole):
    """``dq``, ``dk``, ``dg`` of ``Aqk`` and the decays by autodiff of the direct formulas."""

    def direct(q, k, g):
        b = jnp.cumsum(g, axis=-2)
        return direct_pairs(q, k, g, xp=jnp)[0], jnp.exp(b), jnp.exp(b[..., -1:, :] - b), jnp.exp(b[..., -1:, :])

    _, pullback = jax.vjp(direct, q, k, g)
    return pullback((jnp.tril(daqk), d_to_token, d_to_end, d_whole))


def mild_cotangents(q, seed=3):
    rng = np.random.default_rng(seed)
    C = q.shape[-2]
    daqk = rng.standard_normal((*q.shape[:-2], C, C))
    d_to_token, d_to_end = rng.standard_normal((2, *q.shape))
    d_whole = rng.standard_normal((*q.shape[:-2], 1, q.shape[-1]))
    return daqk, d_to_token, d_to_end, d_whole


@pytest.mark.parametrize("C", [16, 64, 256])
@pytest.mark.parametrize("gates", ["weak", "one token at -39"])
def test_mild_decays_pairs_and_gradients_match_the_direct_formulas(C, gates):
    q, k, g, _ = chunk_inputs(C, g_scale=1.0 / C)
    if gates != "weak":
        g = mild_gates(C)
    assert bool(intra_mild.is_mild(g))
    cotangents = mild_cotangents(q)
    decays, aqk, grads = run_mild(q, k, g, *cotangents)
    b = np.cumsum(g, axis=-2)
    np.testing.assert_allclose(decays.to_token, np.exp(b), rtol=1e-12)
    np.testing.assert_allclose(decays.to_end, np.exp(b[..., -1:, :] - b), rtol=1e-12)
    np.testing.assert_allclose(decays.whole, np.exp(b[..., -1:, :]), rtol=1e-12)
    want = direct_pairs(q, k, g)[0]
    np.testing.assert_allclose(aqk, want, rtol=0, atol=1e-13 * np.abs(want).max())
    for name, got, expected in zip(("dq", "dk", "dg"), grads, direct_backward(q, k, g, *cotangents)):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12 * np.abs(expected).max(), err_msg=name)


def test_float32_mild_chunks_at_the_bound_are_accurate():
    """One token at -39 per key (exp(39) = 9e16 on the queries' side of the product): every result finite,
    and float32 errors against the float64 formulas at the level of float32 rounding."""
    C = 64
    q, k, _, _ = chunk_inputs(C)
    g = mild_gates(C)
    cotangents = mild_cotangents(q)
    with jax.enable_x64(False):
        decays, aqk, grads = run_mild(*(np.asarray(x, np.float32) for x in (q, k, g, *cotangents)))
    want_grads = direct_backward(q, k, g, *cotangents)
    for name, got, want in (("Aqk", aqk, direct_pairs(q, k, g)[0]), *zip(("dq", "dk", "dg"), grads, want_grads)):
        got, want = np.asarray(got, np.float64), np.asarray(want)
        assert np.isfinite(got).all(), name
        assert np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)) < 1e-6, name
    assert np.asarray(decays.to_end).max() <= 1


@pytest.mark.parametrize("total, mild", [(-39.9, True), (-40.1, False), (-np.inf, False), (np.nan, False)])
def test_the_dense_form_is_chosen_only_within_the_bound(total, mild):
    """One key of one row and head at ``total``, the rest weak: the choice covers every row, head and key."""
    g = np.full((2, 3, 64, 8), -1e-3)
    g[1, 2, 5, 7] = total
    assert bool(intra_mild.is_mild(g)) is mild
