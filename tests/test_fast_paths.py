"""tops_core.tpu.fast_paths: a kernel's data-dependent fast path, taken with whatever its arms close over, and the arm the
cost model assumes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from tops_core.tpu import fast_paths


def fast(x, y):
    return jnp.sin(x) * y


def general(x, y):
    return jnp.cos(x) * y * y


def chosen(x, y):
    return fast_paths.choose(jnp.all(x > 0), lambda: fast(x, y), lambda: general(x, y))


@pytest.mark.parametrize("sign, arm", [(1.0, fast), (-1.0, general)])
def test_the_data_choose_the_arm(sign, arm):
    x, y = sign * jnp.linspace(0.5, 1.5, 8), jnp.linspace(-1.0, 1.0, 8)
    np.testing.assert_allclose(jax.jit(chosen)(x, y), arm(x, y))


def test_each_arm_takes_its_own_gradients_inside_a_pallas_kernel():
    """As a backward kernel's step takes them: the choice around ``jax.vjp``, the arms reading refs, in the interpreter."""

    def kernel(x_ref, y_ref, dx_ref, dy_ref):
        x = x_ref[...]

        def gradients(arm):
            def step():
                out, pullback = jax.vjp(arm, x, y_ref[...])
                return pullback(jnp.ones_like(out))

            return step

        dx_ref[...], dy_ref[...] = fast_paths.choose(jnp.all(x > 0), gradients(fast), gradients(general))

    shape = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    for sign, arm in ((1.0, fast), (-1.0, general)):
        x = sign * jnp.linspace(0.5, 1.5, 8 * 128).reshape(8, 128)
        y = jnp.linspace(-1.0, 1.0, 8 * 128).reshape(8, 128)
        dx, dy = pl.pallas_call(kernel, out_shape=(shape, shape), interpret=True)(x, y)
        want, pullback = jax.vjp(arm, x, y)
        for got, expected in zip((dx, dy), pullback(jnp.ones_like(want))):
            np.testing.assert_allclose(got, expected, rtol=1e-6)


def nested(x, y):
    """A general side holding a choice of its own, its fast arm named apart."""
    return fast_paths.choose(
        jnp.all(x > 0), lambda: fast(x, y),
        lambda: fast_paths.choose(jnp.all(x < 0), lambda: -fast(x, y), lambda: general(x, y), arm="negative"),
    )


@pytest.mark.parametrize("assumed, arm", [
    (fast_paths.FAST, fast), ("negative", lambda x, y: -fast(x, y)), (fast_paths.GENERAL, general), ("unknown", general),
])
def test_the_cost_model_traces_the_arm_it_assumes_alone_whatever_the_data(assumed, arm):
    # Fresh functions: jax reuses a function's earlier trace, made under another assumption (the model clears its caches).
    x, y = jnp.linspace(-1.0, 1.0, 8), jnp.ones(8)
    with fast_paths.assume(assumed):
        jaxpr = jax.make_jaxpr(lambda *a: nested(*a))(x, y)
        np.testing.assert_allclose(jax.jit(lambda *a: nested(*a))(x, y), arm(x, y))
    assert "cond" not in str(jaxpr)
    with fast_paths.recording() as choices:
        assert "cond" in str(jax.make_jaxpr(lambda *a: nested(*a))(x, y))
    assert choices == [fast_paths.FAST, "negative"]


@pytest.mark.parametrize("sign, want", [(1.0, fast), (-1.0, lambda x, y: -fast(x, y)), (0.0, general)])
def test_nested_choices_take_the_first_arm_the_data_allow(sign, want):
    x, y = sign * jnp.linspace(0.5, 1.5, 8), jnp.linspace(-1.0, 1.0, 8)
    np.testing.assert_allclose(jax.jit(nested)(x, y), want(x, y))


def test_nothing_is_recorded_without_a_choice_and_an_arm_needs_a_name_of_its_own():
    with fast_paths.recording() as choices:
        jax.make_jaxpr(jnp.sin)(1.0)
    assert not choices
    with pytest.raises(ValueError, match="a fast arm cannot be named 'general'"):
        fast_paths.choose(jnp.bool_(True), lambda: 1.0, lambda: 2.0, arm=fast_paths.GENERAL)
    with pytest.raises(TypeError, match="arm must be an arm's name or 'general', got 1"):
        with fast_paths.assume(1):
            pass
