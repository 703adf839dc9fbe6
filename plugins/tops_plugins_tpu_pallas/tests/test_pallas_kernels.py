"""Plugin-specific behaviour of tpu_pallas.fused and tpu_pallas.chunk, in the fast interpreter.

Correctness over the whole case grid comes from the shared conformance kit; these tests cover
what is particular to these kernels: the caller's arrays read in place, ragged last blocks (the
fast interpreter reads NaN past an array's end), chunks per grid step, the lane padding copy,
strong decays at chunk 128, the priority rule, Mosaic lowering and the configs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tops_core
from jax.extend import core as extend_core

from tops_core.conformance import checks
from tops_core.conformance.cases import grid
from tops_core.conformance.compare import measure, tolerance
from tops_core.tpu import fast_paths
from tops_plugins_tpu_pallas import CHUNK, FUSED, launch, mxu, traffic
from tops_plugins_tpu_pallas.gated_delta_rule import chunkwise as gdn_chunkwise
from tops_plugins_tpu_pallas.kda import chunkwise as kda_chunkwise
from tops_plugins_tpu_pallas.simple_gla import backward_fused, chunk, chunkwise, fused, gradients
from tops_plugins_tpu_pallas.simple_gla.chunk import ChunkConfig
from tops_plugins_tpu_pallas.simple_gla.fused import FusedConfig
from tops_plugins_tpu_pallas.layout import Geometry
from tops_plugins_tpu_pallas.simple_gla.varlen import VarlenConfig

KERNELS = ["fused", "chunk"]
sg = tops_core.op("simple_gla")


def run(kernel, inputs, output_final_state=True, compiler_options=None, **config):
    """The forward through the public API, forced to ``tpu_pallas.<kernel>`` with config overrides, in the interpreter
    (compiled with ``compiler_options``)."""

    def call(inputs):
        with tops_core.use(interpret=True, strict=True):
            return sg.forward(**inputs, output_final_state=output_final_state, implementation=(f"tpu_pallas.{kernel}", config))

    return jax.jit(call, compiler_options=compiler_options)(inputs)


NUM_STEPS_SHAPE = (1, 300, 2, 128, 128)  # B, T, H, K, V: read in place; 5 chunks of 64, the last one ragged


@pytest.fixture(scope="module")
def num_steps_runs(make_inputs, default_cpu_emitters):
    """``(result(kernel, num_steps), reference inputs)``; results are computed once per (kernel, num_steps), with
    XLA's default CPU emitters (they are compared bit for bit)."""
    inputs, ref_inputs = make_inputs(*NUM_STEPS_SHAPE, jnp.float32, g=True, g_gamma="alibi", initial_state=True)
    results = {}

    def result(kernel, num_steps):
        if (kernel, num_steps) not in results:
            results[kernel, num_steps] = run(kernel, inputs, compiler_options=default_cpu_emitters, chunk_size=64, num_steps=num_steps)
        return results[kernel, num_steps]

    return result, ref_inputs


@pytest.mark.parametrize("kernel", KERNELS)
def test_one_chunk_per_step_matches_reference(kernel, num_steps_runs, reference, assert_matches):
    result, ref_inputs = num_steps_runs
    o, final_state = result(kernel, 1)
    o_ref, final_ref = reference(ref_inputs)
    assert_matches("o", o, o_ref, jnp.float32)
    assert_matches("final_state", final_state, final_ref, jnp.float32)


@pytest.mark.parametrize(("num_chunks", "num_steps", "chunks_per_step"), [
    (37, 32, 19),  # prime: two steps of 19, the second's last chunk past the end
    (72, 16, 12),  # a divisor more than half the even share (15): no chunk past the end
    (5, 2, 2),
])
def test_a_grid_step_walks_a_good_divisor_or_an_even_share(num_chunks, num_steps, chunks_per_step):
    geometry = Geometry(1, num_chunks * 64 - 10, 1, 128, 128, 64, num_steps)
    assert geometry.chunks_per_step == chunks_per_step
    assert geometry.num_chunks <= geometry.grid_chunks < geometry.num_chunks + geometry.time_steps


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("num_steps", "chunks_per_step"), [(2, 2), (3, 3), (5, 5)])
def test_num_steps_do_not_change_a_bit(kernel, num_steps, chunks_per_step, num_steps_runs):
    # 5 chunks at 2 per step: three steps, the last holding the ragged chunk and one past the end; at 3: two steps, the
    # second's chunks whole, ragged and past the end.
    assert Geometry(*NUM_STEPS_SHAPE, 64, num_steps).chunks_per_step == chunks_per_step
    result, _ = num_steps_runs
    for got, want in zip(result(kernel, num_steps), result(kernel, 1)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("gates", [dict(g=True, g_gamma="alibi"), dict(g=False, g_gamma="alibi")], ids=["g", "g_gamma"])
def test_the_attention_schedule_does_not_change_a_bit(gates, make_inputs):
    # The same operations traced in another order: the kernel's results are identical, bit for bit.
    inputs, _ = make_inputs(*NUM_STEPS_SHAPE, jnp.float32, initial_state=True, seed=2, **gates)
    ahead = run("fused", inputs, chunk_size=64, num_steps=4, attention_first=True)
    beside = run("fused", inputs, chunk_size=64, num_steps=4, attention_first=False)
    for got, want in zip(ahead, beside):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("strong", "chunk_size"), [  # 256: v6e's forward chunk; the other pairs with -m slow
    (False, 128), pytest.param(True, 128, marks=pytest.mark.slow), pytest.param(False, 256, marks=pytest.mark.slow), (True, 256),
], ids=["alibi-128", "strong-128", "alibi-256", "strong-256"])
def test_float32_at_three_bf16_passes_keeps_the_float32_tolerance(strong, chunk_size, make_inputs, reference, assert_matches):
    # float32_precision="high": each float32 operand as two bf16 parts, three MXU passes per product
    # instead of six. Measured here about 6e-6 relative RMS for o (tolerance 1e-5; "highest": 3e-7).
    gates = dict(g=True, g_gamma=-1.0 if strong else "alibi")
    inputs, ref_inputs = make_inputs(1, 300, 2, 128, 128, jnp.float32, initial_state=True, seed=3, **gates)
    o, final_state = run("fused", inputs, float32_precision="high", chunk_size=chunk_size)
    o_ref, final_ref = reference(ref_inputs)
    assert_matches("o", o, o_ref, jnp.float32)
    assert_matches("final_state", final_state, final_ref, jnp.float32)
    highest, _ = run("fused", inputs)
    assert not np.array_equal(np.asarray(o), np.asarray(highest))  # the option reaches the kernel


