"""xla.chunk for kda beyond the conformance grid: flash-linear-attention's own formulas, decays at
their extremes, boundaries traced under jit, the chunk size as a pure tuning knob, and grouped value
heads, the in-op gate and beta logits by their identities with the plain call."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tops_core
from tops_core.conformance.compare import measure, tolerance
from tops_plugins_xla.config import ChunkConfig
from tops_plugins_xla.kda import chunk

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


# -- decays at their extremes -------------------------------------------------------------------


def extreme_gates(kind, shape, rng):
    if kind == "-10 everywhere":
        return np.full(shape, -10.0)
    if kind == "uniform in [-10, 0]":
        return -10 * rng.uniform(size=shape)
    # Half the keys decay at -10 per token and the other half not at all: sums of -640 per chunk
    # beside decays of exactly 1, and a token at -30 now and then.
    g = np.where(rng.uniform(size=shape[-1:]) < 0.5, -10.0, 0.0) * np.ones(shape)
    return np.where(rng.uniform(size=shape) < 0.05, -30.0, g)


@pytest.mark.parametrize("kind", ["-10 everywhere", pytest.param("uniform in [-10, 0]", marks=pytest.mark.slow), "-10 or 0 per key"])
def test_extreme_decays_stay_finite_and_accurate(kind):
    """g as low as -10 per token and key, -640 across a chunk of 64: no Inf or NaN anywhere, and
    float32 results within tolerance of the reference, forward and every gradient."""
    rng = np.random.default_rng(1)
    B, T, H, K, V = 1, 130, 2, 32, 16
    q, k, do = (jnp.asarray(rng.standard_normal((B, T, H, n)), jnp.float32) for n in (K, K, V))
    v = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32)
    g = jnp.asarray(extreme_gates(kind, (B, T, H, K), rng), jnp.float32)
    beta = jnp.asarray(rng.uniform(size=(B, T, H)), jnp.float32)
    h0, dht = (jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32) for _ in range(2))
    results = {}
    for impl in ("xla.chunk", "ref.recurrent"):
        o, final_state = KDA.forward(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
                                     implementation=impl)
        grads = KDA.backward(q, k, v, g, beta, do, initial_state=h0, dht=dht, use_qk_l2norm=True, implementation=impl)
        results[impl] = dict(o=o, final_state=final_state, **{name: getattr(grads, name) for name in GRADIENTS})
    for name, got in results["xla.chunk"].items():
        assert bool(jnp.isfinite(got).all()), name
        measurement = measure(name, got, results["ref.recurrent"][name], tolerance("float32", gradient=name in GRADIENTS))
        assert measurement.passed, measurement.describe()


# -- boundaries traced under jit ---------------------------------------------------------------


def test_traced_cu_seqlens_under_jit_forward_and_gradients():
    rng = np.random.default_rng(2)
    T, H, K, V = 150, 2, 32, 16
    q, k = (jnp.asarray(rng.standard_normal((1, T, H, K)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, T, H, V)), jnp.float32)
    g = jnp.asarray(-np.abs(rng.standard_normal((1, T, H, K))) / 4, jnp.float32)
    beta = jnp.asarray(rng.uniform(size=(1, T, H)), jnp.float32)
    h0 = jnp.asarray(rng.standard_normal((4, H, K, V)), jnp.float32)

    def loss(impl, q, k, v, g, beta, h0, cu_seqlens):
        o, final_state = KDA.forward(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens,
                                     use_qk_l2norm=True, implementation=impl)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(final_state**2), (o, final_state)

    chunked = jax.jit(jax.value_and_grad(lambda *a: loss("xla.chunk", *a), argnums=tuple(range(6)), has_aux=True))
    for boundaries in ([0, 0, 1, 70, 150], [0, 64, 65, 129, 150]):  # the same compiled program for both
        cu_seqlens = jnp.asarray(boundaries, jnp.int32)
        (_, got), got_grads = chunked(q, k, v, g, beta, h0, cu_seqlens)
        (_, want), want_grads = jax.value_and_grad(lambda *a: loss("ref.recurrent", *a), argnums=tuple(range(6)),
                                                   has_aux=True)(q, k, v, g, beta, h0, cu_seqlens)
        for name, x, ref in zip(("o", "final_state"), got, want):
            assert measure(name, x, ref, tolerance("float32", gradient=False)).passed, name
        for name, x, ref in zip(("dq", "dk", "dv", "dg", "dbeta", "dinitial_state"), got_grads, want_grads):
            assert measure(name, x, ref, tolerance("float32", gradient=True)).passed, name
    assert chunked._cache_size() == 1


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


# -- grouped value heads, the in-op gate and beta logits -----------------------------------------
# chunk.forward/backward called directly, with the protocol's new arguments, and checked against
# the plain call: on q, k repeated per value head, on the activated g and beta.


def gva_inputs(B, T, H, G, K=32, V=32, N=None, seed=5):
    """float32 inputs with ``HV = G * H`` value heads; raw ``g`` (a gate's input) and ``beta`` logits."""
    rng = np.random.default_rng(seed)
    HV = G * H
    arrays = dict(
        q=(B, T, H, K), k=(B, T, H, K), v=(B, T, HV, V), g=(B, T, HV, K), beta=(B, T, HV), do=(B, T, HV, V),
        initial_state=(N or B, HV, K, V), dht=(N or B, HV, K, V),
    )
    return {name: jnp.asarray(rng.standard_normal(shape), jnp.float32) for name, shape in arrays.items()}


def run_chunk(x, cu_seqlens=None, use_gate=False, A_log=None, dt_bias=None, lower_bound=None, use_beta_sigmoid=False,
              allow_neg_eigval=False):
    """``o``, the final state and every gradient of xla.chunk's kda, called directly."""
    common = dict(scale=0.3, initial_state=x["initial_state"], cu_seqlens=cu_seqlens, use_qk_l2norm=True,
                  use_gate=use_gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                  use_beta_sigmoid=use_beta_sigmoid, allow_neg_eigval=allow_neg_eigval, config=ChunkConfig())
    args = [x[name] for name in ("q", "k", "v", "g", "beta")]
    o, final_state = chunk.forward(*args, output_final_state=True, **common)
    grads = chunk.backward(*args, x["do"], dht=x["dht"], **common)
    return dict(o=o, final_state=final_state, **{f.name: getattr(grads, f.name) for f in dataclasses.fields(grads)})


def assert_close(got, want, names):
    for name in names:
        gradient = name.startswith("d")
        assert got[name].shape == want[name].shape, name
        measurement = measure(name, got[name], want[name], tolerance("float32", gradient=gradient))
        assert measurement.passed, measurement.describe()


@pytest.mark.parametrize("G, cu_seqlens", [(2, None), (3, [0, 1, 70, 130])])
def test_grouped_value_heads_are_the_call_on_repeated_queries_and_keys(G, cu_seqlens):
    """Value head j reads q, k head j // G: the reference on q, k repeated per value head, with dq, dk its group sums."""
    B, T, H, K = (2, 100, 2, 32) if cu_seqlens is None else (1, 130, 2, 32)
    x = gva_inputs(B, T, H, G, K=K, N=None if cu_seqlens is None else len(cu_seqlens) - 1)
    x["g"] = jax.nn.log_sigmoid(x["g"]) / 4
    x["beta"] = jax.nn.sigmoid(x["beta"])
    cu_seqlens = None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)
    got = run_chunk(x, cu_seqlens)

    repeated = {name: jnp.repeat(x[name], G, axis=2) for name in ("q", "k")}
    arrays = dict(x, **repeated)
    del arrays["do"], arrays["dht"]
    o, final_state = KDA.forward(**arrays, scale=0.3, output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm=True,
                                 implementation="ref.recurrent")
    grads = KDA.backward(**arrays, do=x["do"], dht=x["dht"], scale=0.3, cu_seqlens=cu_seqlens, use_qk_l2norm=True,
                         implementation="ref.recurrent")
    want = dict(o=o, final_state=final_state, **{name: getattr(grads, name) for name in GRADIENTS})
    for name in ("dq", "dk"):
        want[name] = want[name].reshape(B, T, H, G, K).sum(axis=3)
    assert_close(got, want, ("o", "final_state") + GRADIENTS)


