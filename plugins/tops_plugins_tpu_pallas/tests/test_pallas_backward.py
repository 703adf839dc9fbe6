"""What is particular to the two backward kernels, in the fast interpreter.

Every gradient over the whole case grid comes from the shared conformance kit; these tests cover
the pairing on TPU and the rule between the kernels, strong decays (``g_gamma = -1`` at chunk 128,
ALiBi-style decays of 20 layers), ``num_steps``, and the reverse walk made with index maps rather
than flipped copies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tops_core
from tops_core.cli import main
from tops_core.conformance.compare import measure, tolerance

KERNELS = ["fused", "chunk"]
sg = tops_core.op("simple_gla")


def gradients(kernel, inputs, do, dht, compiler_options=None, **config):
    """Every gradient through the public op, forced to ``tpu_pallas.<kernel>`` with config overrides, in the interpreter
    (compiled with ``compiler_options``).

    ``num_steps`` sets the fused backward's segment too (``backward_num_steps``), or its default of
    4096 tokens would make every sequence here one segment.
    """
    if kernel == "fused" and "num_steps" in config:
        config.setdefault("backward_num_steps", config["num_steps"])

    def call(inputs):
        with tops_core.use(interpret=True, strict=True):
            _, vjp = jax.vjp(
                lambda a: sg.forward(**a, output_final_state=True, implementation=(f"tpu_pallas.{kernel}", config)), inputs
            )
            return vjp((do, dht))[0]

    return jax.jit(call, compiler_options=compiler_options)(inputs)


def cotangents(inputs, seed=7):
    rng = np.random.default_rng(seed)
    B, T, H, K = inputs["q"].shape
    V = inputs["v"].shape[-1]
    do = jnp.asarray(rng.standard_normal((B, T, H, V)), inputs["v"].dtype)
    return do, jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32)


def assert_gradients_match(grads, ref_grads, dtype):
    for name, want in ref_grads.items():
        measurement = measure(f"d{name}", grads[name], want, tolerance(jnp.dtype(dtype).name, gradient=True))
        assert measurement.passed, measurement.describe()


@pytest.mark.parametrize(("shape", "kernel", "backward"), [
    ((8, 4096, 16, 128, 128), "fused", "tpu_pallas.fused"),  # 128 (batch, head) pairs fill every core: fused both ways
    ((1, 8192, 1, 128, 128), "chunk", "tpu_pallas.chunk"),  # one long sequence: the split backward's dq/dk pass is parallel over time
])
def test_explain_pairs_each_forward_with_its_own_backward_on_tpu(shape, kernel, backward, capsys):
    assert main(["explain", "simple_gla", "--shape", ",".join(map(str, shape)), "--with", "g_gamma", "--platform", "tpu"]) == 0
    text = capsys.readouterr().out
    forward_text, backward_text = text.split("simple_gla backward:")
    assert f"selected: tpu_pallas.{kernel} with" in forward_text
    assert f"selected: {backward} with" in backward_text
    assert "B*H*value blocks" in backward_text  # the rule and its reasons rank the backward kernels too
    assert "pairing:" not in text


@pytest.mark.parametrize("kernel", KERNELS)
def test_strong_constant_decay_at_chunk_128(kernel, make_inputs, reference_gradients):
    # g_gamma = -1: exp(b_i - b_j) above the diagonal of a 128 chunk would be exp(127); masked before exp.
    inputs, ref_inputs = make_inputs(1, 200, 2, 128, 128, jnp.bfloat16, g_gamma=-1.0, initial_state=True, seed=3)
    do, dht = cotangents(inputs)
    grads = gradients(kernel, inputs, do, dht, chunk_size=128, num_steps=2)
    assert all(np.isfinite(np.asarray(x, np.float64)).all() for x in jax.tree.leaves(grads))
    assert_gradients_match(grads, reference_gradients(ref_inputs, do, dht), jnp.bfloat16)


@pytest.mark.parametrize("kernel", [k if k == "fused" else pytest.param(k, marks=pytest.mark.slow) for k in KERNELS])  # 8 s each
def test_alibi_decays_of_twenty_layers(kernel, make_inputs, reference_gradients, alibi_layers):
    # Reduced: the strongest head of each of 20 layers at T = 256, two chunks (the slow test runs every head at T = 4096).
    g_gamma = alibi_layers(8, 20).reshape(20, 8)[:, 0]
    inputs, ref_inputs = make_inputs(1, 256, 20, 128, 128, jnp.bfloat16, g_gamma=g_gamma, seed=4)
    do, dht = cotangents(inputs)
    grads = gradients(kernel, inputs, do, dht, chunk_size=128)
    assert all(np.isfinite(np.asarray(x, np.float64)).all() for x in jax.tree.leaves(grads))
    assert_gradients_match(grads, reference_gradients(ref_inputs, do, dht), jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_alibi_decays_of_twenty_layers_at_4096(kernel, make_inputs, alibi_layers, optimised_cpu_code):
    # 20 layers x 8 heads of ALiBi decays at T = 4096, chunk 128, bf16: no NaN or Inf in any gradient.
    inputs, _ = make_inputs(1, 4096, 160, 128, 128, jnp.bfloat16, g_gamma=alibi_layers(8, 20), seed=5)
    do, dht = cotangents(inputs)
    grads = gradients(kernel, inputs, do, dht, optimised_cpu_code, chunk_size=128)
    for name, x in grads.items():
        assert np.isfinite(np.asarray(x, np.float64)).all(), name


@pytest.mark.parametrize("kernel", [k if k == "fused" else pytest.param(k, marks=pytest.mark.slow) for k in KERNELS])  # chunk's: 9 s
def test_num_steps_do_not_change_a_bit(kernel, make_inputs, default_cpu_emitters):
    # 5 chunks of 64, the last one ragged: 1 or 3 chunks per grid step (two steps, the second's last chunk past the end)
    # give the same gradients bit for bit.
    inputs, _ = make_inputs(1, 300, 2, 128, 128, jnp.float32, g=True, g_gamma="alibi", initial_state=True, seed=6)
    do, dht = cotangents(inputs)
    one = gradients(kernel, inputs, do, dht, default_cpu_emitters, chunk_size=64, num_steps=1)
    for name, x in gradients(kernel, inputs, do, dht, default_cpu_emitters, chunk_size=64, num_steps=3).items():
        np.testing.assert_array_equal(x, one[name], err_msg=name)


@pytest.mark.parametrize("kernel", KERNELS)
def test_reverse_walk_copies_nothing(kernel):
    # The reverse time axis is an index map: no rev (jnp.flip) anywhere in the differentiated program.
    q = jax.ShapeDtypeStruct((1, 300, 2, 128), jnp.bfloat16)

    def loss(q, g_gamma):
        with tops_core.use(interpret=True, strict=True):
            return jnp.sum(sg.forward(q, q, q, g_gamma=g_gamma, implementation=f"tpu_pallas.{kernel}")[0].astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(q, jax.ShapeDtypeStruct((2,), jnp.float32))
    text = str(jaxpr)
    assert "pallas_call" in text and " rev[" not in text and "rev(" not in text
