"""The kda reference against numbers worked out independently, the delta rule's properties and finite differences.

Expected values come from closed forms or plain numpy written here, never from the code under test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tops_core
from tops_plugins_ref import kda as ref_kda
from tops_plugins_ref.host import kda as host_kda

# Cases of one token and two heads are time-major by construction; the head-first hint does not apply.
pytestmark = pytest.mark.filterwarnings("ignore::tops_core.LayoutWarning")

REF = "ref.recurrent"
H, K, V = 2, 3, 4
SCALE = 0.7

kda = tops_core.op("kda")


def normal(rng, *shape):
    return rng.normal(size=shape)


def as_jax(**arrays):
    return {name: None if x is None else jnp.asarray(x) for name, x in arrays.items()}


def forward(**kwargs):
    return kda.forward(**kwargs, implementation=REF)


def backward(**kwargs):
    return kda.backward(**kwargs, implementation=REF)


def unit_rows(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def delta_step(state, q, k, v, g, beta):
    """One token of the kda recurrence (docs/ops.md) for one head, written out in numpy."""
    decayed = np.exp(g)[:, None] * state
    state = decayed + beta * np.outer(k, v - k @ decayed)
    return state, SCALE * q @ state


# -- cases worked by hand -------------------------------------------------------------------


def test_one_token_matches_the_closed_form(x64):
    rng = np.random.default_rng(1)
    q, k, v = normal(rng, 1, 1, H, K), normal(rng, 1, 1, H, K), normal(rng, 1, 1, H, V)
    g, beta, s0 = -rng.random((1, 1, H, K)), rng.random((1, 1, H)), normal(rng, 1, H, K, V)

    o, ht = forward(**as_jax(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0), scale=SCALE, output_final_state=True)

    for h in range(H):
        decayed = np.diag(np.exp(g[0, 0, h])) @ s0[0, h]
        s1 = decayed + beta[0, 0, h] * np.outer(k[0, 0, h], v[0, 0, h] - k[0, 0, h] @ decayed)
        np.testing.assert_allclose(ht[0, h], s1, rtol=1e-13)
        np.testing.assert_allclose(o[0, 0, h], SCALE * q[0, 0, h] @ s1, rtol=1e-13)


def test_two_tokens_match_two_steps_of_the_recurrence(x64):
    rng = np.random.default_rng(2)
    q, k, v = normal(rng, 1, 2, H, K), normal(rng, 1, 2, H, K), normal(rng, 1, 2, H, V)
    g, beta, s0 = -rng.random((1, 2, H, K)), rng.random((1, 2, H)), normal(rng, 1, H, K, V)

    o, ht = forward(**as_jax(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0), scale=SCALE, output_final_state=True)

    for h in range(H):
        s1, o1 = delta_step(s0[0, h], q[0, 0, h], k[0, 0, h], v[0, 0, h], g[0, 0, h], beta[0, 0, h])
        s2, o2 = delta_step(s1, q[0, 1, h], k[0, 1, h], v[0, 1, h], g[0, 1, h], beta[0, 1, h])
        np.testing.assert_allclose(o[0, 0, h], o1, rtol=1e-13)
        np.testing.assert_allclose(o[0, 1, h], o2, rtol=1e-13)
        np.testing.assert_allclose(ht[0, h], s2, rtol=1e-13)


def test_a_full_strength_write_with_a_unit_key_is_recalled_exactly(x64):
    """With beta = 1 and |k| = 1 the delta rule overwrites what k recalls: k S_t = v_t."""
    rng = np.random.default_rng(3)
    k, v = unit_rows(normal(rng, 1, 1, H, K)), normal(rng, 1, 1, H, V)
    _, ht = forward(**as_jax(q=k, k=k, v=v, g=-rng.random((1, 1, H, K)), beta=np.ones((1, 1, H)),
                             initial_state=normal(rng, 1, H, K, V)), scale=SCALE, output_final_state=True)
    np.testing.assert_allclose(np.einsum("hk,hkv->hv", k[0, 0], ht[0]), v[0, 0], rtol=1e-12)


def test_without_writes_it_reads_the_decayed_initial_state(x64):
    rng = np.random.default_rng(4)
    q, k, v = normal(rng, 2, 4, H, K), normal(rng, 2, 4, H, K), normal(rng, 2, 4, H, V)
    g, s0 = -rng.random((2, 4, H, K)), normal(rng, 2, H, K, V)

    o, ht = forward(**as_jax(q=q, k=k, v=v, g=g, beta=np.zeros((2, 4, H)), initial_state=s0),
                    scale=SCALE, output_final_state=True)

    cumulative = np.cumsum(g, axis=1)  # per key row
    expected = SCALE * np.einsum("bthk,bhkv->bthv", q * np.exp(cumulative), s0)
    np.testing.assert_allclose(o, expected, rtol=1e-12)
    np.testing.assert_allclose(ht, np.exp(cumulative[:, -1])[..., None] * s0, rtol=1e-12)


@pytest.mark.parametrize("size", [1.0, 1e-3], ids=["unit-scale", "epsilon-dominated"])
def test_qk_l2norm_is_flash_linear_attentions_normalisation(x64, size):
    """``x / sqrt(sum(x^2) + 1e-6)``, then the recurrence, all in numpy; at size 1e-3 the epsilon
    is as large as ``sum(x^2)``, so an exact ``x / |x|`` would be off by a factor of about 1.4."""
    rng = np.random.default_rng(5)
    q, k, v = size * normal(rng, 2, 4, H, K), size * normal(rng, 2, 4, H, K), normal(rng, 2, 4, H, V)
    g, beta = -rng.random((2, 4, H, K)), rng.random((2, 4, H))
    o, ht = forward(**as_jax(q=q, k=k, v=v, g=g, beta=beta), scale=SCALE, use_qk_l2norm=True, output_final_state=True)

    def normalised(x):
        return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)

    qn, kn = normalised(q), normalised(k)
    for b in range(2):
        for h in range(H):
            state = np.zeros((K, V))
            for t in range(4):
                state, o_t = delta_step(state, qn[b, t, h], kn[b, t, h], v[b, t, h], g[b, t, h], beta[b, t, h])
                np.testing.assert_allclose(o[b, t, h], o_t, rtol=1e-12)
            np.testing.assert_allclose(ht[b, h], state, rtol=1e-12)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_results_come_back_in_the_contract_dtypes(dtype):
    x = jnp.full((1, 2, H, K), 0.5, dtype)
    y = jnp.full((1, 2, H, V), 0.5, dtype)
    beta = jnp.full((1, 2, H), 0.5, dtype)
    o, ht = forward(q=x, k=x, v=y, g=-x, beta=beta, output_final_state=True)
    grads = backward(q=x, k=x, v=y, g=-x, beta=beta, do=y, dht=ht)
    assert (o.dtype, ht.dtype) == (dtype, jnp.float32)
    assert {grads.dq.dtype, grads.dk.dtype, grads.dv.dtype, grads.dg.dtype, grads.dbeta.dtype} == {jnp.dtype(dtype)}
    assert grads.dinitial_state is None


# -- gradients ------------------------------------------------------------------------------


def random_call(rng, B=2, T=4, cu_seqlens=None):
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    return dict(
        q=unit_rows(normal(rng, B, T, H, K)), k=unit_rows(normal(rng, B, T, H, K)), v=normal(rng, B, T, H, V),
        g=np.log(1 / (1 + np.exp(-normal(rng, B, T, H, K)))) / 4, beta=rng.uniform(0.1, 0.9, (B, T, H)),
        initial_state=normal(rng, N, H, K, V),
    ), dict(do=normal(rng, B, T, H, V), dht=normal(rng, N, H, K, V))


# Each case compiles its own float64 scans, so the two cases cover use_qk_l2norm on and off between them.
@pytest.mark.parametrize(
    "cu_seqlens, use_qk_l2norm", [(None, True), ([0, 0, 1, 3, 3, 5], False)], ids=["batch-qk_l2norm", "packed"]
)
def test_every_gradient_matches_finite_differences(x64, finite_difference_errors, use_qk_l2norm, cu_seqlens):
    rng = np.random.default_rng(6)
    B, T = (2, 4) if cu_seqlens is None else (1, cu_seqlens[-1])
    primals, cotangents = random_call(rng, B, T, cu_seqlens)
    if use_qk_l2norm:  # un-normalised q and k, so the normalisation's own gradient matters
        primals["q"], primals["k"] = 2 * normal(rng, B, T, H, K), 2 * normal(rng, B, T, H, K)
    extra = dict(scale=SCALE, use_qk_l2norm=use_qk_l2norm,
                 cu_seqlens=None if cu_seqlens is None else jnp.asarray(cu_seqlens))

    def loss(p):
        o, ht = forward(**as_jax(**p), output_final_state=True, **extra)
        return jnp.sum(o * cotangents["do"]) + jnp.sum(ht * cotangents["dht"])

    grads = backward(**as_jax(**primals, **cotangents), **extra)
    named = {name: getattr(grads, "d" + name) for name in primals}
    errors = finite_difference_errors(loss, primals, named)
    assert max(errors.values()) < 1e-7, errors


# -- packing ----------------------------------------------------------------------------------


def test_packed_sequences_equal_separate_calls(x64):
    """Lengths 0, 1, 2, 0, 2: empty sequences keep their initial state and pass dht straight back."""
    cu_seqlens = [0, 0, 1, 3, 3, 5]
    rng = np.random.default_rng(7)
    primals, cotangents = random_call(rng, 1, 5, cu_seqlens)
    packed_o, packed_ht = forward(**as_jax(**primals), scale=SCALE, output_final_state=True, cu_seqlens=jnp.asarray(cu_seqlens))
    packed = backward(**as_jax(**primals, **cotangents), scale=SCALE, cu_seqlens=jnp.asarray(cu_seqlens))

    for n, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        if start == end:
            np.testing.assert_array_equal(packed_ht[n], primals["initial_state"][n])
            np.testing.assert_array_equal(packed.dinitial_state[n], cotangents["dht"][n])
            continue
        tokens = slice(start, end)
        one = {name: x[:, tokens] for name, x in primals.items() if name != "initial_state"}
        one["initial_state"] = primals["initial_state"][n:n + 1]
        o, ht = forward(**as_jax(**one), scale=SCALE, output_final_state=True)
        grads = backward(**as_jax(**one), do=jnp.asarray(cotangents["do"][:, tokens]),
                         dht=jnp.asarray(cotangents["dht"][n:n + 1]), scale=SCALE)
        np.testing.assert_allclose(packed_o[:, tokens], o, rtol=1e-14, atol=1e-15)
        np.testing.assert_allclose(packed_ht[n:n + 1], ht, rtol=1e-14, atol=1e-15)
        for name in ("dq", "dk", "dv", "dg", "dbeta"):
            np.testing.assert_allclose(getattr(packed, name)[:, tokens], getattr(grads, name), rtol=1e-14, atol=1e-15)
        np.testing.assert_allclose(packed.dinitial_state[n:n + 1], grads.dinitial_state, rtol=1e-14, atol=1e-15)


# -- transformations --------------------------------------------------------------------------


def test_it_works_under_jit_vmap_and_grad():
    rng = np.random.default_rng(8)
    primals, cotangents = random_call(rng)
    inputs = {name: jnp.asarray(x, jnp.float32) for name, x in primals.items()}
    do = jnp.asarray(cotangents["do"], jnp.float32)

    def run(**arrays):
        return forward(**arrays, scale=SCALE, output_final_state=True, use_qk_l2norm=True)

    eager = run(**inputs)
    jitted = jax.jit(run)(**inputs)
    np.testing.assert_array_equal(jitted[0], eager[0])
    np.testing.assert_array_equal(jitted[1], eager[1])

    stacked_beta = jnp.stack([inputs["beta"], inputs["beta"] / 2])
    mapped_o = jax.vmap(lambda beta: run(**{**inputs, "beta": beta})[0])(stacked_beta)
    np.testing.assert_array_equal(mapped_o[0], eager[0])
    np.testing.assert_array_equal(mapped_o[1], run(**{**inputs, "beta": stacked_beta[1]})[0])

    loss = lambda arrays: jnp.sum(run(**arrays)[0] * do)  # noqa: E731
    grad = jax.jit(jax.grad(loss))(inputs)
    explicit = backward(**inputs, do=do, scale=SCALE, use_qk_l2norm=True)
    for name in primals:
        np.testing.assert_array_equal(grad[name], getattr(explicit, "d" + name))


# -- grouped value heads, the in-op gate and beta logits --------------------------------------
# Each reduces to a plain call (repeated q and k, the gate and beta precomputed in numpy here),
# which the tests above pin down, and its gradients meet finite differences. The contract does not
# pass these arguments yet, so the tests call the host functions (and, for the result specs, the
# plugin's entry points) directly.

HV = 2 * H  # value heads in the grouped cases


def host_call(rng, B, T, H, HV, cu_seqlens=None, with_A_log=True, with_dt_bias=True):
    """Float64 host inputs with grouped value heads, the raw gate and beta logits around 0, and their cotangents."""
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    primals = dict(
        q=normal(rng, B, T, H, K), k=normal(rng, B, T, H, K), v=normal(rng, B, T, HV, V), g=normal(rng, B, T, HV, K),
        beta=normal(rng, B, T, HV), initial_state=normal(rng, N, HV, K, V),
        A_log=normal(rng, HV) / 2 if with_A_log else None, dt_bias=normal(rng, HV * K) / 2 if with_dt_bias else None,
    )
    cotangents = dict(do=normal(rng, B, T, HV, V), dht=normal(rng, N, HV, K, V))
    return primals, cotangents, None if cu_seqlens is None else np.asarray(cu_seqlens)


def softplus(x):
    return np.log1p(np.exp(x))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def gate(g, A_log, dt_bias, lower_bound):
    """flash-linear-attention's KDA gate (fla/ops/kda/gate.py), written out."""
    x = g if dt_bias is None else g + dt_bias.reshape(g.shape[-2:])
    rate = 1 if A_log is None else np.exp(A_log)[:, None]
    return -rate * softplus(x) if lower_bound is None else lower_bound * sigmoid(rate * x)


