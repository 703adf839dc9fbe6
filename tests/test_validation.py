"""docs/ops.md "Invalid input": every broken contract raises ValueError/TypeError naming the argument."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tops_core
from tests import fakes

sg = tops_core.op("simple_gla")
kda = tops_core.op("kda")

q, k, v, g, g_gamma = fakes.inputs(B=2, T=8, H=2, K=4, V=3)
q1, k1, v1 = q[:1], k[:1], v[:1]
f32 = jnp.float32

SIMPLE_GLA_CASES = [
    ("q rank", dict(q=q[0]), ValueError, "q must have rank 4"),
    ("k shape", dict(k=k[..., :2]), ValueError, "k must have shape"),
    ("v batch", dict(v=v[:1]), ValueError, "v must have shape"),
    ("dtype mix", dict(k=k.astype(jnp.bfloat16)), TypeError, "share one dtype"),
    ("integer q", dict(q=q.astype(jnp.int32), k=k.astype(jnp.int32), v=v.astype(jnp.int32)), TypeError, "q must have a floating dtype"),
    ("list q", dict(q=q.tolist()), TypeError, "q must be a jax or numpy array"),
    ("g shape", dict(g=g[:, :4]), ValueError, "g must have shape [B, T, H]"),
    ("integer g", dict(g=jnp.zeros((2, 8, 2), jnp.int32)), TypeError, "g must have a floating dtype"),
    ("g_gamma shape", dict(g_gamma=jnp.zeros((3,))), ValueError, "g_gamma must have shape [H]"),
    ("g_gamma rank", dict(g_gamma=jnp.zeros((2, 2))), ValueError, "g_gamma must have rank 1"),
    ("scale vector", dict(scale=jnp.ones(2)), TypeError, "scale must be a real number, got an array of shape (2,)"),
    ("scale string", dict(scale="0.5"), TypeError, "scale must be a real number"),
    ("g_gamma string", dict(g_gamma="fast"), TypeError, "g_gamma must be a jax or numpy array (or a number or list of numbers)"),
    ("scale bool", dict(scale=True), TypeError, "scale must be a real number"),
    ("h0 shape", dict(initial_state=jnp.zeros((1, 2, 4, 3))), ValueError, "initial_state must have shape [N, H, K, V]"),
    ("final flag", dict(output_final_state="yes"), TypeError, "output_final_state must be a bool"),
    ("cu with B>1", dict(cu_seqlens=jnp.array([0, 8])), ValueError, "cu_seqlens requires B == 1"),
    ("cu float", dict(q=q1, k=k1, v=v1, cu_seqlens=jnp.array([0.0, 8.0])), TypeError, "cu_seqlens must be an int32 or int64"),
    ("cu start", dict(q=q1, k=k1, v=v1, cu_seqlens=jnp.array([1, 8])), ValueError, "cu_seqlens must start at 0"),
    ("cu decreasing", dict(q=q1, k=k1, v=v1, cu_seqlens=jnp.array([0, 5, 3, 8])), ValueError, "non-decreasing"),
    ("cu end", dict(q=q1, k=k1, v=v1, cu_seqlens=jnp.array([0, 7])), ValueError, "cu_seqlens must end at T = 8"),
    ("cu rank", dict(q=q1, k=k1, v=v1, cu_seqlens=jnp.array([[0, 8]])), ValueError, "cu_seqlens must have rank 1"),
    ("cu too short", dict(q=q1, k=k1, v=v1, cu_seqlens=jnp.array([0])), ValueError, "at least 2 boundaries"),
    ("cu empty list", dict(q=q1, k=k1, v=v1, cu_seqlens=[]), ValueError, "cu_seqlens is empty: it must hold the N + 1 >= 2 boundaries"),
    ("cu empty array", dict(q=q1, k=k1, v=v1, cu_seqlens=np.array([])), ValueError, "cu_seqlens is empty"),
    ("integer jax g_gamma", dict(g_gamma=jnp.array([-1, -2])), TypeError, "g_gamma must have a floating dtype"),
    ("integer jax h0", dict(initial_state=jnp.zeros((2, 2, 4, 3), jnp.int32)), TypeError, "initial_state must have a floating dtype"),
    ("h0 N with cu", dict(q=q1, k=k1, v=v1, cu_seqlens=jnp.array([0, 3, 8]), initial_state=jnp.zeros((1, 2, 4, 3))), ValueError, "initial_state must have shape [N, H, K, V] = (2, 2, 4, 3)"),
]


@pytest.mark.parametrize("label, overrides, error, message", SIMPLE_GLA_CASES, ids=[c[0] for c in SIMPLE_GLA_CASES])
def test_simple_gla_rejects_invalid_input(registry, label, overrides, error, message):
    args = dict(q=q, k=k, v=v) | overrides
    with pytest.raises(error) as raised:
        sg.forward(**args)
    assert message in str(raised.value)


def test_invalid_input_is_rejected_before_any_implementation_runs(registry):
    calls = []
    fakes.register(forward=lambda *a, **kw: calls.append(1))
    with pytest.raises(ValueError):
        sg.forward(q, k, v, g=g[:, :4])
    assert calls == []


def test_cu_seqlens_values_are_checked_only_when_concrete(registry):
    """Under jit the boundaries are traced: shape rules still apply, value rules cannot."""
    seen = []
    fakes.register(features=fakes.FEATURES | {"cu_seqlens"},
                   forward=lambda q, k, v, **kw: (seen.append(kw["cu_seqlens"].dtype) or v, None))
    jax.jit(lambda cu: sg.forward(q1, k1, v1, cu_seqlens=cu)[0])(jnp.array([0, 3, 8], jnp.int32))
    assert seen == [jnp.int32]
    with pytest.raises(ValueError, match="cu_seqlens requires B == 1"):
        jax.jit(lambda cu: sg.forward(q, k, v, cu_seqlens=cu)[0])(jnp.array([0, 8]))


def test_numpy_inputs_and_int64_boundaries_are_accepted(registry):
    fakes.register(features=fakes.FEATURES | {"cu_seqlens"})
    o, _ = sg.forward(np.asarray(q1), np.asarray(k1), np.asarray(v1), cu_seqlens=np.array([0, 8], np.int64))
    assert o.shape == v1.shape


def test_backward_checks_cotangents(registry):
    fakes.register()
    with pytest.raises(ValueError, match="do must have shape"):
        sg.backward(q, k, v, v[:, :4])
    with pytest.raises(ValueError, match="dht must have shape"):
        sg.backward(q, k, v, v, dht=jnp.zeros((2, 2, 4, 4)))


def test_nan_inputs_propagate_instead_of_raising(registry):
    fakes.register()
    o, _ = sg.forward(q.at[0, 0, 0, 0].set(jnp.nan), k, v)
    assert bool(jnp.isnan(o[0]).any()) and not bool(jnp.isnan(o[1]).any())


KDA_G = jnp.zeros((2, 8, 2, 4), f32)
KDA_BETA = jnp.full((2, 8, 2), 0.5, f32)
KDA_CASES = [
    ("g shape", dict(g=KDA_G[..., :2]), ValueError, "g must have shape [B, T, HV, K]"),
    ("g missing", dict(g=None), TypeError, "g is required"),
    ("beta shape", dict(beta=KDA_BETA[..., None]), ValueError, "beta must have rank 3"),
    ("beta int", dict(beta=KDA_BETA.astype(jnp.int32)), TypeError, "beta must have a floating dtype"),
    ("l2norm flag", dict(use_qk_l2norm=1), TypeError, "use_qk_l2norm must be a bool"),
    ("cu with B>1", dict(cu_seqlens=jnp.array([0, 8])), ValueError, "cu_seqlens requires B == 1"),
    ("h0 shape", dict(initial_state=jnp.zeros((2, 2, 3, 3))), ValueError, "initial_state must have shape"),
    ("value heads not a multiple", dict(v=jnp.zeros((2, 8, 3, 3), f32)), ValueError, "v has HV = 3 value heads, not a multiple of q's H = 2"),
    ("value heads fewer", dict(v=jnp.zeros((2, 8, 1, 3), f32)), ValueError, "v has HV = 1 value heads, not a multiple of q's H = 2"),
    ("g per query head with grouped values", dict(v=jnp.zeros((2, 8, 4, 3), f32)), ValueError, "g must have shape [B, T, HV, K] = (2, 8, 4, 4)"),
    ("use_gate without A_log", dict(use_gate=True), ValueError, "use_gate=True needs A_log"),
    ("A_log without use_gate", dict(A_log=jnp.zeros(2)), ValueError, "A_log is a parameter of the gate computed in the op: pass use_gate=True"),
    ("dt_bias without use_gate", dict(dt_bias=jnp.zeros(8)), ValueError, "dt_bias is a parameter of the gate computed in the op"),
    ("A_log shape", dict(use_gate=True, A_log=jnp.zeros(4)), ValueError, "A_log must have shape [HV]"),
    ("dt_bias size", dict(use_gate=True, A_log=jnp.zeros(2), dt_bias=jnp.zeros(2)), ValueError, "dt_bias must have shape [HV * K] = [2 * 4]"),
    ("use_gate flag", dict(use_gate=1), TypeError, "use_gate must be a bool"),
    ("lower_bound positive", dict(lower_bound=1.0), ValueError, "lower_bound must be a finite number below 0, got 1.0"),
    ("lower_bound zero", dict(lower_bound=0), ValueError, "lower_bound must be a finite number below 0"),
    ("lower_bound string", dict(lower_bound="-5"), TypeError, "lower_bound must be a real number"),
    ("g below lower_bound", dict(g=KDA_G.at[1, 2, 0, 3].set(-6.0), lower_bound=-5.0), ValueError, "g must lie in [lower_bound, 0] = [-5.0, 0]"),
    ("g above 0 with lower_bound", dict(g=KDA_G.at[0, 0, 0, 0].set(0.5), lower_bound=-5.0), ValueError, "got values in [0.0, 0.5]"),
    ("allow_neg_eigval alone", dict(allow_neg_eigval=True), ValueError, "allow_neg_eigval=True scales sigmoid(beta) to (0, 2) and needs use_beta_sigmoid=True"),
]


@pytest.mark.parametrize("label, overrides, error, message", KDA_CASES, ids=[c[0] for c in KDA_CASES])
def test_kda_rejects_invalid_input(registry, label, overrides, error, message):
    args = dict(q=q, k=k, v=v, g=KDA_G, beta=KDA_BETA) | overrides
    with pytest.raises(error) as raised:
        kda.forward(**args)
    assert message in str(raised.value)


def test_kda_call_spec_names_its_features(registry):
    spec = kda.prepare(q1, k1, v1, KDA_G[:1], KDA_BETA[:1], None, jnp.zeros((2, 2, 4, 3)), True,
                       jnp.array([0, 3, 8]), True, False).spec
    assert spec.op == "kda" and spec.num_seqs == 2
    assert spec.features == {"initial_state", "output_final_state", "cu_seqlens", "use_qk_l2norm"}
    values = jnp.zeros((1, 8, 4, 3), f32)
    spec = kda.prepare(q1, k1, values, jnp.zeros((1, 8, 4, 4)), KDA_BETA[:1].repeat(2, axis=2), None, None, False, None, False, False,
                       use_gate=True, dt_bias=jnp.zeros(16), lower_bound=-5.0, use_beta_sigmoid=True, allow_neg_eigval=True).spec
    assert spec.heads == 2 and spec.value_heads == 4
    assert spec.features == {"grouped_value_heads", "use_gate", "dt_bias", "lower_bound", "use_beta_sigmoid", "allow_neg_eigval"}


def test_lower_bound_must_be_static(registry):
    with pytest.raises(TypeError, match="lower_bound must be a static number"):
        jax.jit(lambda bound: kda.forward(q, k, v, KDA_G, KDA_BETA, lower_bound=bound))(-5.0)


def test_default_scale_is_inverse_sqrt_key_dim():
    prepared = sg.prepare(q, k, v, None, None, None, None, False, None, False)
    assert prepared.option("scale") == pytest.approx(4 ** -0.5)


def test_unknown_op_lists_known_ops():
    with pytest.raises(ValueError, match="known ops: gated_delta_rule, gla, kda, simple_gla"):
        tops_core.op("softmax")


# -- what users reasonably pass ----------------------------------------------------------------


def test_python_numpy_and_concrete_jax_scalars_and_lists_are_accepted(registry):
    fakes.register(features=fakes.FEATURES | {"cu_seqlens"}, priority={"cpu": 10})
    want, _ = sg.forward(q1, k1, v1, g_gamma=jnp.full((), -0.1, f32), scale=0.25)
    for g_gamma, scale in ((-0.1, 0.25), (np.float32(-0.1), np.float32(0.25)), (jnp.float32(-0.1), jnp.float32(0.25))):
        got, _ = sg.forward(q1, k1, v1, g_gamma=g_gamma, scale=scale)
        np.testing.assert_array_equal(got, want)
    per_head, _ = sg.forward(q1, k1, v1, g_gamma=[-0.1, -0.2])
    np.testing.assert_array_equal(per_head, sg.forward(q1, k1, v1, g_gamma=jnp.array([-0.1, -0.2], f32))[0])
    prepared = sg.prepare(q1, k1, v1, None, None, None, None, False, [0, 3, 8], False)
    assert prepared.arrays["cu_seqlens"].dtype == jnp.int32 and prepared.spec.num_seqs == 2


def test_python_numbers_follow_float64_inputs(registry):
    with jax.enable_x64(True):
        x = q1.astype(jnp.float64)
        prepared = sg.prepare(x, x, x, None, -0.1, None, None, False, None, False)
        assert prepared.arrays["g_gamma"].dtype == jnp.float64
        assert sg.prepare(x, x, x, None, [-1, -2], None, None, False, None, False).arrays["g_gamma"].dtype == jnp.float64


@pytest.mark.parametrize("integers", [-1, [-1, -1], np.int64(-1), np.array([-1, -1])], ids=["int", "list", "numpy scalar", "numpy array"])
def test_integer_gates_on_the_host_are_taken_as_floats(registry, integers):
    # docs/ops.md writes g_gamma = -1; an integer jax array stays a TypeError (SIMPLE_GLA_CASES)
    fakes.register(priority={"cpu": 10})
    want, _ = sg.forward(q1, k1, v1, g_gamma=-1.0)
    prepared = sg.prepare(q1, k1, v1, None, integers, None, None, False, None, False)
    assert prepared.arrays["g_gamma"].dtype == f32
    np.testing.assert_array_equal(sg.forward(q1, k1, v1, g_gamma=integers)[0], want)


def test_integer_kda_gates_beta_and_state_on_the_host_are_taken_as_floats(registry):
    zeros = np.zeros((1, 8, 2, 4), np.int64)
    prepared = kda.prepare(q1, k1, v1, zeros, np.ones((1, 8, 2), int), None, np.zeros((1, 2, 4, 3), int), False, None, False, False)
    assert {name: prepared.arrays[name].dtype for name in ("g", "beta", "initial_state")} == dict.fromkeys(("g", "beta", "initial_state"), f32)
    prepared = sg.prepare(q1, k1, v1, zeros[..., 0], None, None, np.zeros((1, 2, 4, 3), int), False, None, False)
    assert prepared.arrays["g"].dtype == prepared.arrays["initial_state"].dtype == f32


def test_a_traced_scale_is_a_clear_error(registry):
    fakes.register()
    with pytest.raises(TypeError, match="scale must be a static number, got a traced value"):
        jax.jit(lambda s: sg.forward(q, k, v, scale=s)[0])(0.5)


def test_head_first_shapes_warn_and_name_the_expected_layout(registry):
    fakes.register()
    head_first = jnp.swapaxes(q, 1, 2)  # [B, H=8, T=2, K]: T < H
    with pytest.warns(tops_core.LayoutWarning, match=r"T = 2 tokens but H = 8 heads. tops expects \[B, T, H, K\]") as caught:
        sg.forward(head_first, head_first, head_first)
    assert caught[0].filename == __file__, "the warning points at the caller's line"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sg.forward(q, k, v)  # T = 8 >= H = 2


def test_decode_steps_and_calls_with_a_state_do_not_warn_about_the_layout(registry):
    fakes.register()
    step = jnp.ones((2, 1, 8, 4), f32)  # [B, T=1, H=8, K]: a decode step
    chunk = jnp.ones((2, 4, 8, 4), f32)  # T = 4 < H = 8, beside a state of H = 8 heads
    state = jnp.zeros((2, 8, 4, 4), f32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sg.forward(step, step, step, g_gamma=-0.1, initial_state=state, output_final_state=True)
        sg.forward(step, step, step, g_gamma=-0.1)  # the first step, without a state yet
        sg.forward(chunk, chunk, chunk, g_gamma=-0.1, initial_state=state)
        kda.prepare(step, step, step, step, jnp.ones((2, 1, 8), f32), None, state, True, None, False, False)
    with pytest.warns(tops_core.LayoutWarning, match="T = 4 tokens but H = 8 heads"):
        kda.prepare(chunk, chunk, chunk, chunk, jnp.ones((2, 4, 8), f32), None, None, True, None, False, False)


# -- cu_seqlens traced under jit -----------------------------------------------------------------

INVALID_BOUNDARIES = {"decreasing": [0, 5, 3, 8], "not from 0": [1, 3, 5, 8], "past T": [0, 3, 5, 9]}


def test_an_implementation_only_ever_sees_valid_traced_boundaries(registry):
    seen = []

    def forward(q, k, v, *, cu_seqlens, **kwargs):
        jax.debug.callback(lambda cu: seen.append(np.asarray(cu).tolist()), cu_seqlens)
        return v, None

    fakes.register(features=fakes.FEATURES | {"cu_seqlens"}, forward=forward)
    run = jax.jit(lambda cu: sg.forward(q1, k1, v1, cu_seqlens=cu)[0])
    assert np.isfinite(run(jnp.array([0, 3, 5, 8]))).all()
    for boundaries in INVALID_BOUNDARIES.values():
        assert np.isnan(run(jnp.array(boundaries))).all()
    jax.effects_barrier()
    assert seen == [[0, 3, 5, 8]] + [[0, 2, 5, 8]] * len(INVALID_BOUNDARIES)  # T = 8 split over N = 3


def _installed_packed_implementations(op_name):
    return [impl.name for impl in tops_core.op(op_name).implementations()
            if "cu_seqlens" in impl.capabilities.features and "cpu" in impl.capabilities.platforms]


@pytest.mark.parametrize("name", _installed_packed_implementations("simple_gla"))
def test_invalid_traced_boundaries_make_every_output_and_gradient_nan(name):
    h0 = jnp.ones((3, 2, 4, 3), f32)

    def outputs(q, g, g_gamma, h0, cu):
        return sg.forward(q, k1, v1, g=g, g_gamma=g_gamma, initial_state=h0, output_final_state=True,
                          cu_seqlens=cu, implementation=name)

    # One compile of each program serves every packing (the boundaries are traced).
    forward = jax.jit(outputs)
    gradients = jax.jit(jax.grad(lambda *a: jnp.sum(outputs(*a)[0]) + jnp.sum(outputs(*a)[1]), argnums=(0, 1, 2, 3)))
    for label, boundaries in INVALID_BOUNDARIES.items():
        arguments = (q1, g[:1], g_gamma, h0, jnp.array(boundaries))
        for result in (*forward(*arguments), *gradients(*arguments)):
            assert np.isnan(np.asarray(result)).all(), label
    valid = forward(q1, g[:1], g_gamma, h0, jnp.array([0, 3, 5, 8]))
    for got, want in zip(valid, outputs(q1, g[:1], g_gamma, h0, [0, 3, 5, 8])):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", _installed_packed_implementations("kda"))
def test_kda_invalid_traced_boundaries_make_every_output_and_gradient_nan(name):
    gates, beta = -jnp.ones((1, 8, 2, 4), f32) / 8, jnp.full((1, 8, 2), 0.5, f32)

    def loss(q, gates, beta, cu):
        o, ht = kda.forward(q, k1, v1, gates, beta, output_final_state=True, cu_seqlens=cu, implementation=name)
        return jnp.sum(o) + jnp.sum(ht)

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q1, gates, beta, jnp.array([0, 5, 3, 8]))
    for result in (value, *grads):
        assert np.isnan(np.asarray(result)).all()
    assert np.isfinite(jax.jit(loss)(q1, gates, beta, jnp.array([0, 3, 5, 8])))


@pytest.mark.parametrize("name", [impl.name for impl in kda.implementations() if "lower_bound" in impl.capabilities.features
                                  and "cpu" in impl.capabilities.platforms])
def test_kda_traced_gates_outside_lower_bound_make_every_output_and_gradient_nan(name):
    beta = jnp.full((1, 8, 2), 0.5, f32)

    def loss(q, gates):
        o, ht = kda.forward(q, k1, v1, gates, beta, output_final_state=True, lower_bound=-1.0, implementation=name)
        return jnp.sum(o) + jnp.sum(ht)

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    inside = -jnp.ones((1, 8, 2, 4), f32) / 8
    for outside in (inside.at[0, 5, 1, 2].set(-1.5), inside.at[0, 0, 0, 0].set(0.25)):
        value, grads = run(q1, outside)
        for result in (value, *grads):
            assert np.isnan(np.asarray(result)).all()
    value, grads = run(q1, inside.at[0, 5, 1, 2].set(-1.0))  # on the bound: valid
    assert np.isfinite(value) and all(np.isfinite(np.asarray(x)).all() for x in grads)