@pytest.mark.parametrize(
    ("dtype", "key_dim", "chip", "ahead"),
    [
        ("bfloat16", 256, "v6e", True), ("bfloat16", 512, "v6e", True), ("bfloat16", 128, "v6e", False),
        ("bfloat16", 256, "v5e", False), ("bfloat16", 256, None, False), ("float32", 256, "v6e", False),
    ],
)
def test_attention_goes_ahead_of_the_chain_where_the_schedule_measured_it_faster(dtype, key_dim, chip, ahead):
    assert fused.attention_first(FusedConfig(), dtype, key_dim, chip) is ahead
    assert fused.attention_first(FusedConfig(attention_first=not ahead), dtype, key_dim, chip) is (not ahead)
    assert not fused.attention_first(FusedConfig(chunk_size=256), dtype, key_dim, chip)  # beside wins at chunk 256


@pytest.mark.parametrize(
    ("key_dim", "chip", "chunk_size"),
    [(128, "v6e", 256), (64, "v6e", 256), (256, "v6e", 128), (128, "v5e", 128), (128, "v4", 128), (128, None, 128)],
)
def test_the_forward_chunk_is_the_chips_where_the_schedule_measured_it_faster(key_dim, chip, chunk_size):
    assert fused.chunk_size_for(FusedConfig(), key_dim, chip) == chunk_size
    assert fused.resolved(FusedConfig(), key_dim, chip) == FusedConfig(chunk_size=chunk_size)
    assert fused.chunk_size_for(FusedConfig(chunk_size=64), key_dim, chip) == 64
    # The backward keeps chunks of 128 unless told (chunk 256 is slower there on every chip modelled).
    assert backward_fused.geometry_of(1, 4096, 1, key_dim, key_dim, FusedConfig()).chunk_size == 128
    assert backward_fused.geometry_of(1, 4096, 1, key_dim, key_dim, FusedConfig(chunk_size=256)).chunk_size == 256


def test_explain_says_how_the_fused_backward_splits_the_sequence():
    # B=8 T=4096 H=16 K=V=128: one 4096-token segment where the chip's VMEM holds it, two of 2048 within 16 MiB.
    on_v6e = FUSED.explain_config(FusedConfig(), dataclasses.replace(_spec(8, 16, 128), chip="v6e"), "backward")
    assert on_v6e.endswith("segments of 4096 tokens: one, no checkpoints walk"), on_v6e
    unknown = FUSED.explain_config(FusedConfig(), _spec(8, 16, 128), "backward")
    assert unknown.endswith("segments of 2048 tokens: 2, the checkpoints walk over the first 1"), unknown


@pytest.mark.parametrize(("chip", "forward"), [
    ("v6e", "chunk_size=256 (None: 256 on a 256-wide MXU when K <= 128, else 128; v6e), attention beside the state chain"),
    ("v5e", "chunk_size=128 (None: 256 on a 256-wide MXU when K <= 128, else 128; v5e), attention beside the state chain"),
    (None, "chunk_size=128 (None: 256 on a 256-wide MXU when K <= 128, else 128; chip not known), attention beside"),
])
def test_explain_says_which_chunk_the_fused_kernel_runs_for_the_chip(chip, forward):
    spec = dataclasses.replace(_spec(8, 16, 128), chip=chip)
    lines = sg.decide(spec).explain().splitlines()
    assert "  selected: tpu_pallas.fused with FusedConfig(chunk_size=None," in "\n".join(lines)
    assert any(line.startswith(f"  for this call: {forward}") for line in lines)
    backward = sg.decide(spec, "backward").explain().splitlines()
    assert any(line.startswith("  for this call: chunk_size=128 (None: the backward's, on every chip); segments of") for line in backward)
    told = FUSED.explain_config(FusedConfig(chunk_size=64, attention_first=True), spec, "forward")
    assert told.startswith("chunk_size=64, attention ahead of the state chain; 64 chunks in "), told


def test_explain_says_where_a_grid_runs_past_the_end():
    # T = 4736 on v5e: 37 chunks of 128, 32 per step at most: two steps of 19 both ways, one chunk past the end.
    spec = dataclasses.replace(_spec(2, 8, 128), seq_len=4736, chip="v5e")
    forward = FUSED.explain_config(FusedConfig(), spec, "forward")
    assert forward.endswith("; 37 chunks in 2 grid steps of 19, 1 past the end"), forward
    backward = FUSED.explain_config(FusedConfig(), spec, "backward")
    assert backward.endswith("segments of 2432 tokens: 2, the checkpoints walk over the first 1, 1 chunk of the last past the end"), backward


# Both kernels pad K = 100 and V = 256 by default; the other way round, tpu_pallas.chunk with -m slow (the kit's edge
# cases pad K = V = 100 for both).
@pytest.mark.parametrize(("kernel", "key_dim", "value_dim"), [
    ("fused", 100, 256), ("chunk", 100, 256), ("fused", 256, 100), pytest.param("chunk", 256, 100, marks=pytest.mark.slow),
])
def test_head_dims_through_the_lane_padding_copy(kernel, key_dim, value_dim, make_inputs, reference, assert_matches):
    # The dimension that is not a multiple of 128 goes through the padding copy, the other is read
    # in place; 256 is two value tiles (V) or a K of two lane tiles in every block; T = 100 is ragged.
    inputs, ref_inputs = make_inputs(1, 100, 2, key_dim, value_dim, jnp.float32, g=True, g_gamma="alibi", initial_state=True, seed=1)
    o, final_state = run(kernel, inputs, chunk_size=64)
    o_ref, final_ref = reference(ref_inputs)
    assert_matches("o", o, o_ref, jnp.float32)
    assert_matches("final_state", final_state, final_ref, jnp.float32)


@pytest.mark.parametrize("kernel", KERNELS)
def test_strong_decay_at_chunk_128(kernel, make_inputs, reference, assert_matches):
    # g = g_gamma = -1: inside a chunk of 128 the cumulative gate spans 256, far beyond exp's float32
    # range; T = 200 leaves 56 rows past the end of the last block, NaN in the interpreter.
    inputs, ref_inputs = make_inputs(1, 200, 2, 128, 128, jnp.float32, g=-1.0, g_gamma=-1.0, initial_state=True, seed=2)
    o, final_state = run(kernel, inputs, chunk_size=128)
    o_ref, final_ref = reference(ref_inputs)
    assert_matches("o", o, o_ref, jnp.float32)
    assert_matches("final_state", final_state, final_ref, jnp.float32)


