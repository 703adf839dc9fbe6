"""tops_core.tpu.fast_paths: a kernel's data-dependent fast path, its gradients, and the arm the cost model assumes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from tops_core.tpu import fast_paths


def fast(operands, constants):
    x, y = operands
    return jnp.sin(x) * y + constants


def general(operands, constants):
    x, y = operands
    return jnp.cos(x) * y * y - constants


def chosen(x, y, constant):
    return fast_paths.choose(jnp.all(x > 0), fast, general, (x, y), constant)


@pytest.mark.parametrize("sign, arm", [(1.0, fast), (-1.0, general)])
def test_the_data_choose_the_arm_and_its_gradients(sign, arm):
    x = sign * jnp.linspace(0.5, 1.5, 8)
    y, constant = jnp.linspace(-1.0, 1.0, 8), jnp.float32(0.25)
    np.testing.assert_allclose(jax.jit(chosen)(x, y, constant), arm((x, y), constant))
    got = jax.jit(jax.grad(lambda x, y: jnp.sum(chosen(x, y, constant) ** 2), argnums=(0, 1)))(x, y)
    want = jax.grad(lambda x, y: jnp.sum(arm((x, y), constant) ** 2), argnums=(0, 1))(x, y)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def test_the_choice_and_its_gradients_inside_a_pallas_kernel():
    """As a kernel's backward takes it: ``jax.vjp`` inside the kernel body, in the interpreter."""

    def kernel(x_ref, y_ref, o_ref, dx_ref, dy_ref):
        x, y = x_ref[...], y_ref[...]
        out, pullback = jax.vjp(lambda x, y: chosen(x, y, jnp.float32(0.25)), x, y)
        o_ref[...] = out
        dx_ref[...], dy_ref[...] = pullback(jnp.ones_like(out))

    shape = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    for sign, arm in ((1.0, fast), (-1.0, general)):
        x = sign * jnp.linspace(0.5, 1.5, 8 * 128).reshape(8, 128)
        y = jnp.linspace(-1.0, 1.0, 8 * 128).reshape(8, 128)
        o, dx, dy = pl.pallas_call(kernel, out_shape=(shape, shape, shape), interpret=True)(x, y)
        want, pullback = jax.vjp(lambda x, y: arm((x, y), jnp.float32(0.25)), x, y)
        np.testing.assert_allclose(o, want, rtol=1e-6)
        for got, expected in zip((dx, dy), pullback(jnp.ones_like(want))):
            np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("assumed, arm", [(fast_paths.FAST, fast), (fast_paths.GENERAL, general)])
def test_the_cost_model_traces_the_arm_it_assumes_alone_whatever_the_data(assumed, arm):
    # Fresh functions: jax reuses a function's earlier trace, made under another assumption (the model clears its caches).
    x, y, constant = jnp.linspace(-1.0, 1.0, 8), jnp.ones(8), jnp.float32(0.5)
    with fast_paths.assume(assumed), fast_paths.recording() as choices:
        jaxpr = jax.make_jaxpr(lambda *a: chosen(*a))(x, y, constant)
        np.testing.assert_allclose(jax.jit(lambda *a: chosen(*a))(x, y, constant), arm((x, y), constant))
    assert "cond" not in str(jaxpr)
    assert choices
    with fast_paths.recording() as choices:
        assert "cond" in str(jax.make_jaxpr(lambda *a: chosen(*a))(x, y, constant))
    assert choices


def test_nothing_is_recorded_without_a_choice_and_an_unknown_arm_is_refused():
    with fast_paths.recording() as choices:
        jax.make_jaxpr(jnp.sin)(1.0)
    assert not choices
    with pytest.raises(ValueError, match="arm must be 'fast' or 'general', got 'both'"):
        with fast_paths.assume("both"):
            pass
