"""SPEC.md "Invalid input": every broken contract raises ValueError/TypeError naming the argument."""

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
    ("scale array", dict(scale=jnp.float32(0.5)), TypeError, "scale must be a real number"),
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
    ("g shape", dict(g=KDA_G[..., :2]), ValueError, "g must have shape [B, T, H, K]"),
    ("g missing", dict(g=None), TypeError, "g is required"),
    ("beta shape", dict(beta=KDA_BETA[..., None]), ValueError, "beta must have rank 3"),
    ("beta int", dict(beta=KDA_BETA.astype(jnp.int32)), TypeError, "beta must have a floating dtype"),
    ("l2norm flag", dict(use_qk_l2norm=1), TypeError, "use_qk_l2norm must be a bool"),
    ("cu with B>1", dict(cu_seqlens=jnp.array([0, 8])), ValueError, "cu_seqlens requires B == 1"),
    ("h0 shape", dict(initial_state=jnp.zeros((2, 2, 3, 3))), ValueError, "initial_state must have shape"),
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


def test_default_scale_is_inverse_sqrt_key_dim():
    prepared = sg.prepare(q, k, v, None, None, None, None, False, None, False)
    assert prepared.option("scale") == pytest.approx(4 ** -0.5)


def test_unknown_op_lists_known_ops():
    with pytest.raises(ValueError, match="known ops: kda, simple_gla"):
        tops_core.op("softmax")