@pytest.mark.parametrize("size", [128, 256])
def test_chunk_math_never_exponentiates_an_overflow(size):
    # The kernels' where() hides an inf above the diagonal from the result, so check the chunk math
    # itself, op by op: exp must never produce an inf (on TPU a masked inf can turn into NaN).
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((size, 128)), jnp.float32) for _ in range(2))
    v, state = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((size, 128), (128, 128)))
    with jax.debug_infs(True):
        gates = chunkwise.ChunkGates.compute(jnp.float32(-1.0), jnp.full((size, 1), -1.0, jnp.float32), None, size)
        o = chunkwise.chunk_output(q, k, v, state, gates, 0.1)
        new_state = chunkwise.advance_state(state, k, v, gates)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(new_state)).all()


def _random_gates(size, seed=0):
    g = jnp.asarray(-np.random.default_rng(seed).exponential(0.05, (size, 1)), jnp.float32)
    return chunkwise.ChunkGates.compute(jnp.float32(-0.01), g, None, size)


@pytest.mark.parametrize("size", [64, 128, 256])
def test_decays_built_by_blocks_are_the_masked_exp_bit_for_bit(size):
    # causal_decays skips the blocks above the diagonal and the mask below it; the plain formula,
    # every (i, j) exponentiated and masked, must give the same bits, and 0 above the diagonal.
    g = jnp.asarray(np.random.default_rng(1).standard_normal((size, 1)), jnp.float32)  # both signs
    log = chunkwise.LogDecays.compute(jnp.float32(-0.01), g, None, size)
    rows, cols = np.indices((size, size))
    causal = jnp.asarray(rows >= cols)
    plain = jnp.where(causal, jnp.exp(jnp.where(causal, log.column - log.row, 0.0)), 0.0)
    np.testing.assert_array_equal(chunkwise.causal_decays(log), plain)


def test_the_key_row_is_the_key_column_bit_for_bit():
    gates = _random_gates(256)
    np.testing.assert_array_equal(gates.key_row, gates.key.T)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_transposed_keys_give_the_same_chunk_math(dtype):
    # fused.gates_along_lanes: k^T once per chunk for the scores and the state, decayed by the decay
    # matrix's last row: the same products of the same operands as k's column path, only summed in
    # another order by the backend (here about 1e-7 of the state).
    size = 256
    gates = _random_gates(size, seed=2)
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((size, 128)), dtype) for _ in range(3))
    state = jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)
    close = dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        chunkwise.decayed_scores(q, k.T, gates, keys_transposed=True), chunkwise.decayed_scores(q, k, gates), **close
    )
    np.testing.assert_allclose(
        chunkwise.advance_state(state, k.T, v, gates, keys_transposed=True), chunkwise.advance_state(state, k, v, gates), **close
    )


@pytest.mark.parametrize("valid_rows", [None, 200])
def test_gates_along_lanes_are_the_column_gates(valid_rows):
    # ChunkGates.along_lanes (g as a row, the fused forward's with g at chunk 256) against ChunkGates.compute
    # (g as a column): the same cumulative sums up to the order the three bf16 parts are added in.
    size = 256
    g = -np.random.default_rng(5).exponential(0.05, size).astype(np.float32)
    if valid_rows is not None:
        g[valid_rows:] = 0.0  # as Chunk.head_row and Chunk.head_column read a ragged chunk
    valid = None if valid_rows is None else jnp.int32(valid_rows)
    decay = jnp.float32(-0.01)
    rows = chunkwise.ChunkGates.along_lanes(decay, jnp.asarray(g)[None, :], [valid])[0].with_decays()
    columns = chunkwise.ChunkGates.compute(decay, jnp.asarray(g)[:, None], valid, size)
    close = dict(rtol=1e-6, atol=0)
    for name in ("decays", "query", "chunk"):
        np.testing.assert_allclose(getattr(rows, name), getattr(columns, name), err_msg=name, **close)
    np.testing.assert_allclose(rows.key_row, columns.key.T, **close)
    assert rows.key is None
    b = np.cumsum(g.astype(np.float64)) - 0.01 * np.minimum(np.arange(1, size + 1), valid_rows or size)
    np.testing.assert_allclose(rows.query[:, 0], np.exp(b), rtol=3e-6)  # float32 b, |b| up to 14: ~1e-6 of exp


@pytest.mark.parametrize(("attention", "key_column"), [(True, False), (True, True), (False, False)], ids=["forward", "backward", "walk"])
def test_a_steps_gates_at_once_are_each_chunks_gates_alone(attention, key_column):
    # The kernels compute every chunk's gates of a grid step in one go (ChunkGates.along_lanes of (n, C) rows): three
    # chunks of 128 here, as a padded grid's last step holds them: whole, ragged and past the end, so the stacks are
    # padded to whole tiles; each must be what it is alone.
    size, valid_rows = 128, 77
    g = np.where(np.random.default_rng(6).random((3, size)) < 0.02, -np.inf, -np.random.default_rng(7).exponential(0.05, (3, size)))
    g = g.astype(np.float32)
    g[1, valid_rows:] = 0.0
    g[2] = 0.0
    decay, valid = jnp.float32(-0.01), [None, jnp.int32(valid_rows), jnp.int32(0)]
    together = chunkwise.ChunkGates.along_lanes(decay, jnp.asarray(g), valid, attention=attention, key_column=key_column)
    assert len(together) == 3
    for index, gates in enumerate(together):
        (alone,) = chunkwise.ChunkGates.along_lanes(
            decay, jnp.asarray(g[index : index + 1]), valid[index : index + 1], attention=attention, key_column=key_column,
        )
        gates, alone = gates.with_decays(), alone.with_decays()
        for name in ("decays", "query", "key", "chunk", "walk_keys"):
            got, want = getattr(gates, name), getattr(alone, name)
            assert (got is None) == (want is None), name
            if want is not None:
                np.testing.assert_array_equal(got, want, err_msg=f"chunk {index}: {name}")
        if not attention:  # a walk's log decays as rows (the packed backward's checkpoints add terms of their own)
            np.testing.assert_array_equal(gates.log.row, alone.log.row, err_msg=f"chunk {index}: log")
            np.testing.assert_array_equal(gates.log.resets_row, alone.log.resets_row, err_msg=f"chunk {index}: resets")


