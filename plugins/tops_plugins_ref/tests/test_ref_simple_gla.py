"""The simple_gla reference against numbers worked out independently, finite differences and the identities of docs/ops.md.

Expected values come from closed forms or plain numpy written here, never from the code under
test. Shapes stay tiny and few, so the float64 scans compile a handful of times in all.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tops_core

# Cases of one token and two heads are time-major by construction; the head-first hint does not apply.
pytestmark = pytest.mark.filterwarnings("ignore::tops_core.LayoutWarning")

REF = "ref.recurrent"
H, K, V = 2, 3, 4
SCALE = 0.7

sg = tops_core.op("simple_gla")


def normal(rng, *shape):
    return rng.normal(size=shape)


def as_jax(**arrays):
    return {name: None if x is None else jnp.asarray(x) for name, x in arrays.items()}


def forward(**kwargs):
    return sg.forward(**kwargs, implementation=REF)


def backward(**kwargs):
    return sg.backward(**kwargs, implementation=REF)


# -- cases worked by hand -------------------------------------------------------------------


def test_one_token_matches_the_closed_form_and_its_gradients(x64):
    rng = np.random.default_rng(1)
    q, k, do = normal(rng, 1, 1, H, K), normal(rng, 1, 1, H, K), normal(rng, 1, 1, H, V)
    v, s0 = normal(rng, 1, 1, H, V), normal(rng, 1, H, K, V)
    g, gamma = np.array([[[-0.3, -1.2]]]), np.array(-0.1)
    inputs = as_jax(q=q, k=k, v=v, g=g, g_gamma=gamma, initial_state=s0)

    o, ht = forward(**inputs, scale=SCALE, output_final_state=True)
    grads = backward(**inputs, do=jnp.asarray(do), scale=SCALE)

    decay_grads = []
    for h in range(H):
        decay = np.exp(g[0, 0, h] + gamma)
        q1, k1, v1, do1 = q[0, 0, h], k[0, 0, h], v[0, 0, h], do[0, 0, h]
        s1 = decay * s0[0, h] + np.outer(k1, v1)
        np.testing.assert_allclose(ht[0, h], s1, rtol=1e-13)
        np.testing.assert_allclose(o[0, 0, h], SCALE * q1 @ s1, rtol=1e-13)
        # loss = do . (scale q S_1), with S_1 = e^a S_0 + k^T v
        np.testing.assert_allclose(grads.dq[0, 0, h], SCALE * s1 @ do1, rtol=1e-13)
        np.testing.assert_allclose(grads.dk[0, 0, h], SCALE * q1 * (v1 @ do1), rtol=1e-13)
        np.testing.assert_allclose(grads.dv[0, 0, h], SCALE * (q1 @ k1) * do1, rtol=1e-13)
        np.testing.assert_allclose(grads.dinitial_state[0, h], SCALE * decay * np.outer(q1, do1), rtol=1e-13)
        decay_grads.append(SCALE * decay * q1 @ s0[0, h] @ do1)
    np.testing.assert_allclose(grads.dg[0, 0], decay_grads, rtol=1e-13)
    np.testing.assert_allclose(grads.dg_gamma, sum(decay_grads), rtol=1e-13)  # one scalar shared by the heads


def test_two_tokens_match_the_expanded_recurrence(x64):
    rng = np.random.default_rng(2)
    q, k, v = normal(rng, 1, 2, H, K), normal(rng, 1, 2, H, K), normal(rng, 1, 2, H, V)
    s0, g, gamma = normal(rng, 1, H, K, V), -rng.random((1, 2, H)), -0.25

    o, ht = forward(**as_jax(q=q, k=k, v=v, g=g, g_gamma=np.array(gamma), initial_state=s0),
                    scale=SCALE, output_final_state=True)

    for h in range(H):
        a1, a2 = g[0, 0, h] + gamma, g[0, 1, h] + gamma
        write1, write2 = np.outer(k[0, 0, h], v[0, 0, h]), np.outer(k[0, 1, h], v[0, 1, h])
        s1 = np.exp(a1) * s0[0, h] + write1
        s2 = np.exp(a1 + a2) * s0[0, h] + np.exp(a2) * write1 + write2
        np.testing.assert_allclose(o[0, 0, h], SCALE * q[0, 0, h] @ s1, rtol=1e-13)
        np.testing.assert_allclose(o[0, 1, h], SCALE * q[0, 1, h] @ s2, rtol=1e-13)
        np.testing.assert_allclose(ht[0, h], s2, rtol=1e-13)


def test_without_decay_it_is_causal_linear_attention(x64):
    rng = np.random.default_rng(3)
    q, k, v = normal(rng, 2, 4, H, K), normal(rng, 2, 4, H, K), normal(rng, 2, 4, H, V)
    causal = np.tril(np.ones((4, 4)))
    expected = SCALE * np.einsum("btsh,bshv->bthv", np.einsum("bthk,bshk->btsh", q, k) * causal[None, :, :, None], v)

    o_plain, _ = forward(**as_jax(q=q, k=k, v=v), scale=SCALE)
    o_zero_gates, _ = forward(**as_jax(q=q, k=k, v=v, g=np.zeros((2, 4, H)), g_gamma=np.zeros(H)), scale=SCALE)

    np.testing.assert_allclose(o_plain, expected, rtol=1e-12)
    np.testing.assert_allclose(o_zero_gates, expected, rtol=1e-12)


def test_with_nothing_written_it_reads_the_decayed_initial_state(x64):
    rng = np.random.default_rng(4)
    q, v, s0, g = normal(rng, 2, 4, H, K), normal(rng, 2, 4, H, V), normal(rng, 2, H, K, V), -rng.random((2, 4, H))
    gamma = np.array([-0.05, -0.4])

    o, ht = forward(**as_jax(q=q, k=np.zeros_like(q), v=v, g=g, g_gamma=gamma, initial_state=s0),
                    scale=SCALE, output_final_state=True)

    cumulative = np.cumsum(g + gamma, axis=1)  # A_t
    expected = SCALE * np.exp(cumulative)[..., None] * np.einsum("bthk,bhkv->bthv", q, s0)
    np.testing.assert_allclose(o, expected, rtol=1e-12)
    np.testing.assert_allclose(ht, np.exp(cumulative[:, -1])[..., None, None] * s0, rtol=1e-12)


def test_it_accumulates_in_float64_for_float32_inputs_with_x64_off():
    """1e8 + 1 - 1e8 is 0 in float32 arithmetic and 1 in float64; every input is exact in float32."""
    ones = jnp.ones((2, 4, H, K), jnp.float32)
    v = jnp.broadcast_to(jnp.asarray([1e8, 1.0, -1e8, 0.0], jnp.float32)[None, :, None, None], (2, 4, H, V))
    with jax.enable_x64(False):
        o, ht = forward(q=ones, k=ones, v=v, scale=1.0, output_final_state=True)
    assert o.dtype == jnp.float32 and ht.dtype == jnp.float32
    np.testing.assert_array_equal(o[:, 2], np.full((2, H, V), K))  # q S = K * (1e8 + 1 - 1e8)
    np.testing.assert_array_equal(ht, np.ones((2, H, K, V)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_results_come_back_in_the_contract_dtypes(dtype):
    x = jnp.full((1, 2, H, K), 0.5, dtype)
    y = jnp.full((1, 2, H, V), 0.5, dtype)
    o, ht = forward(q=x, k=x, v=y, g_gamma=jnp.full((), -0.1, dtype), output_final_state=True)
    grads = backward(q=x, k=x, v=y, do=y, g_gamma=jnp.full((), -0.1, dtype), dht=ht)
    assert (o.dtype, ht.dtype) == (dtype, jnp.float32)
    assert {grads.dq.dtype, grads.dk.dtype, grads.dv.dtype, grads.dg_gamma.dtype} == {jnp.dtype(dtype)}
    assert grads.dg_gamma.shape == ()


# -- gradients ------------------------------------------------------------------------------


# Each case compiles its own float64 scans, so the two cases cover both g_gamma ranks between them.
LAYOUTS = pytest.mark.parametrize(
    "cu_seqlens, gamma_shape", [(None, (H,)), ([0, 0, 1, 3, 3, 5], ())], ids=["batch-g_gamma[H]", "packed-g_gamma_scalar"]
)


def random_call(rng, B=2, T=4, cu_seqlens=None, gamma_shape=(H,)):
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    unit = K ** -0.5
    return dict(
        q=unit * normal(rng, B, T, H, K), k=unit * normal(rng, B, T, H, K), v=normal(rng, B, T, H, V),
        g=np.log(1 / (1 + np.exp(-normal(rng, B, T, H)))) / 4, g_gamma=-0.3 * rng.random(gamma_shape),
        initial_state=normal(rng, N, H, K, V),
    ), dict(do=normal(rng, B, T, H, V), dht=normal(rng, N, H, K, V))


@LAYOUTS
def test_every_gradient_matches_finite_differences(x64, finite_difference_errors, gamma_shape, cu_seqlens):
    rng = np.random.default_rng(5)
    B, T = (2, 4) if cu_seqlens is None else (1, cu_seqlens[-1])
    primals, cotangents = random_call(rng, B, T, cu_seqlens, gamma_shape)
    extra = dict(scale=SCALE, cu_seqlens=None if cu_seqlens is None else jnp.asarray(cu_seqlens))

    def loss(p):
        o, ht = forward(**as_jax(**p), output_final_state=True, **extra)
        return jnp.sum(o * cotangents["do"]) + jnp.sum(ht * cotangents["dht"])

    grads = backward(**as_jax(**primals, **cotangents), **extra)
    named = {name: getattr(grads, "d" + name) for name in primals}
    errors = finite_difference_errors(loss, primals, named)
    assert max(errors.values()) < 1e-7, errors


def test_absent_inputs_get_no_gradient_and_no_final_state_cotangent_means_zero(x64):
    rng = np.random.default_rng(6)
    primals, cotangents = random_call(rng)
    inputs = as_jax(q=primals["q"], k=primals["k"], v=primals["v"], g_gamma=primals["g_gamma"])
    grads = backward(**inputs, do=jnp.asarray(cotangents["do"]), scale=SCALE)
    with_zero_dht = backward(**inputs, do=jnp.asarray(cotangents["do"]), dht=jnp.zeros((2, H, K, V)), scale=SCALE)
    assert grads.dg is None and grads.dinitial_state is None
    for name in ("dq", "dk", "dv", "dg_gamma"):
        np.testing.assert_array_equal(getattr(grads, name), getattr(with_zero_dht, name))


# -- docs/ops.md's decay-gradient identity --------------------------------------------------------


@LAYOUTS
def test_decay_gradients_satisfy_the_cumulative_identity(x64, gamma_shape, cu_seqlens):
    """dg and dg_gamma follow from dq, dk and the final state.

    Unrolled, ``o_t = scale * q_t (sum_{s<=t} exp(A_t - A_s) k_s^T v_s + exp(A_t) S_0)`` and
    ``S_L = sum_s exp(A_L - A_s) k_s^T v_s + exp(A_L) S_0`` with ``A_t = a_1 + ... + a_t``. Every
    term depends on ``A`` only through ``exp(A_query - A_key)`` (``A_key = 0`` for ``S_0``), so
    ``dL/dA_t`` is the sum of the terms where ``t`` is the query, ``q_t . dq_t`` plus
    ``sum(dht * S_L)`` when ``t = L``, minus those where ``t`` is the key, ``k_t . dk_t`` (``dk``
    includes the paths through ``S_L``). Since ``a_t`` enters every ``A_s`` with ``s >= t`` of its
    sequence, ``da_t = sum_{s >= t} dA_s``; ``dg = da`` and ``dg_gamma = sum over b, t of da``.
    """
    rng = np.random.default_rng(7)
    B, T = (2, 4) if cu_seqlens is None else (1, cu_seqlens[-1])
    primals, cotangents = random_call(rng, B, T, cu_seqlens, gamma_shape)
    extra = dict(scale=SCALE, cu_seqlens=None if cu_seqlens is None else jnp.asarray(cu_seqlens))
    _, final_states = forward(**as_jax(**primals), output_final_state=True, **extra)
    grads = backward(**as_jax(**primals, **cotangents), **extra)

    bounds = np.arange(B + 1) * T if cu_seqlens is None else np.asarray(cu_seqlens)
    flat = lambda x: np.asarray(x).reshape(B * T, *np.shape(x)[2:])  # noqa: E731
    dA = np.sum(flat(primals["q"]) * flat(grads.dq) - flat(primals["k"]) * flat(grads.dk), axis=-1)
    da = np.zeros_like(dA)
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > start:
            dA[end - 1] += np.sum(cotangents["dht"][n] * np.asarray(final_states[n]), axis=(-2, -1))
            da[start:end] = np.cumsum(dA[start:end][::-1], axis=0)[::-1]

    np.testing.assert_allclose(flat(grads.dg), da, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grads.dg_gamma, np.sum(da) if gamma_shape == () else np.sum(da, axis=0), rtol=1e-10)


# -- packing ----------------------------------------------------------------------------------


def test_packed_sequences_equal_separate_calls(x64):
    """Lengths 0, 1, 2, 0, 2: empty sequences keep their initial state and pass dht straight back."""
    cu_seqlens = [0, 0, 1, 3, 3, 5]
    rng = np.random.default_rng(8)
    primals, cotangents = random_call(rng, 1, 5, cu_seqlens, gamma_shape=())
    packed_o, packed_ht = forward(**as_jax(**primals), scale=SCALE, output_final_state=True, cu_seqlens=jnp.asarray(cu_seqlens))
    packed = backward(**as_jax(**primals, **cotangents), scale=SCALE, cu_seqlens=jnp.asarray(cu_seqlens))

    dg_gamma = 0.0
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        if start == end:
            np.testing.assert_array_equal(packed_ht[n], primals["initial_state"][n])
            np.testing.assert_array_equal(packed.dinitial_state[n], cotangents["dht"][n])
            continue
        tokens = slice(start, end)
        one = dict(q=primals["q"][:, tokens], k=primals["k"][:, tokens], v=primals["v"][:, tokens],
                   g=primals["g"][:, tokens], g_gamma=primals["g_gamma"], initial_state=primals["initial_state"][n:n + 1])
        o, ht = forward(**as_jax(**one), scale=SCALE, output_final_state=True)
        grads = backward(**as_jax(**one), do=jnp.asarray(cotangents["do"][:, tokens]),
                         dht=jnp.asarray(cotangents["dht"][n:n + 1]), scale=SCALE)
        np.testing.assert_allclose(packed_o[:, tokens], o, rtol=1e-14, atol=1e-15)
        np.testing.assert_allclose(packed_ht[n:n + 1], ht, rtol=1e-14, atol=1e-15)
        for name in ("dq", "dk", "dv", "dg"):
            np.testing.assert_allclose(getattr(packed, name)[:, tokens], getattr(grads, name), rtol=1e-14, atol=1e-15)
        np.testing.assert_allclose(packed.dinitial_state[n:n + 1], grads.dinitial_state, rtol=1e-14, atol=1e-15)
        dg_gamma += np.asarray(grads.dg_gamma)
    np.testing.assert_allclose(packed.dg_gamma, dg_gamma, rtol=1e-13)


def test_empty_sequences_without_initial_state_end_in_zeros(x64):
    rng = np.random.default_rng(9)
    q, k, v = normal(rng, 1, 5, H, K), normal(rng, 1, 5, H, K), normal(rng, 1, 5, H, V)
    _, ht = forward(**as_jax(q=q, k=k, v=v), scale=SCALE, output_final_state=True,
                    cu_seqlens=jnp.asarray([0, 0, 1, 3, 3, 5]))
    np.testing.assert_array_equal(ht[0], np.zeros((H, K, V)))
    np.testing.assert_array_equal(ht[3], np.zeros((H, K, V)))
    np.testing.assert_allclose(ht[2], np.einsum("thk,thv->hkv", k[0, 1:3], v[0, 1:3]), rtol=1e-13)


# -- gates of -inf ------------------------------------------------------------------------------


def test_a_gate_of_minus_inf_cuts_the_sequence_in_two(x64):
    """``g = -inf`` at token ``t``: the tokens before it are a call of their own (whose final state
    nothing reads), the tokens from it a call from a zero state; dg at the cut is 0."""
    T, t = 6, 2
    rng = np.random.default_rng(10)
    primals, cotangents = random_call(rng, B=1, T=T)
    primals["initial_state"] = primals["initial_state"][:1]
    cotangents["dht"] = cotangents["dht"][:1]
    primals["g"][:, t] = -np.inf
    o, ht = forward(**as_jax(**primals), scale=SCALE, output_final_state=True)
    grads = backward(**as_jax(**primals, **cotangents), scale=SCALE)

    def part(tokens, initial_state, dht):
        one = dict(q=primals["q"][:, tokens], k=primals["k"][:, tokens], v=primals["v"][:, tokens],
                   g=np.where(np.isinf(primals["g"][:, tokens]), 0.0, primals["g"][:, tokens]),
                   g_gamma=primals["g_gamma"], initial_state=initial_state)
        outputs = forward(**as_jax(**one), scale=SCALE, output_final_state=True)
        return outputs, backward(**as_jax(**one), do=jnp.asarray(cotangents["do"][:, tokens]), dht=jnp.asarray(dht), scale=SCALE)

    (o_before, _), before = part(slice(0, t), primals["initial_state"], np.zeros_like(cotangents["dht"]))
    (o_after, ht_after), after = part(slice(t, T), np.zeros_like(primals["initial_state"]), cotangents["dht"])
    np.testing.assert_allclose(o, np.concatenate([o_before, o_after], axis=1), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(ht, ht_after, rtol=1e-13, atol=1e-15)
    for name in ("dq", "dk", "dv"):
        joined = np.concatenate([getattr(before, name), getattr(after, name)], axis=1)
        np.testing.assert_allclose(getattr(grads, name), joined, rtol=1e-13, atol=1e-15)
    np.testing.assert_array_equal(grads.dg[:, t], 0.0)
    np.testing.assert_allclose(grads.dg[:, :t], before.dg, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(grads.dg[:, t + 1:], after.dg[:, 1:], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(grads.dinitial_state, before.dinitial_state, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(grads.dg_gamma, np.asarray(before.dg_gamma) + np.asarray(after.dg_gamma), rtol=1e-13)


def test_a_g_gamma_of_minus_inf_keeps_only_each_token_s_own_write(x64):
    """Head 0's ``g_gamma = -inf`` resets its state at every token: ``S_t = k_t^T v_t``, so
    ``o_t = scale (q_t . k_t) v_t`` and the final state is the last token's write, with the
    gradients of those closed forms and none for the decay or the initial state. Head 1 (finite)
    equals a call of its own."""
    T = 5
    rng = np.random.default_rng(11)
    primals, cotangents = random_call(rng, B=1, T=T)
    del primals["g"]
    primals["initial_state"], cotangents["dht"] = primals["initial_state"][:1], cotangents["dht"][:1]
    primals["g_gamma"] = np.array([-np.inf, -0.4])
    o, ht = forward(**as_jax(**primals), scale=SCALE, output_final_state=True)
    grads = backward(**as_jax(**primals, **cotangents), scale=SCALE)

    q, k, v = (primals[name][0, :, 0] for name in ("q", "k", "v"))
    do, dht = cotangents["do"][0, :, 0], cotangents["dht"][0, 0]
    qk, v_do = np.sum(q * k, axis=-1, keepdims=True), np.sum(v * do, axis=-1, keepdims=True)
    np.testing.assert_allclose(o[0, :, 0], SCALE * qk * v, rtol=1e-13)
    np.testing.assert_allclose(ht[0, 0], np.outer(k[-1], v[-1]), rtol=1e-13)
    last = np.arange(T)[:, None] == T - 1
    np.testing.assert_allclose(grads.dq[0, :, 0], SCALE * v_do * k, rtol=1e-13)
    np.testing.assert_allclose(grads.dk[0, :, 0], SCALE * v_do * q + last * (v @ dht.T), rtol=1e-13)
    np.testing.assert_allclose(grads.dv[0, :, 0], SCALE * qk * do + last * (k @ dht), rtol=1e-13)
    np.testing.assert_array_equal(grads.dinitial_state[0, 0], 0.0)
    assert grads.dg_gamma[0] == 0.0

    head = {name: x[..., 1:2, :] if name in ("q", "k", "v") else x for name, x in primals.items()}
    head.update(g_gamma=primals["g_gamma"][1:], initial_state=primals["initial_state"][:, 1:])
    o1, ht1 = forward(**as_jax(**head), scale=SCALE, output_final_state=True)
    grads1 = backward(**as_jax(**head), do=jnp.asarray(cotangents["do"][..., 1:2, :]),
                      dht=jnp.asarray(cotangents["dht"][:, 1:]), scale=SCALE)
    np.testing.assert_allclose(o[..., 1:2, :], o1, rtol=1e-13)
    np.testing.assert_allclose(ht[:, 1:], ht1, rtol=1e-13)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(getattr(grads, name)[..., 1:2, :], getattr(grads1, name), rtol=1e-13)
    np.testing.assert_allclose(grads.dinitial_state[:, 1:], grads1.dinitial_state, rtol=1e-13)
    np.testing.assert_allclose(grads.dg_gamma[1:], grads1.dg_gamma, rtol=1e-13)


# -- transformations --------------------------------------------------------------------------


def test_it_works_under_jit_vmap_and_grad_and_leaves_the_global_config_alone():
    x64, default_device = jax.config.jax_enable_x64, jax.config.jax_default_device
    rng = np.random.default_rng(10)
    primals, cotangents = random_call(rng)
    inputs = {name: jnp.asarray(x, jnp.float32) for name, x in primals.items()}
    do = jnp.asarray(cotangents["do"], jnp.float32)

    def run(**arrays):
        return forward(**arrays, scale=SCALE, output_final_state=True)

    eager = run(**inputs)
    jitted = jax.jit(run)(**inputs)
    np.testing.assert_array_equal(jitted[0], eager[0])
    np.testing.assert_array_equal(jitted[1], eager[1])

    stacked_q = jnp.stack([inputs["q"], 2 * inputs["q"]])
    mapped_o = jax.vmap(lambda q: run(**{**inputs, "q": q})[0])(stacked_q)
    np.testing.assert_array_equal(mapped_o[0], eager[0])
    np.testing.assert_array_equal(mapped_o[1], run(**{**inputs, "q": stacked_q[1]})[0])

    loss = lambda arrays: jnp.sum(run(**arrays)[0] * do)  # noqa: E731
    grad = jax.jit(jax.grad(loss))(inputs)
    explicit = backward(**inputs, do=do, scale=SCALE)
    for name in primals:
        np.testing.assert_array_equal(grad[name], getattr(explicit, "d" + name))
    assert (jax.config.jax_enable_x64, jax.config.jax_default_device) == (x64, default_device)
    assert grad["q"].devices() == inputs["q"].devices()
