"""Where a traced call runs is where its program is lowered: per-platform selection, decided at lowering.

No TPU is needed: a program is lowered (not compiled) for TPU with ``lowering_platforms=("tpu",)``
or ``jax.export``. The fake implementations mark their platform with an op that shows in the
lowered text: sine on CPU, cosine on TPU.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

import tops_core
from tests import fakes
from tops_core import NoImplementationError
from tops_core.lowering import per_platform

sg = tops_core.op("simple_gla")


def sine(q, k, v, **kw):
    return jnp.sin(v), None


def cosine(q, k, v, **kw):
    return jnp.cos(v), None


def lowered(function, *args, platforms):
    return jax.jit(function).trace(*args).lower(lowering_platforms=platforms).as_text()


def output():
    """A new function each time: jax.jit caches a function's traces across tests, and every test registers its own fakes."""
    return lambda q, k, v: sg.forward(q, k, v)[0]


@pytest.fixture
def cpu_and_tpu(registry):
    """A CPU implementation (sine) and a TPU one (cosine, forward-only), both winning on their platform."""
    fakes.register("on_cpu", forward=sine, platforms={"cpu"}, priority={"cpu": 10})
    fakes.register("on_tpu", forward=cosine, backward=None, platforms={"tpu"}, priority={"tpu": 10})
    return fakes.inputs()[:3]


def test_a_traced_call_runs_the_implementation_of_the_platform_it_is_lowered_for(cpu_and_tpu):
    q, k, v = cpu_and_tpu
    for_cpu, for_tpu = lowered(output(), q, k, v, platforms=("cpu",)), lowered(output(), q, k, v, platforms=("tpu",))
    assert "stablehlo.sine" in for_cpu and "stablehlo.cosine" not in for_cpu
    assert "stablehlo.cosine" in for_tpu and "stablehlo.sine" not in for_tpu
    np.testing.assert_array_equal(jax.jit(output())(q, k, v), jnp.sin(v))


def test_export_for_several_platforms_keeps_each_platforms_choice(cpu_and_tpu):
    q, k, v = cpu_and_tpu
    exported = jax.export.export(jax.jit(output()), platforms=("cpu", "tpu"))(q, k, v)
    text = exported.mlir_module()
    assert "stablehlo.sine" in text and "stablehlo.cosine" in text
    np.testing.assert_array_equal(exported.call(q, k, v), jnp.sin(v))


def test_the_gradient_pairs_each_platforms_forward_with_its_backward(cpu_and_tpu):
    # On TPU the forward-only kernel pairs with the one backward there is (on_cpu's runs nowhere
    # else, so TPU has none): lowering the gradient for TPU says so; for CPU it just works.
    q, k, v = cpu_and_tpu
    fakes.register("portable", priority={"cpu": 1, "tpu": 1})
    value_and_grad = jax.value_and_grad(lambda q: jnp.sum(sg.forward(q, k, v)[0] ** 2))
    for_tpu = lowered(value_and_grad, q, platforms=("tpu",))
    assert "stablehlo.cosine" in for_tpu and "stablehlo.sine" not in for_tpu  # forward on_tpu, backward portable
    value, grad = jax.jit(value_and_grad)(q)
    assert float(value) == pytest.approx(float(jnp.sum(jnp.sin(v) ** 2)))


def test_concrete_inputs_are_decided_once_for_their_device(registry):
    traced = []

    def tracking(name, forward):
        def run(*args, **kwargs):
            traced.append(name)
            return forward(*args, **kwargs)
        return run

    fakes.register("on_cpu", forward=tracking("cpu", sine), platforms={"cpu"}, priority={"cpu": 10})
    fakes.register("on_tpu", forward=tracking("tpu", cosine), platforms={"tpu"}, priority={"tpu": 10})
    q, k, v, *_ = fakes.inputs()
    sg.forward(q, k, v)
    assert traced == ["cpu"]
    # A traced call is decided for every platform, but another platform's kernel is traced only
    # when the program is lowered for it: a CPU host's jit never traces the TPU kernel.
    jax.jit(output())(q, k, v)
    assert traced == ["cpu", "cpu"]
    lowered(output(), q, k, v, platforms=("tpu",))
    assert traced[2:] == ["tpu"]


