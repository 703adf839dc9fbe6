"""xla.chunk for the ops with gates per key or with the delta rule, beyond the conformance grid: decays at
their extremes and boundaries traced under jit, against the float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tops_core
from tops_core.conformance.compare import measure, tolerance
from tops_plugins_xla import intra_mild

B, T, H, K, V = 1, 130, 2, 32, 16


def extreme_gates(kind, shape, rng):
    """``-10`` everywhere (``-640`` across a chunk of 64), or per key (per head) ``-10`` or ``0`` with ``-inf`` now and then,
    or chunks of 64 at the edge of ``intra_mild``'s bound (gla's dense form): ``-39.5`` over each chunk, spread evenly or
    on one token per key."""
    if kind == "-10 everywhere":
        return np.full(shape, -10.0)
    if kind == "mild bound, even":
        return np.full(shape, -39.5 / 64)
    if kind == "mild bound, one token":
        positions = np.arange(shape[1]).reshape(1, -1, *[1] * (len(shape) - 2)) % 64
        return np.where(positions == rng.integers(0, 64, size=(1, 1, *shape[2:])), -39.5, 0.0) * np.ones(shape)
    g = np.where(rng.uniform(size=shape[2:]) < 0.5, -10.0, 0.0) * np.ones(shape)
    return np.where(rng.uniform(size=shape) < 0.05, -np.inf, g)


def call(op_name, rng, g, batch=B, seq_len=T, sequences=B):
    """Arguments of a call of ``op_name`` with log decays ``g``; kda and gated_delta_rule normalise ``q``, ``k``."""
    q, k = (jnp.asarray(rng.standard_normal((batch, seq_len, H, K)) * K**-0.5, jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((batch, seq_len, H, V)), jnp.float32)
    arrays = dict(q=q, k=k, v=v, g=jnp.asarray(g, jnp.float32),
                  initial_state=jnp.asarray(rng.standard_normal((sequences, H, K, V)), jnp.float32))
    options = {}
    if op_name != "gla":
        arrays["beta"] = jnp.asarray(rng.uniform(size=(batch, seq_len, H)), jnp.float32)
        options["use_qk_l2norm"] = True
    return arrays, options


def gate_shape(op_name, batch=B, seq_len=T):
    return (batch, seq_len, H) if op_name == "gated_delta_rule" else (batch, seq_len, H, K)


@pytest.mark.parametrize("op_name", ["kda", "gla", "gated_delta_rule"])
@pytest.mark.parametrize("kind", ["-10 everywhere", "-10 or 0, -inf now and then", "mild bound, even", "mild bound, one token"])
def test_extreme_decays_stay_finite_and_accurate(op_name, kind):
    """No Inf or NaN anywhere, and float32 results within tolerance of the reference, forward and every gradient."""
    rng = np.random.default_rng(1)
    g = extreme_gates(kind, gate_shape(op_name), rng)
    if op_name == "gla" and kind.startswith("mild"):  # every chunk of 64 takes the dense form
        assert all(bool(intra_mild.is_mild(np.swapaxes(g[:, n : n + 64], 1, 2))) for n in range(0, T, 64))
    arrays, options = call(op_name, rng, g)
    do = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32)
    dht = jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32)
    op = tops_core.op(op_name)
    results = {}
    for impl in ("xla.chunk", "ref.recurrent"):
        o, final_state = op.forward(**arrays, **options, output_final_state=True, implementation=impl)
        grads = op.backward(**arrays, **options, do=do, dht=dht, implementation=impl)
        results[impl] = dict(o=o, final_state=final_state, **{"d" + name: getattr(grads, "d" + name) for name in arrays})
    for name, got in results["xla.chunk"].items():
        assert bool(jnp.isfinite(got).all()), name
        measurement = measure(name, got, results["ref.recurrent"][name], tolerance("float32", gradient=name.startswith("d")))
        assert measurement.passed, measurement.describe()


@pytest.mark.parametrize("op_name", ["kda", pytest.param("gla", marks=pytest.mark.slow), pytest.param("gated_delta_rule", marks=pytest.mark.slow)])
def test_traced_cu_seqlens_under_jit_forward_and_gradients(op_name):
    rng = np.random.default_rng(2)
    seq_len = 150
    g = -np.abs(rng.standard_normal(gate_shape(op_name, 1, seq_len))) / 4
    arrays, options = call(op_name, rng, g, batch=1, seq_len=seq_len, sequences=4)
    op = tops_core.op(op_name)

    def loss(impl, arrays, cu_seqlens):
        o, final_state = op.forward(**arrays, **options, output_final_state=True, cu_seqlens=cu_seqlens, implementation=impl)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(final_state**2), (o, final_state)

    chunked = jax.jit(jax.value_and_grad(lambda *a: loss("xla.chunk", *a), has_aux=True))
    for boundaries in ([0, 0, 1, 70, 150], [0, 64, 65, 129, 150]):  # the same compiled program for both
        cu_seqlens = jnp.asarray(boundaries, jnp.int32)
        (_, got), got_grads = chunked(arrays, cu_seqlens)
        (_, want), want_grads = jax.value_and_grad(lambda *a: loss("ref.recurrent", *a), has_aux=True)(arrays, cu_seqlens)
        for name, x, ref in zip(("o", "final_state"), got, want):
            assert measure(name, x, ref, tolerance("float32", gradient=False)).passed, name
        for name in arrays:
            assert measure("d" + name, got_grads[name], want_grads[name], tolerance("float32", gradient=True)).passed, name
    assert chunked._cache_size() == 1