def gate_f64(g, A_log, dt_bias, lower_bound):
    """fla's KDA gate in float64, written out (``tops_core.ops.kda.gate`` is what the implementation uses)."""
    HV, K = g.shape[-2:]
    x = g if dt_bias is None else g + dt_bias.reshape(HV, K)
    if lower_bound is None:
        return -jnp.exp(A_log)[:, None] * jnp.logaddexp(0.0, x)
    if A_log is not None:
        x = jnp.exp(A_log)[:, None] * x
    return lower_bound / (1 + jnp.exp(-x))


@pytest.mark.parametrize("lower_bound, with_A_log, with_dt_bias, use_beta_sigmoid, allow_neg_eigval", [
    (None, True, True, True, False),
    (-5.0, True, True, True, True),
    (-5.0, False, False, False, False),
])
def test_gate_and_beta_logits_are_the_call_on_the_activated_inputs(lower_bound, with_A_log, with_dt_bias, use_beta_sigmoid,
                                                                   allow_neg_eigval):
    """o and every gradient as with g_eff and beta_eff given, the gradients of g, A_log, dt_bias and the logits
    chained through the activations' own float64 derivatives; lower_bound without use_gate (the activated call's)
    uses g as given. The grouped-value-heads test's shape, whose compiled program the activated call reuses."""
    B, T, H, G, K = 2, 100, 2, 2, 32
    x = gva_inputs(B, T, H, G, K=K, seed=6)
    rng = np.random.default_rng(7)
    A_log = jnp.asarray(rng.uniform(-1, 0.5, size=G * H), jnp.float32) if with_A_log else None
    dt_bias = jnp.asarray(rng.standard_normal(G * H * K), jnp.float32) if with_dt_bias else None
    got = run_chunk(x, use_gate=True, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                    use_beta_sigmoid=use_beta_sigmoid, allow_neg_eigval=allow_neg_eigval)

    def activations(g, beta, A_log, dt_bias):
        beta_eff = (2 if allow_neg_eigval else 1) / (1 + jnp.exp(-beta)) if use_beta_sigmoid else beta
        return gate_f64(g, A_log, dt_bias, lower_bound), beta_eff

    with jax.enable_x64(True):
        raw = [None if a is None else a.astype(jnp.float64) for a in (x["g"], x["beta"], A_log, dt_bias)]
        (g_eff, beta_eff), activations_vjp = jax.vjp(activations, *raw)
    activated = run_chunk(dict(x, g=g_eff.astype(jnp.float32), beta=beta_eff.astype(jnp.float32)), lower_bound=lower_bound)
    with jax.enable_x64(True):
        cotangents = tuple(activated[name].astype(jnp.float64) for name in ("dg", "dbeta"))
        want = dict(activated, **dict(zip(("dg", "dbeta", "dA_log", "ddt_bias"), activations_vjp(cotangents))))
    for name, given in (("dA_log", A_log), ("ddt_bias", dt_bias)):
        assert (got[name] is None) == (given is None), name
        if given is None:
            del got[name], want[name]
        else:
            assert got[name].dtype == given.dtype, name
    assert got["dg"].dtype == got["dbeta"].dtype == jnp.float32
    assert_close(got, want, [name for name in got if name != "dinitial_state"] + ["dinitial_state"])
