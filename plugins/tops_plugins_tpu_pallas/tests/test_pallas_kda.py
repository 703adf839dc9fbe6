"""KDA's fused Pallas forward (``tpu_pallas.fused`` for kda), in the fast interpreter and lowered for TPU.

The conformance kit covers the case grid; these tests cover what is particular to this kernel:
the chunk math against direct formulas (the exact inverse, decays of ``g = -10`` that never
overflow), ragged last blocks, chunks per grid step, lane-padded head dimensions, the capability
declaration and the pairing with xla.chunk's backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tops_core
from tops_core.tpu.generations import UNKNOWN_CHIP_VMEM_BUDGET

from tops_plugins_tpu_pallas import traffic
from tops_plugins_tpu_pallas.kda import chunkwise
from tops_plugins_tpu_pallas.kda import fused as kda_fused

kda = tops_core.op("kda")


def run(inputs, use_qk_l2norm=False, **config):
    def call(inputs):
        with tops_core.use(interpret=True, strict=True):
            return kda.forward(**inputs, output_final_state=True, use_qk_l2norm=use_qk_l2norm, implementation=("tpu_pallas.fused", config))

    return jax.jit(call)(inputs)


CASES = {
    # B, T, H, K, V, dtype, inputs, use_qk_l2norm, config
    "in-place-f32-ragged-two-chunks-per-step": ((2, 130, 2, 128, 128), jnp.float32, {}, False, dict(chunk_size=64, num_steps=2)),
    "lane-padded-bf16-l2norm-default-config": ((1, 100, 2, 100, 200), jnp.bfloat16, dict(normalised=False), True, {}),
    "two-value-tiles-f32-ragged": ((1, 100, 2, 128, 256), jnp.float32, {}, False, dict(full_values=False, num_steps=1)),
    "g=-10-C128-ragged": ((1, 200, 1, 128, 128), jnp.float32, dict(gate=-10.0), False, dict(chunk_size=128)),
    "one-token-no-initial-state": ((2, 1, 1, 32, 64), jnp.float32, dict(initial_state=False), False, dict(chunk_size=64)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, make_kda_inputs, kda_reference, assert_matches):
    shape, dtype, given, use_qk_l2norm, config = CASES[case]
    inputs = make_kda_inputs(*shape, dtype, **given)
    o, final_state = run(inputs, use_qk_l2norm, **config)
    o_ref, final_ref = kda_reference(inputs, use_qk_l2norm)
    assert_matches("o", o, o_ref, dtype)
    assert_matches("final_state", final_state, final_ref, dtype)


def test_num_steps_do_not_change_a_bit(make_kda_inputs):
    # 4 chunks of 64, the last ragged: one, two or four chunks per grid step (unrolled, the state
    # carried as a value between them) run the same chunk body.
    inputs = make_kda_inputs(1, 250, 2, 128, 128, jnp.float32, seed=1)
    one = run(inputs, chunk_size=64, num_steps=1)
    for num_steps in (2, 4):
        for got, want in zip(run(inputs, chunk_size=64, num_steps=num_steps), one):
            np.testing.assert_array_equal(got, want)


def _direct_pairs(q, k, g, beta):
    """``Aqk`` and ``(I + diag(beta) Akk)^-1`` from their definitions, in float64 NumPy."""
    b = np.cumsum(g, axis=0)
    C = q.shape[0]
    with np.errstate(over="ignore"):  # exp(b_i - b_j) above the diagonal is never used
        decay = np.exp(np.where(np.tril(np.ones((C, C), bool))[..., None], b[:, None, :] - b[None, :, :], 0.0))
    aqk = np.tril(np.einsum("id,jd,ijd->ij", q, k, decay))
    akk = np.tril(np.einsum("id,jd,ijd->ij", k, k, decay), -1)
    return aqk, np.linalg.inv(np.eye(C) + beta * akk)


@pytest.mark.parametrize("gate", [None, -10.0], ids=["mild", "g=-10"])
@pytest.mark.parametrize("size", [64, 128])
def test_chunk_pairs_and_inverse_match_their_definitions(size, gate):
    rng = np.random.default_rng(size)
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in rng.standard_normal((2, size, 128)))
    g = np.full((size, 128), gate) if gate is not None else -np.logaddexp(0.0, -rng.standard_normal((size, 128))) / 16
    beta = 1 / (1 + np.exp(-rng.standard_normal((size, 1))))
    with jax.debug_infs(True):  # no exp on the way overflows, even where a where() would hide it
        decays = chunkwise.Decays.compute(jnp.asarray(g, jnp.float32))
        pairs = chunkwise.pairs(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(beta, jnp.float32), decays, jnp.float32)
    aqk, inverse = _direct_pairs(q, k, g, beta)
    for name, got, want in (("Aqk", pairs.aqk, aqk), ("inverse", pairs.inverse, inverse)):
        error = np.sqrt(np.mean((np.asarray(got, np.float64) - want) ** 2) / np.mean(want**2))
        assert error < 1e-6, (name, error)
    np.testing.assert_array_equal(np.triu(np.asarray(pairs.inverse), 1), 0)
    np.testing.assert_array_equal(np.diagonal(np.asarray(pairs.inverse)), 1)


def test_decays_near_one_keep_float32_accuracy_under_a_large_cumulative_gate():
    # Half the chunk at g = -10 drives b to -320; the later half's decays between its own tokens
    # (g = -1e-3) must still be exact to float32, which b_i - b_j as a difference would not be.
    g = np.concatenate([np.full((32, 128), -10.0), np.full((32, 128), -1e-3)]).astype(np.float32)
    decays = chunkwise.Decays.compute(jnp.asarray(g))
    later_decay, earlier_decay = decays.levels[0]  # pairs of neighbours: (2m + 1, 2m)
    np.testing.assert_allclose(np.asarray(later_decay)[33::2], np.exp(np.float64(-1e-3)), rtol=2e-7)
    np.testing.assert_array_equal(np.asarray(earlier_decay)[32::2], 1.0)  # an empty run: exp(0)


def _spec(**changes):
    fields = dict(
        op="kda", platform="tpu", dtype="bfloat16", batch=8, seq_len=4096, heads=16, key_dim=128, value_dim=128,
        num_seqs=8, features={"use_qk_l2norm", "initial_state", "output_final_state"},
    )
    return tops_core.CallSpec(**{**fields, **changes})


def test_packed_sequences_are_rejected_with_a_reason():
    fused = next(impl for impl in kda.implementations() if impl.name == "tpu_pallas.fused")
    assert not fused.reasons(_spec(), "forward")
    packed = _spec(batch=1, num_seqs=3, features={"cu_seqlens"})
    assert any("cu_seqlens" in reason for reason in fused.reasons(packed, "forward"))
    assert kda.decide(packed).implementation.name != "tpu_pallas.fused"


def test_explain_pairs_the_forward_with_xla_chunks_backward(make_kda_inputs):
    inputs = make_kda_inputs(1, 64, 2, 128, 128, jnp.bfloat16)
    with tops_core.use(interpret=True):
        text = str(kda.explain(**inputs, output_final_state=True))
    assert "tpu_pallas.fused" in text and "forward-only" in text and "xla.chunk's backward" in text


def test_the_public_op_lowers_to_the_kernel_for_tpu():
    S = jax.ShapeDtypeStruct
    B, T, H, K, V = 2, 200, 3, 100, 128
    shapes = dict(
        q=S((B, T, H, K), jnp.bfloat16), k=S((B, T, H, K), jnp.bfloat16), v=S((B, T, H, V), jnp.bfloat16),
        g=S((B, T, H, K), jnp.float32), beta=S((B, T, H), jnp.float32), initial_state=S((B, H, K, V), jnp.float32),
    )

    def forward(arrays):
        return kda.forward(**arrays, output_final_state=True, use_qk_l2norm=True)

    text = jax.jit(forward).trace(shapes).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1 and "kda_fused" in text


def test_config_names_the_bad_field():
    with pytest.raises(ValueError, match="chunk_size"):
        kda_fused.KdaFusedConfig(chunk_size=32)
    with pytest.raises(TypeError, match="full_values"):
        kda_fused.KdaFusedConfig(full_values=1)


def test_vmem_fitting_walks_fewer_chunks_per_step_for_a_large_key_dim():
    # K = 1024: eight chunks of 64 per step would not fit the budget; the launch takes fewer, and
    # the capability holds. K = 1536 does not fit even one chunk per step.
    geometry = kda_fused.geometry_of(1, 4096, 1, 1024, 128, kda_fused.KdaFusedConfig())
    (plan,) = kda_fused.fitted_plans(geometry, jnp.bfloat16)
    assert traffic.vmem_bytes(kda_fused.plans(geometry, jnp.bfloat16)[0]) > UNKNOWN_CHIP_VMEM_BUDGET
    assert plan.grid[3] > geometry.time_steps and traffic.vmem_bytes(plan) <= UNKNOWN_CHIP_VMEM_BUDGET
    fused = next(impl for impl in kda.implementations() if impl.name == "tpu_pallas.fused")
    assert not fused.reasons(_spec(key_dim=1024), "forward")
    assert any("VMEM" in reason for reason in fused.reasons(_spec(key_dim=1536), "forward"))