def test_a_platform_nothing_supports_fails_only_when_lowered_for(registry):
    fakes.register("on_cpu", forward=sine, platforms={"cpu"})
    q, k, v, *_ = fakes.inputs()
    assert "stablehlo.sine" in lowered(output(), q, k, v, platforms=("cpu",))
    with pytest.raises(NoImplementationError, match=r"(?s)lowering for tpu: no implementation of simple_gla supports.*on tpu.*fake.on_cpu +rejected: runs on cpu"):
        lowered(output(), q, k, v, platforms=("tpu",))


def test_the_hosts_own_failure_surfaces_when_traced(registry):
    fakes.register("on_tpu", forward=cosine, platforms={"tpu"})
    q, k, v, *_ = fakes.inputs()
    with pytest.raises(NoImplementationError, match="this call is on cpu"):
        jax.jit(output()).trace(q, k, v)


def test_a_forced_fallback_warns_when_lowered_where_it_happens(registry):
    # Forcing the TPU implementation in a traced call falls back on CPU only: lowering for TPU is
    # silent, lowering for CPU warns.
    fakes.register("anywhere", forward=sine, priority={"cpu": 1, "gpu": 1, "tpu": 1})
    fakes.register("on_tpu", forward=cosine, platforms={"tpu"}, priority={"tpu": 10})
    q, k, v, *_ = fakes.inputs()
    forced = jax.jit(lambda q, k, v: sg.forward(q, k, v, implementation="fake.on_tpu")[0]).trace(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "stablehlo.cosine" in forced.lower(lowering_platforms=("tpu",)).as_text()
    with pytest.warns(RuntimeWarning, match=r"the forced fake.on_tpu does not support this call \(runs on tpu, this call is on cpu"):
        forced.lower(lowering_platforms=("cpu",))


def test_a_forced_fallback_that_happens_everywhere_warns_when_traced(registry):
    fakes.register("anywhere", forward=sine)
    fakes.register("narrow", forward=cosine, dtypes={"bfloat16"})
    q, k, v, *_ = fakes.inputs()
    with pytest.warns(RuntimeWarning, match="the forced fake.narrow does not support this call"):
        jax.jit(lambda q, k, v: sg.forward(q, k, v, implementation="fake.narrow")[0]).trace(q, k, v)


def test_explain_of_a_traced_call_shows_each_platforms_winner(cpu_and_tpu):
    q, k, v = cpu_and_tpu
    texts = []
    jax.jit(lambda q, k, v: texts.append(str(sg.explain(q, k, v))) or q).trace(q, k, v)
    text = texts[0]
    assert "simple_gla forward: B=2 T=12 H=3 K=8 V=5 float32 on cpu" in text
    assert "if lowered for tpu:" in text and "simple_gla forward: B=2 T=12 H=3 K=8 V=5 float32 on tpu" in text
    assert "  cpu: fake.on_cpu / fake.on_cpu" in text
    assert "  gpu: no implementation" in text
    assert "  tpu: fake.on_tpu / no backward" in text
    assert "chosen at lowering" not in str(sg.explain(q, k, v))  # concrete inputs: one platform


def test_vmap_and_higher_order_gradients_through_a_staged_choice(registry):
    fakes.register("on_cpu", platforms={"cpu"}, priority={"cpu": 10})
    fakes.register("elsewhere", platforms={"gpu", "tpu"}, priority={"tpu": 10})
    q, k, v, _, g_gamma = fakes.inputs()

    def loss(q):
        return jnp.sum(sg.forward(q, k, v, g_gamma=g_gamma)[0] ** 2)

    def direct_loss(q):
        o, _ = fakes.scan_forward(q, k, v, g=None, g_gamma=g_gamma, scale=q.shape[-1] ** -0.5, initial_state=None,
                                  output_final_state=False, cu_seqlens=None, config=None)
        return jnp.sum(o**2)

    stacked = jnp.stack([q, 2 * q])
    np.testing.assert_allclose(jax.jit(jax.vmap(loss))(stacked), jax.vmap(direct_loss)(stacked), rtol=1e-5)
    curvature = jax.jit(jax.grad(lambda q: jnp.sum(jax.grad(loss)(q) ** 2)))(q)
    np.testing.assert_allclose(curvature, jax.grad(lambda q: jnp.sum(jax.grad(direct_loss)(q) ** 2))(q), rtol=1e-4, atol=1e-6)


# -- per_platform: the staging primitive itself -------------------------------------------------

tpu_only_p = Primitive("tops_test_tpu_only")  # lowers for TPU only, and JAX cannot differentiate it
tpu_only_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(tpu_only_p, lambda ctx, x: [x], platform="tpu")
batching.primitive_batchers[tpu_only_p] = lambda args, dims: (tpu_only_p.bind(*args), dims[0])


def tpu_only(x):
    return tpu_only_p.bind(x)


def test_per_platform_lowers_each_branch_for_its_own_platforms_only():
    x = jnp.arange(4.0)
    select = lambda x: per_platform(x, {"cpu": jnp.negative, "tpu": tpu_only})  # noqa: E731
    exported = jax.export.export(jax.jit(select), platforms=("cpu", "tpu"))(x)
    np.testing.assert_array_equal(exported.call(x), -x)
    # JAX's own platform_dependent lowers the TPU branch for the CPU too, and fails on it.
    with pytest.raises(NotImplementedError, match="tops_test_tpu_only"):
        jax.export.export(jax.jit(lambda x: jax.lax.platform_dependent(x, cpu=jnp.negative, tpu=tpu_only)), platforms=("cpu", "tpu"))(x)


def test_per_platform_traces_another_platforms_branch_when_lowered_for_it_and_checks_its_shapes():
    traced = []

    def tracking(name, function):
        def run(x):
            traced.append(name)
            return function(x)
        return run

    x = jnp.arange(4.0)
    select = lambda x: per_platform(x, {"cpu": tracking("cpu", jnp.negative), "tpu": tracking("tpu", jnp.sin)})  # noqa: E731
    np.testing.assert_array_equal(jax.jit(select)(x), -x)
    assert traced == ["cpu"]
    assert "sine" in lowered(select, x, platforms=("tpu",))
    assert traced == ["cpu", "tpu"]
    wrong = lambda x: per_platform(x, {"cpu": jnp.negative, "tpu": lambda x: x[:2]})  # noqa: E731
    np.testing.assert_array_equal(jax.jit(wrong)(x), -x)
    with pytest.raises(TypeError, match="different shapes or dtypes"):
        lowered(wrong, x, platforms=("tpu",))


def test_per_platform_under_vmap_and_grad_differentiates_the_branch_that_can_be():
    x = jnp.arange(6.0).reshape(2, 3)
    select = lambda x: per_platform(x, {"cpu": jnp.sin, "tpu": tpu_only})  # noqa: E731
    np.testing.assert_allclose(jax.jit(jax.vmap(select))(x), jnp.sin(x))
    np.testing.assert_allclose(jax.jit(jax.grad(lambda x: jnp.sum(select(x))))(x), jnp.cos(x))
    gradient = lambda x: jax.grad(lambda x: jnp.sum(select(x)))(x)  # noqa: E731
    with pytest.raises(NotImplementedError, match="lowering for tpu: JAX cannot differentiate this platform's branch"):
        lowered(gradient, x, platforms=("tpu",))


def _mesh_of(device_kind: str, platform: str = "tpu") -> jax.sharding.AbstractMesh:
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(device_kind, 1, platform))