@pytest.mark.parametrize("G", [2, 3])
def test_grouped_value_heads_equal_explicitly_repeated_queries_and_keys(G):
    """Value heads h G .. h G + G - 1 read head h (repeat_interleave); dq and dk sum over each group."""
    rng = np.random.default_rng(9)
    B, T = 2, 5
    primals, cotangents, cu_seqlens = host_call(rng, B, T, H, G * H, with_A_log=False, with_dt_bias=False)
    primals["g"], primals["beta"] = -np.abs(primals["g"]) / 2, sigmoid(primals["beta"])
    flags = dict(scale=SCALE, use_qk_l2norm=True)
    repeated = dict(primals, q=np.repeat(primals["q"], G, axis=2), k=np.repeat(primals["k"], G, axis=2))
    for name in ("q", "k"):
        for j in range(G * H):
            np.testing.assert_array_equal(repeated[name][:, :, j], primals[name][:, :, j // G])

    grouped = host_kda.forward(dict(primals, cu_seqlens=cu_seqlens), output_final_state=True, **flags)
    want = host_kda.forward(dict(repeated, cu_seqlens=cu_seqlens), output_final_state=True, **flags)
    for name in ("o", "final_state"):
        np.testing.assert_allclose(grouped[name], want[name], rtol=1e-14, atol=1e-15)

    grads = host_kda.backward(dict(primals, **cotangents, cu_seqlens=cu_seqlens), **flags)
    want = host_kda.backward(dict(repeated, **cotangents, cu_seqlens=cu_seqlens), **flags)
    for name in ("dv", "dg", "dbeta", "dinitial_state"):
        np.testing.assert_allclose(grads[name], want[name], rtol=1e-14, atol=1e-15)
    for name in ("dq", "dk"):  # the normalisation's VJP is linear in its cotangent: summing before or after it agree
        group_sum = want[name].reshape(B, T, H, G, K).sum(axis=3)
        np.testing.assert_allclose(grads[name], group_sum, rtol=1e-12, atol=1e-14)


# The softplus gate always comes with A_log.
@pytest.mark.parametrize("lower_bound, with_A_log", [(None, True), (-5.0, True), (-5.0, False)],
                         ids=["softplus", "lower_bound", "lower_bound-no-A_log"])
@pytest.mark.parametrize("with_dt_bias", [True, False], ids=["dt_bias", "no-dt_bias"])
def test_the_gate_is_the_recurrence_on_the_precomputed_gate(x64, lower_bound, with_A_log, with_dt_bias):
    rng = np.random.default_rng(10)
    primals, _, _ = host_call(rng, 2, 5, H, HV, with_A_log=with_A_log, with_dt_bias=with_dt_bias)
    g_eff = gate(primals["g"], primals["A_log"], primals["dt_bias"], lower_bound)
    # The test's formula is the contract's, whose A_log and dt_bias come shaped per head to broadcast against g.
    shaped = as_jax(g=primals["g"], A_log=primals["A_log"][:, None] if with_A_log else None,
                    dt_bias=primals["dt_bias"].reshape(HV, K) if with_dt_bias else None)
    np.testing.assert_allclose(tops_core.ops.kda.gate(**shaped, lower_bound=lower_bound), g_eff, rtol=1e-14)

    flags = dict(scale=SCALE, output_final_state=True, use_qk_l2norm=True)
    gated = host_kda.forward(dict(primals, cu_seqlens=None), use_gate=True, lower_bound=lower_bound, **flags)
    want = host_kda.forward(dict(primals, g=g_eff, A_log=None, dt_bias=None, cu_seqlens=None), **flags)
    for name in ("o", "final_state"):
        np.testing.assert_allclose(gated[name], want[name], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("allow_neg_eigval", [False, True])
def test_beta_logits_are_the_recurrence_on_their_sigmoid(x64, allow_neg_eigval):
    rng = np.random.default_rng(11)
    primals, _, _ = host_call(rng, 2, 5, H, HV, with_A_log=False, with_dt_bias=False)
    primals["g"] = -np.abs(primals["g"]) / 2
    beta_eff = (2 if allow_neg_eigval else 1) * sigmoid(primals["beta"])
    np.testing.assert_allclose(tops_core.ops.kda.beta_activation(jnp.asarray(primals["beta"]), allow_neg_eigval), beta_eff,
                               rtol=1e-14)

    flags = dict(scale=SCALE, output_final_state=True, use_qk_l2norm=False)
    logits = host_kda.forward(dict(primals, cu_seqlens=None), use_beta_sigmoid=True, allow_neg_eigval=allow_neg_eigval, **flags)
    want = host_kda.forward(dict(primals, beta=beta_eff, cu_seqlens=None), **flags)
    for name in ("o", "final_state"):
        np.testing.assert_allclose(logits[name], want[name], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("T, cu_seqlens, use_qk_l2norm, activations, with_A_log, with_dt_bias", [
    (7, None, True, dict(use_gate=True, use_beta_sigmoid=True), True, True),
    (9, [0, 3, 3, 9], False, dict(use_gate=True, lower_bound=-5.0, use_beta_sigmoid=True, allow_neg_eigval=True), True, True),
    (5, None, False, dict(use_gate=True, lower_bound=-3.0), False, True),
    (6, [0, 2, 6], True, dict(use_gate=True, lower_bound=-2.0), True, False),
], ids=["softplus-sigmoid-qk_l2norm", "packed-lower_bound-neg_eigval", "lower_bound-no-A_log", "packed-lower_bound-no-dt_bias"])
def test_every_host_gradient_matches_finite_differences(finite_difference_errors, T, cu_seqlens, use_qk_l2norm, activations,
                                                         with_A_log, with_dt_bias):
    """The raw gate, beta logits, A_log, dt_bias and grouped q, k (H = 1, HV = 2) too."""
    rng = np.random.default_rng(12)
    primals, cotangents, cu_seqlens = host_call(rng, 1, T, 1, 2, cu_seqlens, with_A_log, with_dt_bias)
    if not activations.get("use_beta_sigmoid"):
        primals["beta"] = sigmoid(primals["beta"])
    flags = dict(scale=SCALE, use_qk_l2norm=use_qk_l2norm, **activations)

    def loss(p):
        results = host_kda.forward(dict(primals, **p, cu_seqlens=cu_seqlens), output_final_state=True, **flags)
        return np.sum(results["o"] * cotangents["do"]) + np.sum(results["final_state"] * cotangents["dht"])

    grads = host_kda.backward(dict(primals, **cotangents, cu_seqlens=cu_seqlens), **flags)
    given = {name: x for name, x in primals.items() if x is not None}
    assert {name for name in primals if grads["d" + name] is not None} == set(given)
    for name, x in given.items():
        assert grads["d" + name].shape == x.shape, name
    errors = finite_difference_errors(loss, given, {name: grads["d" + name] for name in given})
    assert max(errors.values()) < 1e-7, errors


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_grouped_gated_results_come_back_in_the_contract_shapes_and_dtypes(dtype):
    """o ``[B, T, HV, V]``, the final state ``[N, HV, K, V]``; dA_log ``[HV]`` and ddt_bias ``[HV K]`` like their inputs."""
    B, T = 1, 3
    x, g = jnp.full((B, T, H, K), 0.5, dtype), jnp.full((B, T, HV, K), 0.5, dtype)
    y, beta = jnp.full((B, T, HV, V), 0.5, dtype), jnp.full((B, T, HV), 0.5, dtype)
    A_log, dt_bias = jnp.zeros(HV, jnp.float32), jnp.zeros(HV * K, jnp.float32)
    flags = dict(scale=SCALE, initial_state=None, cu_seqlens=None, use_qk_l2norm=False, use_gate=True, A_log=A_log,
                 dt_bias=dt_bias, lower_bound=None, use_beta_sigmoid=True, allow_neg_eigval=False, config=None)
    o, ht = ref_kda.forward(x, x, y, g, beta, output_final_state=True, **flags)
    grads = ref_kda.backward(x, x, y, g, beta, y, dht=ht, **flags)
    assert (o.shape, o.dtype) == ((B, T, HV, V), dtype)
    assert (ht.shape, ht.dtype) == ((B, HV, K, V), jnp.float32)
    for name, given in dict(q=x, k=x, v=y, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias).items():
        assert (getattr(grads, "d" + name).shape, getattr(grads, "d" + name).dtype) == (given.shape, given.dtype), name
    assert grads.dinitial_state is None