def test_gates_go_along_lanes_with_per_token_gates_from_chunk_128():
    assert fused.gates_along_lanes(gated=True, chunk_size=256)
    assert fused.gates_along_lanes(gated=True, chunk_size=128)
    assert not fused.gates_along_lanes(gated=False, chunk_size=256)  # g_gamma: gates once per grid step
    assert not fused.gates_along_lanes(gated=True, chunk_size=64)  # a step's tokens would not fill 128 lanes


def equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs inside it (``mxu.matmul``'s products sit in custom_vjp calls)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's
                if hasattr(inner, "eqns"):
                    yield from equations(inner)


@pytest.mark.parametrize(
    ("dtype", "precision"), [(jnp.bfloat16, jax.lax.Precision.DEFAULT), (jnp.float32, jax.lax.Precision.HIGHEST)]
)
def test_mxu_operands_follow_the_input_dtype(dtype, precision):
    # README "Numerics": for bf16 inputs the float32 attention matrix, state and decayed keys are
    # rounded to bf16 for the MXU (one pass, float32 accumulation); float32 inputs stay float32 at
    # HIGHEST precision, which a TPU needs to keep float32 accuracy.
    size = 64
    gates = chunkwise.ChunkGates.compute(jnp.float32(-0.1), jnp.full((size, 1), -0.1, jnp.float32), None, size)
    tokens, state = jax.ShapeDtypeStruct((size, 128), dtype), jax.ShapeDtypeStruct((128, 128), jnp.float32)

    def chunk_math(q, k, v, state):
        return chunkwise.chunk_output(q, k, v, state, gates, 0.1), chunkwise.advance_state(state, k, v, gates)

    jaxpr = jax.make_jaxpr(chunk_math)(tokens, tokens, tokens, state)
    dots = [eqn for eqn in equations(jaxpr.jaxpr) if eqn.primitive.name == "dot_general"]
    assert len(dots) == 4  # scores, from the state, attention x values, the state's update
    for dot in dots:
        assert [x.aval.dtype for x in dot.invars] == [jnp.dtype(dtype)] * 2
        assert dot.params["precision"] == (precision, precision)
        assert dot.params["preferred_element_type"] == jnp.float32


@pytest.mark.parametrize("size", [64, 128])
def test_cumulative_sum_of_g_is_as_exact_as_float32(size):
    # One bf16 MXU pass over g split into three bf16 parts: every product is exact, so the only error
    # is float32 accumulation, as at HIGHEST precision. Gates span magnitudes from 1e-6 to 10.
    rng = np.random.default_rng(0)
    g = -(10.0 ** rng.uniform(-6, 1, (size, 1))).astype(np.float32)
    exact = np.cumsum(g.astype(np.float64), axis=0)
    got, resets = (np.asarray(x, np.float64) for x in chunkwise.cumulative_sum(jnp.asarray(g)))
    np.testing.assert_array_equal(resets, 0.0)
    assert np.max(np.abs(got - exact) / np.abs(exact)) < size * np.finfo(np.float32).eps


def _spec(batch, heads, value_dim):
    return tops_core.CallSpec(
        op="simple_gla", platform="tpu", dtype="bfloat16", batch=batch, seq_len=4096, heads=heads,
        key_dim=128, value_dim=value_dim, num_seqs=batch, features={"g_gamma"}, ndims={"g_gamma": 1},
    )


@pytest.mark.parametrize(
    ("batch", "heads", "value_dim", "winner"),
    [(1, 1, 128, "chunk"), (1, 1, 256, "chunk"), (1, 2, 64, "fused"), (8, 16, 128, "fused")],
)
def test_priority_rule_picks_by_parallel_work(batch, heads, value_dim, winner):
    # No TPU attached: 2 TensorCores are assumed; fused wins once B * H * value blocks >= 2 (its
    # default config holds all of V in one block, so V = 256 is one block too).
    decision = sg.decide(_spec(batch, heads, value_dim))
    assert decision.implementation.name == f"tpu_pallas.{winner}"
    assert "B*H*value blocks" in decision.explain()
    for implementation in (FUSED, CHUNK):
        assert implementation.rank(_spec(batch, heads, value_dim))[0] > 50  # above the xla plugin on TPU


def _abstract_inputs(B, T, H, K, V):
    return dict(
        q=jax.ShapeDtypeStruct((B, T, H, K), jnp.bfloat16), k=jax.ShapeDtypeStruct((B, T, H, K), jnp.bfloat16),
        v=jax.ShapeDtypeStruct((B, T, H, V), jnp.bfloat16), g=jax.ShapeDtypeStruct((B, T, H), jnp.float32),
        g_gamma=jax.ShapeDtypeStruct((H,), jnp.float32), initial_state=jax.ShapeDtypeStruct((B, H, K, V), jnp.float32),
    )


def _compiled_forward(implementation):
    """The implementation's forward with every input given, compiled with Mosaic (never interpreted)."""
    config = dataclasses.replace(implementation.config, interpret=False)

    def forward(q, k, v, g, g_gamma, initial_state):
        return implementation.forward(
            q, k, v, g=g, g_gamma=g_gamma, scale=0.1, initial_state=initial_state,
            output_final_state=True, cu_seqlens=None, config=config,
        )

    return forward


IN_PLACE_DIMS, LANE_PADDED_DIMS = (128, 256), (100, 200)  # (K, V)


@pytest.mark.parametrize("head_dims", [IN_PLACE_DIMS, LANE_PADDED_DIMS], ids=["in-place", "lane-padded"])
def test_kernels_lower_to_mosaic_for_tpu(head_dims):
    # Lowering (not running) for TPU checks what the interpreter cannot: legal block shapes (ragged
    # last blocks included: T = 200 is not a multiple of either chunk size) and kernel bodies that
    # Pallas' Mosaic lowering supports.
    for implementation, calls in ((FUSED, 1), (CHUNK, 2)):
        shapes = _abstract_inputs(2, 200, 3, *head_dims)
        lowered = jax.jit(_compiled_forward(implementation)).trace(**shapes).lower(lowering_platforms=("tpu",))
        assert lowered.as_text().count("tpu_custom_call") == calls


@pytest.mark.parametrize(("kernel", "calls"), [("fused", 1), ("chunk", 2)])
def test_the_public_op_compiles_its_kernels_where_lowered_for_tpu(kernel, calls, make_inputs):
    # interpret=None follows the platform the program is lowered for, not this host's: the kernels
    # are Mosaic custom calls in the TPU lowering, absent from the CPU one, and one program exported
    # for both runs the portable implementation on CPU.
    inputs, _ = make_inputs(1, 100, 2, 128, 128, jnp.bfloat16, g_gamma="alibi")

    def forward(inputs):
        return sg.forward(**inputs, implementation=f"tpu_pallas.{kernel}")[0]

    traced = jax.jit(forward).trace(inputs)
    assert traced.lower(lowering_platforms=("tpu",)).as_text().count("tpu_custom_call") == calls
    with pytest.warns(RuntimeWarning, match=f"the forced tpu_pallas.{kernel} does not support this call"):
        assert "tpu_custom_call" not in traced.lower(lowering_platforms=("cpu",)).as_text()
        exported = jax.export.export(jax.jit(forward), platforms=("cpu", "tpu"))(inputs)
    assert exported.mlir_module().count("tpu_custom_call") == calls
    portable = sg.forward(**inputs, implementation="xla.chunk")[0]
    np.testing.assert_array_equal(exported.call(inputs), portable)


def _primitives_around_kernels(jaxpr) -> set[str]:
    """Names of the primitives in a jaxpr and the jaxprs nested in it, leaving out the kernels' bodies."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            for value in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(value, extend_core.ClosedJaxpr):
                    names |= _primitives_around_kernels(value.jaxpr)
                elif isinstance(value, extend_core.Jaxpr):
                    names |= _primitives_around_kernels(value)
    return names


@pytest.mark.parametrize(("implementation", "plans"), [(FUSED, fused.plans), (CHUNK, chunk.plans)], ids=["fused", "chunk"])
def test_aligned_head_dims_are_read_in_place(implementation, plans):
    # K and V multiples of 128: the kernels see the caller's q, k, v and state through reshapes
    # alone (no pad, upcast or slice around them). The fused forward transposes g to [B, H, T]
    # (fused.gates_along_lanes; the chunk kernels read it as it is), and its plans record that copy.
    in_place = jax.make_jaxpr(_compiled_forward(implementation))(**_abstract_inputs(2, 200, 3, *IN_PLACE_DIMS))
    fused_forward = plans is fused.plans
    assert _primitives_around_kernels(in_place.jaxpr) == {"pallas_call", "reshape", *(["transpose"] * fused_forward)}
    geometry = Geometry(2, 200, 3, *IN_PLACE_DIMS, 128, implementation.config.num_steps)
    gates_bytes = 2 * 200 * 3 * 4
    assert traffic.relayout_traffic(plans(geometry, jnp.bfloat16, gate_dtype=jnp.float32, initial_state_dtype=jnp.float32, output_final_state=True)) == (
        (gates_bytes, gates_bytes) if fused_forward else (0, 0)
    )
    # The same check sees the lane padding copy when V is not a multiple of 128.
    padded = jax.make_jaxpr(_compiled_forward(implementation))(**_abstract_inputs(2, 200, 3, *LANE_PADDED_DIMS))
    assert "pad" in _primitives_around_kernels(padded.jaxpr)


@pytest.mark.parametrize("Config", [FusedConfig, ChunkConfig])
@pytest.mark.parametrize(
    ("field", "value", "error"),
    [("chunk_size", 32, ValueError), ("num_steps", 0, ValueError), ("num_steps", 2.0, ValueError), ("interpret", "yes", TypeError)],
)
def test_configs_reject_invalid_fields(Config, field, value, error):
    with pytest.raises(error, match=field):
        Config(**{field: value})


@pytest.mark.parametrize("Config", [ChunkConfig, VarlenConfig])
@pytest.mark.parametrize("value", [256, None])
def test_only_the_fused_kernel_takes_chunks_of_256_or_a_chunk_chosen_per_chip(Config, value):
    FusedConfig(chunk_size=value)
    with pytest.raises(ValueError, match="chunk_size"):
        Config(chunk_size=value)


@pytest.mark.parametrize("value", [0, 2.0, True])
def test_fused_config_rejects_an_invalid_backward_segment(value):
    with pytest.raises(ValueError, match="backward_num_steps"):
        FusedConfig(backward_num_steps=value)


def test_attention_first_and_float32_precision_are_checked_and_not_varlen_fields():
    with pytest.raises(TypeError, match="attention_first"):
        FusedConfig(attention_first="yes")
    with pytest.raises(ValueError, match="float32_precision"):
        FusedConfig(float32_precision="bf16")
    with pytest.raises(ValueError, match="attention_first"):
        VarlenConfig(attention_first=True)
    with pytest.raises(ValueError, match="float32_precision"):
        VarlenConfig(float32_precision="high")


def test_capabilities_reject_what_does_not_fit_vmem():
    fits = dataclasses.replace(_spec(1, 2, 128), key_dim=256)
    too_wide = dataclasses.replace(_spec(1, 2, 128), key_dim=8192)
    for implementation in (FUSED, CHUNK):
        assert implementation.reasons(fits, "forward") == []
        assert any("VMEM" in reason for reason in implementation.reasons(too_wide, "forward"))
        assert implementation.reasons(fits, "backward") == []


@pytest.mark.parametrize(("chip", "winner"), [("v6e", "fused"), ("v5e", "fused"), ("v5p", "chunk"), ("v4", "chunk")])
def test_priority_rule_counts_the_tensorcores_of_the_chip_lowered_for(chip, winner):
    # One (batch, head) fills v5e's and v6e's single TensorCore, half of v4's and v5p's two.
    decision = sg.decide(dataclasses.replace(_spec(1, 1, 128), chip=chip))
    assert decision.implementation.name == f"tpu_pallas.{winner}"
    assert f"per {chip} chip" in decision.decided_by


@pytest.mark.parametrize(("chip", "fits"), [(None, False), ("v4", False), ("v5e", True), ("v5p", True), ("v6e", True)])
def test_capabilities_size_vmem_for_the_chip_the_call_is_lowered_for(chip, fits):
    # K = V = 1024 float32 with g: fused's plans need 26 MiB at one chunk per step, more than an unknown
    # chip's (or v4's) 16 MiB; v5e's and v6e's 96 MiB budget and v5p's 48 MiB hold them.
    spec = dataclasses.replace(_spec(1, 2, 1024), key_dim=1024, dtype="float32", features=frozenset({"g", "output_final_state"}), ndims=(), chip=chip)
    reasons = FUSED.reasons(spec, "forward")
    if fits:
        assert reasons == []
    else:
        assert len(reasons) == 1 and "VMEM" in reasons[0] and (f"of a {chip}" if chip else "of an unknown TPU") in reasons[0]


def test_split_operands_keep_about_16_bits_in_two_bf16_passes():
    # matmul's SPLIT_BFLOAT16: a bf16 input times a float32 intermediate as two native bf16 passes (the
    # intermediate's high and low bf16 parts); about 2**-16 relative against float64, where one bf16 pass
    # rounds the intermediate to 2**-8. Two float32 operands take three passes (all but low x low).
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((128, 128)) * np.exp(rng.standard_normal((128, 128))), jnp.float32)
    want = np.asarray(a, np.float64) @ np.asarray(b, np.float64)

    def error(operands):
        got = np.asarray(mxu.matmul(a, b, operands), np.float64)
        return np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))

    assert error(mxu.SPLIT_BFLOAT16) < 2**-15 < 2**-10 < error(jnp.bfloat16)
    for operands, passes in (((a, b), 2), ((b, b), 3)):
        jaxpr = jax.make_jaxpr(lambda x, y: mxu.matmul(x, y, mxu.SPLIT_BFLOAT16))(*operands).jaxpr
        dots = [e for e in equations(jaxpr) if e.primitive.name == "dot_general"]
        assert len(dots) == passes
        assert all(x.aval.dtype == jnp.bfloat16 for dot in dots for x in dot.invars)


# gla's kernels by default: they run on kda's machinery (kda/fused.py, kda/backward.py), the same index maps.
@pytest.mark.parametrize("op", [pytest.param("simple_gla", marks=pytest.mark.slow), pytest.param("kda", marks=pytest.mark.slow), "gla"])
def test_kernels_run_with_jax_enable_x64(op):
    # Every kernel's index maps divide grid indices (int32); with jax_enable_x64 a Python int divisor became int64 and
    # lax.div refused the pair, so every tpu_pallas training kernel failed to trace. One op per family of kernels.
    rng = np.random.default_rng(0)
    B, T, H, K, V = 1, 70, 2, 32, 32

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape) * 0.3, jnp.float32)

    inputs = {"q": normal(B, T, H, K), "k": normal(B, T, H, K), "v": normal(B, T, 2 * H, V)}
    if op == "kda":
        inputs |= {"g": -jnp.abs(normal(B, T, 2 * H, K)), "beta": jax.nn.sigmoid(normal(B, T, 2 * H))}
    elif op == "gla":
        inputs |= {"v": normal(B, T, H, V), "g": -jnp.abs(normal(B, T, H, K))}
    else:
        inputs |= {"v": normal(B, T, H, V), "g": -jnp.abs(normal(B, T, H))}
    contract = tops_core.op(op)

    def value_and_gradients(inputs):
        def loss(inputs):
            o, final_state = contract.forward(**inputs, output_final_state=True, implementation="tpu_pallas.fused")
            return jnp.sum(o * o) + jnp.sum(final_state * final_state)

        with tops_core.use(interpret=True, strict=True):
            return jax.value_and_grad(loss)(inputs)

    want = value_and_gradients(inputs)
    with jax.enable_x64(True):
        got = value_and_gradients(inputs)
    for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert got_leaf.dtype == want_leaf.dtype
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("contracting", [mxu.ROWS_BY_COLUMNS, mxu.ROWS_BY_ROWS, mxu.COLUMNS_BY_COLUMNS], ids=["a@b", "a@b.T", "a.T@b"])
def test_split_products_stacked_along_the_contraction_are_the_split_products(contracting):
    # SPLIT_BFLOAT16_STACKED (v6e's backward) is SPLIT_BFLOAT16's two products as one: the same ~16 bits of the float32 operand.
    rng = np.random.default_rng(8)
    a = jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((128, 128)), jnp.bfloat16)
    stacked = mxu.matmul(a, b, mxu.SPLIT_BFLOAT16_STACKED, contracting)
    np.testing.assert_allclose(stacked, mxu.matmul(a, b, mxu.SPLIT_BFLOAT16, contracting), rtol=1e-5, atol=1e-5)
    exact = jax.lax.dot_general(np.asarray(a, np.float64), np.asarray(b, np.float64), (contracting, ((), ())))
    np.testing.assert_allclose(stacked, exact, rtol=0, atol=2**-14 * np.abs(exact).max())


def test_lowered_for_v6e_the_fused_backward_stacks_its_state_products_and_matches_the_reference(monkeypatch):
    # gradients.state_passes as the backward applies it (a v6e target in the interpreter): the kit's bfloat16 case (with
    # g, every token's decay gradient), every gradient against the float64 reference; on a 128-deep MXU, and for float32
    # inputs, the products stay split (or float32).
    split, stacked = mxu.SPLIT_BFLOAT16, mxu.SPLIT_BFLOAT16_STACKED
    assert gradients.state_passes(jnp.bfloat16, "v5e", True) == gradients.StatePasses(split, split, split, split)
    assert gradients.state_passes(jnp.float32, "v6e", True) == gradients.StatePasses(*[jnp.float32] * 4)
    implementation = tops_core.default_registry().get("simple_gla", "tpu_pallas.fused")
    case = next(case for case in grid(implementation).supported if case.name == "bfloat16")  # g and g_gamma
    chosen = _choices_running_for_v6e(monkeypatch, ("state_passes", "input_products_first"), implementation, case)
    # The pairs' sums stay split: dg_gamma sums every token's decay gradient.
    assert chosen["state_passes"] == [gradients.StatePasses(stacked, stacked, stacked, split)]
    # Every chunk's products of its inputs traced before the rest of any chunk's gradients (gradients.reversed_gradients).
    assert chosen["input_products_first"] == [True] and not gradients.input_products_first("v5e")


@pytest.mark.parametrize("case_name", ["bfloat16-weak-g", "reset-g"])
def test_lowered_for_v6e_the_pairs_sums_of_g_alone_take_one_bf16_pass_and_match_the_reference(monkeypatch, case_name):
    # gradients.state_passes' pair_sums (a v6e target in the interpreter): with g alone in bf16 each token's decay gradient
    # sums its pairs in one bf16 pass, and (scale in the decays, ChunkForm.scale_in_decays) every gradient stays within
    # the kit's tolerance of the float64 reference, under the weak decay and across gates of -inf.
    implementation = tops_core.default_registry().get("simple_gla", "tpu_pallas.fused")
    case = next(case for case in grid(implementation).supported if case.name == case_name)
    case = dataclasses.replace(case, dtype="bfloat16")
    chosen = _choices_running_for_v6e(monkeypatch, ("chunk_form",), implementation, case)
    (form,) = chosen["chunk_form"]
    assert form.passes.pair_sums == jnp.bfloat16 and form.scale_in_decays and form.products_first


def _choices_running_for_v6e(monkeypatch, rules: tuple[str, ...], implementation, case) -> dict[str, list]:
    """Run the kit's ``case`` through ``implementation`` traced for a v6e (in the interpreter), checked against the
    reference, and return what each ``gradients.<rule>`` of ``rules`` chose on the way."""
    monkeypatch.setattr(launch.Target, "lowered_for", classmethod(lambda cls: cls.of("v6e")))
    chosen = {rule: [] for rule in rules}

    def recorder(rule):
        choose = getattr(gradients, rule)

        def recorded(*args, **kwargs):
            chosen[rule].append(choose(*args, **kwargs))
            return chosen[rule][-1]

        return recorded

    for rule in rules:
        monkeypatch.setattr(gradients, rule, recorder(rule))
    jax.clear_caches()  # the kit's own run of this case may have left its program, traced for no chip, in jit's cache
    try:
        checks.run_case(implementation, case)
    finally:
        jax.clear_caches()  # and none traced for v6e stays behind for the tests that follow
    return chosen


# The kit's g_gamma cases (ragged T = 100, dht; the weak bf16 decay whose dg_gamma nearly cancels; packed over two
# chunks, with states and without) through every backward that sums the decay gradient.
SUMMED_DECAY_GRADIENT_CASES = [
    ("tpu_pallas.fused", "gates=g_gamma", False), ("tpu_pallas.fused", "bfloat16-weak-g_gamma", False),
    ("tpu_pallas.chunk", "gates=g_gamma", False), ("tpu_pallas.varlen", "strong-g_gamma", False),
    ("tpu_pallas.varlen", "bfloat16-strong-g_gamma", False), ("tpu_pallas.varlen", "bfloat16-strong-g_gamma", True),
]


@pytest.mark.parametrize(("name", "case_name", "without_states"), SUMMED_DECAY_GRADIENT_CASES)
def test_lowered_for_v6e_the_backwards_sum_g_gammas_decay_gradient_and_match_the_reference(monkeypatch, name, case_name, without_states):
    # gradients.per_token_decay_gradient as the backwards apply it (a v6e target in the interpreter): with g_gamma alone
    # each chunk's row holds only the sum dg_gamma needs; with g, or on a 128-wide MXU in the kernels that compute every
    # gradient of a chunk (not the split backward's query/key kernel), every token's.
    assert gradients.per_token_decay_gradient(True, "v6e") and gradients.per_token_decay_gradient(False, "v5e")
    assert not gradients.per_token_decay_gradient(False, "v5e", split=True) and not gradients.per_token_decay_gradient(False, "v6e")
    implementation = tops_core.default_registry().get("simple_gla", name)
    case = next(case for case in grid(implementation).supported if case.name == case_name)
    if without_states:  # the packed backward without states: fused's on the reset gates
        case = case.with_features(case.name + "-without-states", case.features - {"initial_state", "output_final_state"})
    chosen = _choices_running_for_v6e(monkeypatch, ("per_token_decay_gradient", "state_passes"), implementation, case)
    assert chosen["per_token_decay_gradient"] == [False]
    # bfloat16 (the weak decay among them): the entering state's reads in one bf16 pass (gradients.state_passes).
    if case.dtype == "bfloat16" and name != "tpu_pallas.chunk":
        assert [passes.reads for passes in chosen["state_passes"]] == [jnp.bfloat16]


@pytest.mark.parametrize("total, mild", [(-39.9, True), (-40.1, False), (-np.inf, False), (np.nan, False)])
@pytest.mark.parametrize("size", [None, 32])
def test_gla_takes_its_fast_path_only_where_every_chunk_is_mild(total, mild, size):
    """One key of one chunk (or block of ``size`` rows) of a grid step at ``total``, the rest weak: the choice covers every
    chunk, block and key; two blocks of a chunk each at ``-39.9`` make its sub-chunks mild and the chunk not."""
    gs = [jnp.full((64, 128), -1e-3) for _ in range(3)]
    gs[1] = gs[1].at[37, 7].set(total)
    assert bool(kda_chunkwise.every_chunk_mild(gs, size)) is mild
    gs[1] = gs[1].at[5, 7].set(-39.9).at[37, 7].set(-39.9)
    assert bool(kda_chunkwise.every_chunk_mild(gs, size)) is (size is not None)


_BOTH_ARMS = [fast_paths.FAST, kda_chunkwise.MILD_SUB_CHUNKS]


@pytest.mark.parametrize("op_name, forward_choices, backward_choices", [("gla", _BOTH_ARMS, 2 * _BOTH_ARMS), ("kda", [], [])])
def test_gla_chooses_in_each_of_its_kernels_and_kda_in_none(op_name, forward_choices, backward_choices):
    """gla's forward kernel holds both choices (whole chunks mild, else sub-chunks), its backward's checkpoints walk and
    gradients kernel both each (the gradients kernel's around its whole step); kda's gates seldom allow the fast paths,
    and its bf16 ``dg`` could not afford them."""
    rng = np.random.default_rng(0)
    B, T, H, K, V = 1, 128, 1, 64, 32
    q, k, g = (jnp.asarray(rng.standard_normal((B, T, H, K)) * 0.1, jnp.float32) for _ in range(3))
    v, do = (jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32) for _ in range(2))
    inputs = dict(q=q, k=k, v=v, g=-jnp.abs(g), **({"beta": jnp.full((B, T, H), 0.5, jnp.float32)} if op_name == "kda" else {}))
    assert _choices(op_name, inputs, do, ("tpu_pallas.fused", {"chunk_size": 64})) == (forward_choices, backward_choices)


def _choices(op_name: str, inputs: dict, do, implementation) -> tuple[list[str], list[str]]:
    """The fast arms ``op_name``'s forward and backward choose between (``fast_paths.recording``), traced in the
    interpreter."""
    contract = tops_core.op(op_name)
    with tops_core.use(interpret=True, strict=True):
        with fast_paths.recording() as forward:
            jax.make_jaxpr(lambda inputs: contract.forward(**inputs, implementation=implementation))(inputs)
        with fast_paths.recording() as backward:
            jax.make_jaxpr(lambda inputs, do: contract.backward(**inputs, do=do, implementation=implementation))(inputs, do)
    return forward, backward


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("gates", [
    "mild bound, even", "mild bound, one token", "a mild step beside a strong one", "mild sub-chunks at their bound",
    "mild sub-chunks beside a strong step",
])
def test_gla_fast_path_at_its_bound_matches_the_reference(dtype, gates):
    """gla's mild chunks at the edge of the fast path (``-39.5`` over each chunk of 64: its factors reach ``exp(+-39.5)``),
    its mild sub-chunks at theirs (``-39.5`` over each 32 tokens, ``-79`` over a chunk), and calls whose first grid step
    is mild and second decays at ``-10`` per token (two chunks per step): forward and every gradient against the
    float64 reference, in the interpreter."""
    rng = np.random.default_rng(5)
    B, T, H, K, V = 1, 256, 2, 64, 32
    q, k = (jnp.asarray(rng.standard_normal((B, T, H, K)) * K**-0.5, dtype) for _ in range(2))
    v, do = (jnp.asarray(rng.standard_normal((B, T, H, V)), dtype) for _ in range(2))
    if gates == "mild bound, even":
        g = np.full((B, T, H, K), -39.5 / 64)
    elif gates == "mild bound, one token":
        g = np.where(np.arange(T)[:, None, None] % 64 == rng.integers(0, 64, size=(H, K)), -39.5, 0.0)[None]
    elif gates == "a mild step beside a strong one":
        g = np.where(np.arange(T)[:, None, None] < 128, -39.5 / 64, -10.0) * np.ones((B, T, H, K))
    elif gates == "mild sub-chunks at their bound":
        g = np.full((B, T, H, K), -39.5 / kda_chunkwise.MILD_SUB_CHUNK)
    else:
        g = np.where(np.arange(T)[:, None, None] < 128, -39.5 / kda_chunkwise.MILD_SUB_CHUNK, -10.0) * np.ones((B, T, H, K))
    g = jnp.asarray(g, jnp.float32)
    contract = tops_core.op("gla")
    implementation = ("tpu_pallas.fused", {"chunk_size": 64, "num_steps": 2})

    def results(impl):
        def loss(q, k, v, g):
            o, final_state = contract.forward(q, k, v, g, output_final_state=True, implementation=impl)
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) + jnp.sum(final_state), (o, final_state)

        (_, outputs), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, g)
        return dict(zip(("o", "final_state", "dq", "dk", "dv", "dg"), (*outputs, *grads)))

    with tops_core.use(interpret=True, strict=True):
        got = results(implementation)
    want = results("ref.recurrent")
    for name, x in got.items():
        assert bool(jnp.isfinite(x).all()), name
        measurement = measure(name, x, want[name], tolerance(dtype, gradient=name.startswith("d")))
        assert measurement.passed, measurement.describe()


@pytest.mark.parametrize("gate, finite", [(-3.0, True), (-np.inf, False), (np.nan, False)])
def test_gated_delta_rule_takes_finite_gates_only_where_every_gate_is(gate, finite):
    """One token's gate of one chunk of a grid step decides it: ``-inf`` or NaN anywhere takes the arm that counts
    ``-inf`` gates apart, as does a packed sequence starting anywhere in the step (its first gate is ``-inf``)."""
    gs = [jnp.full((64, 1), -0.5) for _ in range(3)]
    gs[2] = gs[2].at[41, 0].set(gate)

    def arm(**options):
        return int(gdn_chunkwise.by_finiteness(gs, lambda size: jnp.int32(size or 0), None, **options))

    assert arm(fast=True) == (64 if finite else 0)
    assert arm(fast=False) == 0
    starts = [jnp.zeros((64, 1), bool) for _ in range(3)]
    assert arm(fast=True, resets=starts) == (64 if finite else 0)
    starts[0] = starts[0].at[9, 0].set(True)  # a packed sequence starting in the step: a -inf gate
    assert arm(fast=True, resets=starts) == 0


def _gated_delta_rule_inputs(dtype, g, T=256, H=2, K=64, V=32, seed=9):
    rng = np.random.default_rng(seed)
    q, k = (jnp.asarray(rng.standard_normal((1, T, H, K)) * K**-0.5, dtype) for _ in range(2))
    v, do = (jnp.asarray(rng.standard_normal((1, T, H, V)), dtype) for _ in range(2))
    beta = jnp.asarray(rng.uniform(0.2, 0.9, (1, T, H)), dtype)
    return dict(q=q, k=k, v=v, g=jnp.asarray(g, jnp.float32), beta=beta), do


@pytest.mark.parametrize("implementation", ["tpu_pallas.fused", "tpu_pallas.varlen"])
def test_gated_delta_rule_chooses_finite_gates_in_each_of_its_kernels(implementation):
    """The forward kernel, the backward's checkpoints walk and its gradients kernel each hold the choice, packed too."""
    inputs, do = _gated_delta_rule_inputs(jnp.float32, np.full((1, 256, 2), -0.1))
    if implementation == "tpu_pallas.varlen":
        inputs["cu_seqlens"] = jnp.asarray([0, 100, 256], jnp.int32)
    finite = gdn_chunkwise.FINITE_GATES
    assert _choices("gated_delta_rule", inputs, do, (implementation, {"chunk_size": 64})) == ([finite], [finite, finite])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("packed", [False, True], ids=["infinite gates", "packed"])
def test_gated_delta_rule_with_infinite_gates_beside_finite_ones_matches_the_reference(dtype, packed):
    """A first grid step with ``-inf`` gates (on one head, then on every head at one token) or, packed, with a sequence
    start takes the arm that counts them, the second step's finite gates the other: forward and every gradient against
    the float64 reference."""
    rng = np.random.default_rng(4)
    g = -rng.exponential(0.3, (1, 256, 2))
    if not packed:
        g[0, [3, 70, 71], 1] = -np.inf
        g[0, 100, :] = -np.inf
    inputs, do = _gated_delta_rule_inputs(jnp.dtype(dtype), g)
    cu_seqlens = jnp.asarray([0, 37, 256], jnp.int32) if packed else None
    contract = tops_core.op("gated_delta_rule")

    def results(impl):
        def loss(q, k, v, g, beta):
            o, final_state = contract.forward(
                q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_seqlens, implementation=impl,
            )
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) + jnp.sum(final_state), (o, final_state)

        (_, outputs), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(*inputs.values())
        return dict(zip(("o", "final_state", "dq", "dk", "dv", "dg", "dbeta"), (*outputs, *grads)))

    implementation = "tpu_pallas.varlen" if packed else "tpu_pallas.fused"
    with tops_core.use(interpret=True, strict=True):
        got = results((implementation, {"chunk_size": 64, "num_steps": 2}))
    want = results("ref.recurrent")
    for name, x in got.items():
        assert bool(jnp.isfinite(x).all()), name
        measurement = measure(name, x, want[name], tolerance(dtype, gradient=name.startswith("d")))
        assert measurement.passed, measurement.describe()