@pytest.mark.parametrize(("device_kind", "chip"), [("TPU v6 lite", "v6e"), ("TPU v5 lite", "v5e"), ("TPU v5", "v5p"), ("TPU v4", "v4"), ("TPU v99", None)])
def test_the_tpu_generation_a_call_is_lowered_for_reaches_its_call_spec(registry, device_kind, chip):
    # The TPU implementation's predicate sees the spec of its platform: the chip of the mesh in
    # context (as on a TPU host, or under compile_only.lower_for), which kernels size VMEM by.
    seen = []

    def predicate(spec):
        """records the spec"""
        seen.append(spec.chip)

    fakes.register("on_cpu", forward=sine, platforms={"cpu"}, priority={"cpu": 10})
    fakes.register("on_tpu", forward=cosine, backward=None, platforms={"tpu"}, priority={"tpu": 10}, predicate=predicate)
    q, k, v = fakes.inputs()[:3]
    with jax.sharding.use_abstract_mesh(_mesh_of(device_kind)):
        assert tops_core.target_chip() == chip
        lowered(output(), q, k, v, platforms=("tpu",))
    assert seen and set(seen) == {chip}
    assert tops_core.target_chip() is None  # this machine: no TPU


def test_a_call_spec_names_only_a_known_tpu_generation():
    spec = dict(op="simple_gla", platform="tpu", dtype="float32", batch=1, seq_len=8, heads=2, key_dim=8, value_dim=8, num_seqs=1)
    assert "on tpu (v6e)" in tops_core.CallSpec(**spec, chip="v6e").describe()
    with pytest.raises(ValueError, match="chip"):
        tops_core.CallSpec(**spec, chip="v9")
