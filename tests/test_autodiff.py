"""custom_vjp wiring: grad, jit and vmap through an op whose implementations are plain jax functions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tops_core
from tests import fakes
from tops_core import ContractError, SimpleGLAGrads

sg = tops_core.op("simple_gla")


def direct(q, k, v, g, g_gamma, h0):
    """The same computation without the op: autodiff of the fake scan itself."""
    return fakes.scan_forward(q, k, v, g=g, g_gamma=g_gamma, scale=q.shape[-1] ** -0.5, initial_state=h0,
                              output_final_state=True, cu_seqlens=None, config=None)


def loss_of(forward):
    def loss(q, k, v, g, g_gamma, h0):
        o, ht = forward(q, k, v, g, g_gamma, h0)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(ht**2)
    return loss


def through_op(q, k, v, g, g_gamma, h0):
    return sg.forward(q, k, v, g=g, g_gamma=g_gamma, initial_state=h0, output_final_state=True)


@pytest.fixture
def args():
    q, k, v, g, g_gamma = fakes.inputs()
    h0 = jax.random.normal(jax.random.PRNGKey(7), (2, 3, 8, 5))
    return q, k, v, g, g_gamma, h0


def test_grad_matches_autodiff_of_the_implementation_for_every_input(registry, args):
    fakes.register()
    got = jax.grad(loss_of(through_op), argnums=range(6))(*args)
    want = jax.grad(loss_of(direct), argnums=range(6))(*args)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dg_gamma", "dinitial_state"), got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
        assert float(jnp.abs(a).max()) > 0, f"{name} is zero"


def test_jit_of_grad(registry, args):
    fakes.register()
    got = jax.jit(jax.grad(loss_of(through_op), argnums=(0, 4)))(*args)
    want = jax.grad(loss_of(direct), argnums=(0, 4))(*args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_vmap_over_an_extra_leading_axis(registry, args):
    fakes.register()
    q, k, v, g, g_gamma, h0 = args
    stacked = jnp.stack([q, 2 * q, -q])
    o = jax.vmap(lambda q: sg.forward(q, k, v, g_gamma=g_gamma)[0])(stacked)
    for i in range(3):
        np.testing.assert_allclose(o[i], sg.forward(stacked[i], k, v, g_gamma=g_gamma)[0], rtol=1e-5, atol=1e-6)
    grads = jax.vmap(jax.grad(lambda q: jnp.sum(sg.forward(q, k, v, g_gamma=g_gamma)[0])))(stacked)
    assert grads.shape == stacked.shape


def test_explicit_backward_equals_the_vjp(registry, args):
    fakes.register()
    q, k, v, g, g_gamma, h0 = args
    do = jax.random.normal(jax.random.PRNGKey(1), v.shape)
    dht = jax.random.normal(jax.random.PRNGKey(2), h0.shape)
    grads = sg.backward(q, k, v, do, g=g, g_gamma=g_gamma, initial_state=h0, dht=dht)
    _, pullback = jax.vjp(direct, q, k, v, g, g_gamma, h0)
    want = pullback((do, dht))
    for name, b in zip(("dq", "dk", "dv", "dg", "dg_gamma", "dinitial_state"), want):
        np.testing.assert_allclose(getattr(grads, name), b, rtol=1e-5, atol=1e-6, err_msg=name)
    only_qkv = sg.backward(q, k, v, do)
    assert isinstance(only_qkv, SimpleGLAGrads) and only_qkv.dg is None and only_qkv.dg_gamma is None


def test_forward_only_implementation_pairs_with_another_backward(registry, args):
    calls = []

    def recorded(tag, function):
        def wrapper(*a, **kw):
            calls.append(tag)
            return function(*a, **kw)
        return wrapper

    fakes.register("kernel", forward=recorded("kernel forward", fakes.scan_forward), backward=None, priority={"cpu": 99})
    fakes.register("portable", forward=recorded("portable forward", fakes.scan_forward),
                   backward=recorded("portable backward", fakes.vjp_backward), priority={"cpu": 1})
    got = jax.grad(loss_of(through_op), argnums=(0, 4))(*args)
    want = jax.grad(loss_of(direct), argnums=(0, 4))(*args)
    assert set(calls) == {"kernel forward", "portable backward"}
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_backward_uses_the_policy_of_the_forward_call(registry, args):
    used = []

    def tagged_backward(tag):
        def backward(*a, **kw):
            used.append(tag)
            return fakes.vjp_backward(*a, **kw)
        return backward

    fakes.register("a", backward=tagged_backward("a"), priority={"cpu": 10})
    fakes.register("b", backward=tagged_backward("b"), priority={"cpu": 1})
    q, k, v, *_ = args
    with tops_core.use(simple_gla="fake.b"):
        o, pullback = jax.vjp(lambda q: sg.forward(q, k, v)[0], q)
    pullback(o)
    assert used == ["b"]


def test_selection_and_implementation_body_run_once_per_call_spec_under_jit(registry, args):
    traces = []

    def traced_forward(*a, **kw):
        traces.append(a[0].shape)
        return fakes.scan_forward(*a, **kw)

    fakes.register(forward=traced_forward)
    q, k, v, g, g_gamma, h0 = args
    step = jax.jit(lambda q, k, v: sg.forward(q, k, v, g_gamma=g_gamma)[0])
    for _ in range(5):
        step(q, k, v).block_until_ready()
    step(q * 2, k, v).block_until_ready()
    assert traces == [q.shape]
    step(q[:, :6], k[:, :6], v[:, :6])
    assert traces == [q.shape, q[:, :6].shape]


def test_an_eager_explicit_backward_is_traced_once_per_call_spec(registry, args):
    traces = []

    def traced_backward(*a, **kw):
        traces.append(a[0].shape)
        return fakes.vjp_backward(*a, **kw)

    fakes.register(backward=traced_backward)
    q, k, v, g, g_gamma, h0 = args
    do = jnp.ones_like(v)
    first = sg.backward(q, k, v, do, g_gamma=g_gamma)
    for _ in range(3):
        again = sg.backward(q, k, v, do * 2, g_gamma=g_gamma)
    assert traces == [q.shape]
    np.testing.assert_allclose(np.asarray(again.dv), 2 * np.asarray(first.dv), rtol=1e-6)
    sg.backward(q[:, :6], k[:, :6], v[:, :6], do[:, :6], g_gamma=g_gamma)
    assert traces == [q.shape, q[:, :6].shape]


def test_integer_boundaries_get_no_cotangent(registry):
    fakes.register(features=fakes.FEATURES | {"cu_seqlens"},
                   forward=lambda q, k, v, **kw: ((v * jnp.sum(q)).astype(v.dtype), None),
                   backward=lambda q, k, v, do, **kw: SimpleGLAGrads(jnp.full_like(q, jnp.sum(do * v)), jnp.zeros_like(k), do * jnp.sum(q)))
    q, k, v, _, _ = fakes.inputs(B=1)
    grad = jax.grad(lambda q: jnp.sum(sg.forward(q, k, v, cu_seqlens=jnp.array([0, 5, 12]))[0]))(q)
    assert grad.shape == q.shape


@pytest.mark.parametrize("bad_forward, message", [
    (lambda q, k, v, **kw: v, "must return (o, final_state)"),
    (lambda q, k, v, **kw: (v[:, :1], None), "returned o (2, 1, 3, 5) float32; the contract says (2, 12, 3, 5) float32"),
    (lambda q, k, v, **kw: (v.astype(jnp.bfloat16), None), "returned o (2, 12, 3, 5) bfloat16"),
    (lambda q, k, v, **kw: (v, jnp.zeros((2, 3, 8, 5))), "returned a final_state that was not requested"),
])
def test_forward_results_are_checked_against_the_contract(registry, bad_forward, message):
    fakes.register("bad", forward=bad_forward)
    q, k, v, _, _ = fakes.inputs()
    with pytest.raises(ContractError) as raised:
        sg.forward(q, k, v)
    assert message in str(raised.value)


def test_final_state_dtype_is_checked(registry):
    fakes.register("bad", forward=lambda q, k, v, **kw: (v, jnp.zeros((2, 3, 8, 5), jnp.bfloat16)))
    q, k, v, _, _ = fakes.inputs()
    with pytest.raises(ContractError, match="final_state .* bfloat16; the contract says .* float32"):
        sg.forward(q, k, v, output_final_state=True)


def test_a_missing_gradient_is_an_error_never_a_silent_zero(registry, args):
    def drops_dg_gamma(*a, **kw):
        grads = fakes.vjp_backward(*a, **kw)
        return SimpleGLAGrads(grads.dq, grads.dk, grads.dv, grads.dg, None, grads.dinitial_state)

    fakes.register(backward=drops_dg_gamma)
    q, k, v, g, g_gamma, h0 = args
    with pytest.raises(ContractError, match="returned no dg_gamma"):
        jax.grad(lambda gamma: jnp.sum(sg.forward(q, k, v, g_gamma=gamma)[0]))(g_gamma)


def test_gradient_dtype_must_match_its_input(registry, args):
    def wrong_dtype(*a, **kw):
        grads = fakes.vjp_backward(*a, **kw)
        return SimpleGLAGrads(grads.dq.astype(jnp.bfloat16), grads.dk, grads.dv)

    fakes.register(backward=wrong_dtype)
    q, k, v, *_ = args
    with pytest.raises(ContractError, match="returned dq .* bfloat16; expected .* float32 like q"):
        sg.backward(q, k, v, v)


def test_scalar_g_gamma_gets_a_scalar_gradient(registry, args):
    fakes.register()
    q, k, v, *_ = args
    gamma = jnp.float32(-0.2)
    got = jax.grad(lambda gamma: jnp.sum(sg.forward(q, k, v, g_gamma=gamma)[0] ** 2))(gamma)
    want = jax.grad(lambda gamma: jnp.sum(direct(q, k, v, None, gamma, None)[0] ** 2))(gamma)
    assert got.shape == () and float(got) != 0.0
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_new_registration_redispatches_compiled_eager_calls(registry, args):
    q, k, v, *_ = args
    fakes.register("first", forward=lambda q, k, v, **kw: (v, None), priority={"cpu": 1})
    np.testing.assert_array_equal(sg.forward(q, k, v)[0], v)
    fakes.register("better", forward=lambda q, k, v, **kw: (2 * v, None), priority={"cpu": 2})
    np.testing.assert_array_equal(sg.forward(q, k, v)[0], 2 * v)


def test_fresh_registries_never_share_compiled_calls(clean_env, args):
    from tops_core.registry import Registry, swap_default_registry
    q, k, v, *_ = args
    previous = swap_default_registry(None)
    try:
        for factor in (1.0, 3.0):
            swap_default_registry(Registry(autoload=False))
            fakes.register("same", forward=lambda q, k, v, factor=factor, **kw: (factor * v, None))
            np.testing.assert_array_equal(sg.forward(q, k, v)[0], factor * v)
    finally:
        swap_default_registry(previous)


def test_forward_mode_autodiff_is_not_available_through_the_custom_vjp(registry, args):
    """op.forward is a jax.custom_vjp function: reverse mode only (documented in the README)."""
    fakes.register()
    q, k, v, g, g_gamma, h0 = args
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jvp(lambda q: sg.forward(q, k, v, g_gamma=g_gamma)[0], (q,), (q,))


def test_a_forward_hands_its_residuals_to_its_own_backward_under_grad_jit_checkpoint_and_vmap(registry, args):
    fakes.register(forward=fakes.keeping_forward, backward=fakes.backward_from_states, residuals=True)
    want = jax.grad(loss_of(direct), argnums=range(6))(*args)
    for got in (jax.grad(loss_of(through_op), argnums=range(6))(*args), jax.jit(jax.grad(loss_of(through_op), argnums=range(6)))(*args)):
        for name, a, b in zip(("dq", "dk", "dv", "dg", "dg_gamma", "dinitial_state"), got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
    rematerialised = jax.grad(jax.checkpoint(loss_of(through_op)), argnums=range(6))(*args)  # the forward rerun in the backward
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dg_gamma", "dinitial_state"), rematerialised, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
    q, k, v, g, g_gamma, h0 = args
    stacked = jnp.stack([q, 2 * q])
    batched = jax.vmap(jax.grad(lambda q: loss_of(through_op)(q, k, v, g, g_gamma, h0)))(stacked)
    for i in range(2):
        np.testing.assert_allclose(batched[i], jax.grad(loss_of(direct))(stacked[i], k, v, g, g_gamma, h0), rtol=1e-5, atol=1e-6)


def _spying(seen):
    def backward(*a, residuals=None, **kw):
        seen.append(residuals is not None)
        return fakes.backward_from_states(*a, residuals=residuals, **kw)
    return backward


def test_a_backward_gets_residuals_only_after_its_own_forward(registry, args):
    seen = []
    fakes.register(forward=fakes.keeping_forward, backward=_spying(seen), residuals=True)
    q, k, v, g, g_gamma, h0 = args
    jax.grad(lambda q: jnp.sum(sg.forward(q, k, v, g=g)[0]))(q)
    assert seen == [True]
    sg.backward(q, k, v, jnp.ones_like(v), g=g)  # on its own: nothing to take, it recomputes
    assert seen == [True, False]


def test_a_forward_of_another_implementation_hands_on_no_residuals(registry, args):
    def refuses(*a, residuals=False, **kw):
        assert not residuals, "asked for residuals its backward would not take"
        return fakes.scan_forward(*a, **kw)

    seen = []
    fakes.register("forward_only", forward=refuses, backward=None, residuals=True, priority={"cpu": 20})
    fakes.register(backward=_spying(seen))
    q, k, v, g, g_gamma, h0 = args
    got = jax.grad(loss_of(through_op), argnums=range(6))(*args)
    want = jax.grad(loss_of(direct), argnums=range(6))(*args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert seen == [False]


def test_residuals_lowered_for_a_platform_whose_implementation_keeps_none_are_zeros_it_ignores(registry, args):
    seen = []
    fakes.register(forward=fakes.keeping_forward, backward=_spying(seen), residuals=True)
    fakes.register("elsewhere", priority={"tpu": 10, "gpu": 10})  # plain jax: lowers for any platform
    grad = jax.jit(jax.grad(loss_of(through_op), argnums=range(6)))
    exported = jax.export.export(grad, platforms=("cpu", "tpu"))(*args)
    assert exported.platforms == ("cpu", "tpu")
    assert seen == [True]  # the CPU branch takes them; the TPU branch's forward fills their place with zeros, unread


def test_residuals_must_be_arrays_batch_and_heads_first(registry, args):
    def misshapen(*a, residuals=False, **kw):
        outputs = fakes.scan_forward(*a, **kw)
        return (outputs, {"states": jnp.zeros((3,))}) if residuals else outputs

    fakes.register(forward=misshapen, residuals=True)
    q, k, v, g, g_gamma, h0 = args
    with pytest.raises(ContractError, match=r"a residual of shape \(3,\); residuals are \[B, HV, ...\] = \[2, 3, ...\]"):
        jax.grad(lambda q: jnp.sum(sg.forward(q, k, v, g=g)[0]))(q)


def test_explain_says_when_a_forward_hands_its_backward_residuals(registry, args):
    fakes.register(forward=fakes.keeping_forward, backward=fakes.backward_from_states, residuals=True)
    q, k, v, g, g_gamma, h0 = args
    assert "residuals: under grad or vjp fake.scan's backward takes whatever its own forward hands on" in str(sg.explain(q, k, v, g=g))
