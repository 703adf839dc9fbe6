"""The reference plugin as the registry and the dispatcher see it, and the global state it must leave alone."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tops_core
import tops_plugins_ref
from tops_core import Capabilities, Implementation
from tops_core import registry as registry_module
from tops_core.callspec import PLATFORMS, CallSpec
from tops_core.capabilities import FLOAT_DTYPES


@pytest.fixture
def fresh_registry(monkeypatch):
    """A process-wide registry holding only what the test registers (no entry points, no TOPS_* policy)."""
    for name in ("TOPS_FORCE", "TOPS_DENY", "TOPS_STRICT", "TOPS_INTERPRET"):
        monkeypatch.delenv(name, raising=False)
    registry = registry_module.Registry(autoload=False)
    previous = registry_module.swap_default_registry(registry)
    yield registry
    registry_module.swap_default_registry(previous)


@pytest.mark.parametrize("op", ["simple_gla", "kda"])
def test_the_plugin_registers_recurrent_and_it_accepts_every_call(op):
    implementation = tops_core.default_registry().get(op, "ref.recurrent")
    contract = tops_core.op(op)
    assert implementation.backward is not None and implementation.description
    g_gamma_ranks = [(("g_gamma", 0),), (("g_gamma", 1),)] if op == "simple_gla" else [()]
    for platform, dtype, ndims in itertools.product(PLATFORMS, FLOAT_DTYPES, g_gamma_ranks):
        spec = CallSpec(op=op, platform=platform, dtype=dtype, batch=1, seq_len=3, heads=2, key_dim=256,
                        value_dim=7, num_seqs=2, features=contract.features, ndims=ndims,
                        value_heads=4 if "grouped_value_heads" in contract.features else None)
        assert implementation.reasons(spec, "backward") == [], spec.describe()


@pytest.mark.parametrize("op", ["simple_gla", "kda"])
def test_without_a_cpu_device_the_matcher_rejects_it_with_a_reason(op, monkeypatch):
    real_devices = jax.devices

    def no_cpu(backend=None):
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu")
        return real_devices(backend)

    monkeypatch.setattr(jax, "devices", no_cpu)
    implementation = tops_core.default_registry().get(op, "ref.recurrent")
    spec = CallSpec(op=op, platform="gpu", dtype="float32", batch=1, seq_len=3, heads=2, key_dim=4, value_dim=4,
                    num_seqs=1)
    assert implementation.reasons(spec, "forward") == [
        "needs a CPU device for its float64 host scan, and JAX has none (JAX_PLATFORMS leaves cpu out)"
    ]


def test_any_other_supporting_implementation_wins_over_the_oracle(fresh_registry):
    """Even one that declares no priority (0 everywhere) and whose name sorts after it: ties go by name."""
    fresh_registry.register_plugin(tops_plugins_ref, "ref")
    kernel = Implementation(op="simple_gla", name="kernel", forward=lambda *args, **kwargs: None,
                            capabilities=Capabilities(platforms={"cpu"}, dtypes={"float32"}))
    tops_core.register(kernel, plugin="zzz")
    sg = tops_core.op("simple_gla")
    x = jnp.zeros((1, 2, 1, 4), jnp.float32)
    bf16 = x.astype(jnp.bfloat16)
    assert sg.explain(x, x, x).forward.implementation.name == "zzz.kernel"
    assert sg.explain(x, x, x, g_gamma=jnp.zeros(())).forward.implementation.name == "ref.recurrent"
    assert sg.explain(bf16, bf16, bf16).forward.implementation.name == "ref.recurrent"


def test_float64_bits_cross_the_host_callback_unchanged(x64):
    """float64 travels as uint32 pairs both ways, so no thread's x64 setting can round it to float32."""
    from tops_plugins_ref import callback
    from tops_plugins_ref.host import wire

    value = jnp.asarray([1 + 2.0**-40, -3e-300, np.pi], jnp.float64)
    spec = jax.ShapeDtypeStruct(value.shape, jnp.float64)
    host = wire.decode(np.asarray(callback._device_encode(value)))
    back = callback._device_decode(jnp.asarray(wire.encode(host)), spec)
    assert host.dtype == np.float64 and back.dtype == jnp.float64
    np.testing.assert_array_equal(host, np.asarray(value))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(value))


def test_float64_stays_exact_when_the_callback_runs_on_a_runtime_thread(x64):
    """With work queued ahead of it the callback runs on a runtime thread, outside the caller's
    thread-local jax.enable_x64; float64 operands were then rounded to float32 (gradients off by
    ~1e-7) before they crossed the boundary as uint32 pairs."""

    def scan(q, k, v):
        def step(S, x):
            q_t, k_t, v_t = x
            S = S + k_t[..., :, None] * v_t[..., None, :]
            return S, jnp.einsum("bhk,bhkv->bhv", q_t, S) * 4**-0.5
        _, o = jax.lax.scan(step, jnp.zeros((1, 1, 4, 4)), tuple(x.swapaxes(0, 1) for x in (q, k, v)))
        return o.swapaxes(0, 1)

    rng = np.random.default_rng(0)
    q, k, v, do = (jnp.asarray(rng.standard_normal((1, 16, 1, 4))) for _ in range(4))
    want = jax.vjp(scan, q, k, v)[1](do)[0]
    busy = jnp.ones((1024, 1024), jnp.float32)
    queued = [busy @ busy for _ in range(4)]  # dispatched asynchronously: the next call waits behind them
    got = tops_core.op("simple_gla").backward(q, k, v, do, implementation="ref.recurrent").dq
    jax.block_until_ready(queued)
    assert got.dtype == jnp.float64
    assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) < 1e-13
