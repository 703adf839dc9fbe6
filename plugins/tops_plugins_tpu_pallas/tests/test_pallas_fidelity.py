"""The kernels, forward and backward (kda's packed varlen: forward only), under Pallas' faithful TPU interpreter, against the float64 reference (slow).

``pltpu.InterpretParams`` simulates what the fast interpreter hides: uninitialised VMEM and
outputs full of NaN, two cores sharing the parallel grid axes, the order of parallel grid points
randomised by the seed, and a happens-before race detector over every buffer access. It pads every
input to whole blocks with its uninitialised value before the kernel runs, so the rows a ragged
last block holds past the end of an array read as NaN (``out_of_bounds_reads`` concerns reads
beyond even that padding, which these kernels never make): every case below with ``T`` not a
multiple of the chunk checks that those rows are masked before any arithmetic.

    pytest -m slow plugins/tops_plugins_tpu_pallas
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tops_core
from tops_core.conformance.cases import grid as case_grid
from tops_core.conformance.checks import run_case
from tops_core.conformance.compare import measure, tolerance
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tops_plugins_tpu_pallas import grid
from tops_plugins_tpu_pallas.simple_gla import backward_fused
from tops_plugins_tpu_pallas.simple_gla.fused import FusedConfig

pytestmark = pytest.mark.slow

SEEDS = (0, 1, 2)
LAUNCHES = {"fused": 1, "chunk": 2}


def gradient_launches(kernel: str, shape: tuple[int, ...], config: dict) -> int:
    """The forward's launches and the backward's; the fused backward walks its checkpoints only where a sequence has
    several segments."""
    if kernel == "chunk":
        return 2 + 3
    return 1 + (2 if backward_fused.geometry_of(*shape, FusedConfig(**config)).time_steps > 1 else 1)


def _gates_with_resets(B: int, T: int, H: int) -> np.ndarray:
    """docs/ops.md's gates with ``-inf`` (a reset) at a sequence's first token, two in a row, on and beside the chunk
    grid of 128 and at the last token in the last head, and at token 100 in every head."""
    g = -np.logaddexp(0.0, -np.random.default_rng(5).standard_normal((B, T, H))) / 16
    g[:, [0, 37, 38, 127, 128, T - 1], H - 1] = -np.inf
    g[:, 100, :] = -np.inf
    return g


# B, T, H, K, V, dtype, inputs, config. K and V multiples of 128 are read in place, the others go
# through the lane padding copy; every case has a ragged last block or several (batch, head, tile) points.
CASES = {
    "in-place-f32-g-alibi-h0-ragged": ((2, 250, 1, 128, 128), jnp.float32, dict(g=True, g_gamma="alibi", initial_state=True), dict(chunk_size=64, num_steps=2)),
    "in-place-bf16-g-alibi-h0-C128-ragged": ((1, 500, 2, 128, 128), jnp.bfloat16, dict(g=True, g_gamma="alibi", initial_state=True), dict(chunk_size=128, num_steps=2)),
    "in-place-bf16-no-decay-KV256-ragged": ((1, 70, 2, 256, 256), jnp.bfloat16, dict(), dict(chunk_size=64, num_steps=1)),
    "lane-padded-bf16-g-K100-ragged": ((1, 130, 2, 100, 100), jnp.bfloat16, dict(g=True), dict(chunk_size=64, num_steps=4)),
    "lane-padded-f32-strong-decay-C128-ragged": ((2, 200, 1, 64, 200), jnp.float32, dict(g_gamma=-1.0, initial_state=True), dict(chunk_size=128, num_steps=4)),
    # Gates of -inf: g's resets masked in every chunk's decays, and g_gamma = -inf on head 0 (a reset at every token).
    "in-place-f32-resets-C128-ragged": ((1, 300, 2, 128, 128), jnp.float32, dict(g=_gates_with_resets(1, 300, 2), g_gamma=[-np.inf, -0.05], initial_state=True), dict(chunk_size=128, num_steps=2)),
    # v6e's forward chunk; fused only (ChunkConfig has no chunk 256).
    "in-place-f32-g-alibi-h0-C256-ragged": ((1, 600, 2, 128, 128), jnp.float32, dict(g=True, g_gamma="alibi", initial_state=True), dict(chunk_size=256, num_steps=2)),
}
KERNEL_CASES = [(kernel, case) for kernel in LAUNCHES for case in CASES if kernel == "fused" or CASES[case][3]["chunk_size"] <= 128]


def faithful(seed: int) -> pltpu.InterpretParams:
    return pltpu.InterpretParams(uninitialized_memory="nan", num_cores_or_threads=2, detect_races=True, random_seed=seed)


def run_faithfully(kernel: str, inputs: dict, config: dict, seed: int):
    def call(inputs):
        with tops_core.use(interpret=True, strict=True):
            return tops_core.op("simple_gla").forward(
                **inputs, output_final_state=True,
                implementation=(f"tpu_pallas.{kernel}", {**config, "interpret": faithful(seed)}),
            )

    return jax.block_until_ready(jax.jit(call)(inputs))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("kernel", "case"), KERNEL_CASES)
def test_faithful_interpreter_matches_reference(kernel, case, seed, race_reports, make_inputs, reference, assert_matches):
    shape, dtype, given, config = CASES[case]
    inputs, ref_inputs = make_inputs(*shape, dtype, seed=seed, **given)
    o, final_state = run_faithfully(kernel, inputs, config, seed)
    assert len(race_reports) == LAUNCHES[kernel]
    assert not any(report.races_found for report in race_reports)
    o_ref, final_ref = reference(ref_inputs)
    assert_matches("o", o, o_ref, dtype)
    assert_matches("final_state", final_state, final_ref, dtype)


def gradients_faithfully(kernel: str, inputs: dict, do, dht, config: dict, seed: int):
    """Every gradient of ``inputs`` in the faithful interpreter; ``dht`` None: no final state asked for."""
    def call(inputs):
        with tops_core.use(interpret=True, strict=True):
            _, vjp = jax.vjp(
                lambda a: tops_core.op("simple_gla").forward(
                    **a, output_final_state=dht is not None,
                    implementation=(f"tpu_pallas.{kernel}", {**config, "interpret": faithful(seed)}),
                ),
                inputs,
            )
            return vjp((do, dht))[0]

    return jax.block_until_ready(jax.jit(call)(inputs))


@pytest.mark.parametrize(("kernel", "case"), KERNEL_CASES)
def test_faithful_interpreter_gradients_match_reference(kernel, case, race_reports, make_inputs, reference_gradients):
    # Every gradient, with a final-state cotangent; one seed (the backward launches the forward's states again).
    shape, dtype, given, config = CASES[case]
    seed = SEEDS[0]
    inputs, ref_inputs = make_inputs(*shape, dtype, seed=seed, **given)
    rng = np.random.default_rng(seed + 10)
    B, T, H, K, V = shape
    do = jnp.asarray(rng.standard_normal((B, T, H, V)), dtype)
    dht = jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32)
    if kernel == "fused":  # segments of num_steps chunks, not the default 4096 tokens: several per sequence
        config = {**config, "backward_num_steps": config["num_steps"]}
    grads = gradients_faithfully(kernel, inputs, do, dht, config, seed)
    assert len(race_reports) == gradient_launches(kernel, shape, config)
    assert not any(report.races_found for report in race_reports)
    for name, want in reference_gradients(ref_inputs, do, dht).items():
        measurement = measure(f"d{name}", grads[name], want, tolerance(jnp.dtype(dtype).name, gradient=True))
        assert measurement.passed, measurement.describe()


def test_race_detector_catches_a_race(race_reports):
    # The check above can fail: two parallel grid points writing one output block, on two cores, is a race.
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    racy = pl.pallas_call(
        kernel, grid=(2,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))], out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)), interpret=faithful(0),
    )
    jax.block_until_ready(racy(jnp.asarray(np.ones((16, 128)), jnp.float32)))
    assert [report.races_found for report in race_reports] == [True]


def test_rows_past_the_end_are_nan_unless_masked(race_reports, monkeypatch, make_inputs):
    # The ragged cases above can fail: read the rows of a ragged block past the end of the sequence
    # without the mask, and the interpreter's NaN there reaches the state and every later output.
    monkeypatch.setattr(grid.Chunk, "read", lambda chunk, ref: ref[chunk.rows, :])
    inputs, _ = make_inputs(1, 100, 1, 128, 128, jnp.float32)
    try:
        o, final_state = run_faithfully("fused", inputs, dict(chunk_size=64, num_steps=1), seed=0)
    finally:
        jax.clear_caches()  # drop the traces made with the mask patched out
    assert np.isfinite(np.asarray(o[:, :64])).all()  # the first chunk is whole
    assert np.isnan(np.asarray(final_state)).all()


# tpu_pallas.varlen: (H, K, V), dtype, packing, config. Boundaries inside chunks and on them, empty
# sequences first, inside and last, one-token sequences, a sequence over several chunks, a ragged last
# block; the initial states come in and the final states go out by the kernel's own DMAs.
VARLEN_CASES = {
    "f32-h0-anywhere-ragged": ((2, 128, 128), jnp.float32, (0, 1, 70, 57, 0, 5, 1, 140, 1, 0), dict(chunk_size=64, num_steps=2)),
    "bf16-h0-lane-padded-C128": ((1, 100, 200), jnp.bfloat16, (64, 200, 1, 0), dict(chunk_size=128, num_steps=1)),
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_faithful_interpreter_matches_reference_packed(case, seed, race_reports, make_inputs, reference, assert_matches):
    (H, K, V), dtype, seqlens, config = VARLEN_CASES[case]
    inputs, ref_inputs = make_inputs(1, sum(seqlens), H, K, V, dtype, seed=seed, g=True, g_gamma="alibi")
    rng = np.random.default_rng(seed)
    inputs["initial_state"] = jnp.asarray(rng.standard_normal((len(seqlens), H, K, V)), jnp.float32)
    ref_inputs["initial_state"] = np.asarray(inputs["initial_state"], np.float64)
    cu_seqlens = np.cumsum((0, *seqlens)).astype(np.int32)
    o, final_state = run_faithfully("varlen", {**inputs, "cu_seqlens": jnp.asarray(cu_seqlens)}, config, seed)
    assert len(race_reports) == 1
    assert not any(report.races_found for report in race_reports)
    o_ref, final_ref = reference({**ref_inputs, "cu_seqlens": cu_seqlens})
    assert_matches("o", o, o_ref, dtype)
    assert_matches("final_state", final_state, final_ref, dtype)


# Chunks per backward segment: the f32 case's 5 chunks in one segment (its states recomputed across
# boundaries from one checkpoint), the bf16 case's 3 chunks one per segment (dS carried across segments).
VARLEN_BACKWARD_STEPS = {"f32-h0-anywhere-ragged": 5, "bf16-h0-lane-padded-C128": 1}


@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_faithful_interpreter_gradients_match_reference_packed(case, race_reports, make_inputs, reference_gradients):
    # Every gradient of the packed call, dht for every sequence; dht, initial_state and dinitial_state move by DMA.
    (H, K, V), dtype, seqlens, config = VARLEN_CASES[case]
    seed = SEEDS[0]
    inputs, ref_inputs = make_inputs(1, sum(seqlens), H, K, V, dtype, seed=seed, g=True, g_gamma="alibi")
    rng = np.random.default_rng(seed)
    N = len(seqlens)
    inputs["initial_state"] = jnp.asarray(rng.standard_normal((N, H, K, V)), jnp.float32)
    ref_inputs["initial_state"] = np.asarray(inputs["initial_state"], np.float64)
    do = jnp.asarray(rng.standard_normal((1, sum(seqlens), H, V)), dtype)
    dht = jnp.asarray(rng.standard_normal((N, H, K, V)), jnp.float32)
    cu_seqlens = np.cumsum((0, *seqlens)).astype(np.int32)
    config = {**config, "backward_num_steps": VARLEN_BACKWARD_STEPS[case]}
    grads = gradients_faithfully("varlen", {**inputs, "cu_seqlens": jnp.asarray(cu_seqlens)}, do, dht, config, seed)
    assert len(race_reports) == 1 + 2
    assert not any(report.races_found for report in race_reports)
    for name, want in reference_gradients({**ref_inputs, "cu_seqlens": cu_seqlens}, do, dht).items():
        measurement = measure(f"d{name}", grads[name], want, tolerance(jnp.dtype(dtype).name, gradient=True))
        assert measurement.passed, measurement.describe()


def test_faithful_interpreter_gradients_match_reference_packed_without_states_or_g(race_reports, make_inputs, reference_gradients):
    # The usual constant-decay training batch: fused's backward with g_gamma's gates cut at the sequence starts
    # (ChunkGates.cut_at, each chunk's first and last start in SMEM); 5 chunks of 64 in segments of 2, so the
    # checkpoints walk runs (on the reset gates) and the last segment runs past T.
    (H, K, V), dtype, seqlens, config = VARLEN_CASES["f32-h0-anywhere-ragged"]
    seed = SEEDS[0]
    inputs, ref_inputs = make_inputs(1, sum(seqlens), H, K, V, dtype, seed=seed, g_gamma="alibi")
    do = jnp.asarray(np.random.default_rng(seed).standard_normal((1, sum(seqlens), H, V)), dtype)
    cu_seqlens = np.cumsum((0, *seqlens)).astype(np.int32)
    grads = gradients_faithfully("varlen", {**inputs, "cu_seqlens": jnp.asarray(cu_seqlens)}, do, None, {**config, "backward_num_steps": 2}, seed)
    assert len(race_reports) == 1 + 2
    assert not any(report.races_found for report in race_reports)
    for name, want in reference_gradients({**ref_inputs, "cu_seqlens": cu_seqlens}, do, None).items():
        measurement = measure(f"d{name}", grads[name], want, tolerance(jnp.dtype(dtype).name, gradient=True))
        assert measurement.passed, measurement.describe()


# kda's fused kernel: B, T, H, K, V, dtype, make_kda_inputs options, use_qk_l2norm,
# config. Every case is ragged and has several (batch, head, value block) points, so the two
# simulated cores share them in a random order: a state carried over from another grid point would show.
KDA_CASES = {
    "in-place-f32-h0-two-chunks-per-step-ragged": ((2, 250, 2, 128, 128), jnp.float32, {}, False, dict(chunk_size=64, num_steps=2)),
    "lane-padded-bf16-l2norm-two-value-tiles-ragged": ((1, 100, 2, 100, 200), jnp.bfloat16, dict(normalised=False), True, dict(full_values=False, num_steps=1)),
    "f32-g=-10-C128-ragged": ((2, 200, 1, 64, 64), jnp.float32, dict(gate=-10.0), False, dict(chunk_size=128, num_steps=4)),
    "default-config-bf16-h0-ragged": ((1, 300, 2, 128, 128), jnp.bfloat16, {}, False, {}),
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", list(KDA_CASES))
def test_kda_faithful_interpreter_matches_reference(case, seed, race_reports, make_kda_inputs, kda_reference, assert_matches):
    shape, dtype, given, use_qk_l2norm, config = KDA_CASES[case]
    inputs = make_kda_inputs(*shape, dtype, seed=seed, **given)

    def call(inputs):
        with tops_core.use(interpret=True, strict=True):
            return tops_core.op("kda").forward(
                **inputs, output_final_state=True, use_qk_l2norm=use_qk_l2norm,
                implementation=("tpu_pallas.fused", {**config, "interpret": faithful(seed)}),
            )

    o, final_state = jax.block_until_ready(jax.jit(call)(inputs))
    assert len(race_reports) == 1
    assert not any(report.races_found for report in race_reports)
    o_ref, final_ref = kda_reference(inputs, use_qk_l2norm)
    assert_matches("o", o, o_ref, dtype)
    assert_matches("final_state", final_state, final_ref, dtype)


@pytest.mark.parametrize("case", ["in-place-f32-h0-two-chunks-per-step-ragged", "default-config-bf16-h0-ragged"])
def test_kda_backward_faithful_interpreter_matches_reference(case, race_reports, make_kda_inputs, kda_gradients):
    # kda.backward's two kernels (checkpoints, then dS in VMEM along the reverse time axis) on two simulated
    # cores in a random order, every gradient against ref.recurrent's (float64 inside).
    shape, dtype, given, use_qk_l2norm, config = KDA_CASES[case]
    seed = SEEDS[0]
    inputs = make_kda_inputs(*shape, dtype, seed=seed, **given)
    got = kda_gradients(inputs, ("tpu_pallas.fused", {**config, "interpret": faithful(seed)}), use_qk_l2norm=use_qk_l2norm)
    assert len(race_reports) >= 2 and not any(report.races_found for report in race_reports)
    want = kda_gradients(inputs, "ref.recurrent", use_qk_l2norm=use_qk_l2norm)
    for name in inputs:
        measurement = measure(f"d{name}", got[name], want[name], tolerance(jnp.dtype(dtype).name, gradient=True))
        assert measurement.passed, measurement.describe()


@pytest.mark.parametrize("seed", SEEDS[:1])
def test_kda_bounded_path_faithful_interpreter_matches_reference(seed, race_reports, make_kda_inputs, kda_reference, assert_matches):
    # The bounded path (lower_bound promised) at its worst: every gate at the bound, T = 250 ragged, two chunks per step.
    inputs = make_kda_inputs(2, 250, 2, 128, 128, jnp.float32, gate=-5.0, seed=seed)

    def call(inputs):
        with tops_core.use(interpret=True, strict=True):
            return tops_core.op("kda").forward(
                **inputs, output_final_state=True, lower_bound=-5.0,
                implementation=("tpu_pallas.fused", {"chunk_size": 64, "num_steps": 2, "interpret": faithful(seed)}),
            )

    o, final_state = jax.block_until_ready(jax.jit(call)(inputs))
    assert len(race_reports) == 1
    assert not any(report.races_found for report in race_reports)
    o_ref, final_ref = kda_reference(inputs, False)
    assert_matches("o", o, o_ref, jnp.float32)
    assert_matches("final_state", final_state, final_ref, jnp.float32)


# kda packed (tpu_pallas.varlen): T = 250 ragged in chunks of 64, two chunks per step, two heads
# shared by the two simulated cores; empty sequences first and inside, a one-token one, boundaries off the grid
# and on it (128), the last sequence ending in the ragged chunk; every sequence's initial state read and final
# state written by DMA (empty ones: set around the kernel).
KDA_PACKING = (0, 1, 70, 57, 0, 3, 119)


@pytest.mark.parametrize("seed", SEEDS[:1])
def test_kda_packed_faithful_interpreter_matches_reference(seed, race_reports, make_kda_inputs, assert_matches):
    inputs = make_kda_inputs(1, sum(KDA_PACKING), 2, 128, 128, jnp.float32, seed=seed, initial_state=False)
    inputs["initial_state"] = jnp.asarray(np.random.default_rng(seed).standard_normal((len(KDA_PACKING), 2, 128, 128)), jnp.float32)
    cu_seqlens = np.cumsum((0, *KDA_PACKING)).astype(np.int32)

    def call(inputs, cu_seqlens):
        with tops_core.use(interpret=True, strict=True):
            return tops_core.op("kda").forward(
                **inputs, cu_seqlens=cu_seqlens, output_final_state=True,
                implementation=("tpu_pallas.varlen", {"chunk_size": 64, "num_steps": 2, "interpret": faithful(seed)}),
            )

    o, final_state = jax.block_until_ready(jax.jit(call)(inputs, jnp.asarray(cu_seqlens)))
    assert len(race_reports) == 1
    assert not any(report.races_found for report in race_reports)
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        o_ref, final_ref = tops_core.op("kda").forward(
            **{name: jnp.asarray(np.asarray(x, np.float64)) for name, x in inputs.items()}, cu_seqlens=jnp.asarray(cu_seqlens),
            output_final_state=True, implementation="ref.recurrent",
        )
        o_ref, final_ref = np.asarray(o_ref), np.asarray(final_ref)
    finally:
        jax.config.update("jax_enable_x64", previous)
    assert_matches("o", o, o_ref, jnp.float32)
    assert_matches("final_state", final_state, final_ref, jnp.float32)


@pytest.mark.slow
def test_kda_packed_backward_faithful_interpreter_matches_reference(race_reports, make_kda_inputs, kda_gradients):
    # The packed backward's two kernels on KDA_PACKING: dS from each sequence's dht where it ends, dinitial_state
    # written by DMA where it starts, on two simulated cores with NaN-filled memory; every gradient against ref.recurrent's.
    seed = SEEDS[0]
    inputs = make_kda_inputs(1, sum(KDA_PACKING), 2, 128, 128, jnp.float32, seed=seed, initial_state=False)
    inputs["initial_state"] = jnp.asarray(np.random.default_rng(seed).standard_normal((len(KDA_PACKING), 2, 128, 128)), jnp.float32)
    cu_seqlens = jnp.asarray(np.cumsum((0, *KDA_PACKING)), jnp.int32)
    config = {"chunk_size": 64, "num_steps": 2, "interpret": faithful(seed)}
    got = kda_gradients(inputs, ("tpu_pallas.varlen", config), cu_seqlens=cu_seqlens)
    assert len(race_reports) >= 2 and not any(report.races_found for report in race_reports)
    want = kda_gradients(inputs, "ref.recurrent", cu_seqlens=cu_seqlens)
    for name in inputs:
        measurement = measure(f"d{name}", got[name], want[name], tolerance("float32", gradient=True))
        assert measurement.passed, measurement.describe()


@pytest.mark.parametrize("packing", [None, KDA_PACKING], ids=["unpacked", "packed"])
def test_kda_grouped_backward_faithful_interpreter_matches_reference(packing, race_reports, make_kda_inputs, kda_gradients):
    # Two value heads per query/key head: the gradients kernel walks each group inside a time step, dq and dk summed in
    # VMEM, each value head's dS its own, dht and dinitial_state blocks alternating between the group's heads (unpacked)
    # or moved by DMA (packed); ragged, two chunks per step, two simulated cores, NaN-filled memory.
    seed = SEEDS[0]
    B, T = (2, 250) if packing is None else (1, sum(packing))
    inputs = make_kda_inputs(B, T, 4, 128, 128, jnp.float32, seed=seed, initial_state=packing is None)
    inputs = {**inputs, "q": inputs["q"][:, :, ::2], "k": inputs["k"][:, :, ::2]}
    options = {}
    if packing is not None:
        inputs["initial_state"] = jnp.asarray(np.random.default_rng(seed).standard_normal((len(packing), 4, 128, 128)), jnp.float32)
        options["cu_seqlens"] = jnp.asarray(np.cumsum((0, *packing)), jnp.int32)
    kernel = "tpu_pallas.fused" if packing is None else "tpu_pallas.varlen"
    got = kda_gradients(inputs, (kernel, {"chunk_size": 64, "num_steps": 2, "interpret": faithful(seed)}), **options)
    assert len(race_reports) >= 2 and not any(report.races_found for report in race_reports)
    want = kda_gradients(inputs, "ref.recurrent", **options)
    for name in inputs:
        measurement = measure(f"d{name}", got[name], want[name], tolerance("float32", gradient=True))
        assert measurement.passed, measurement.describe()


@pytest.mark.parametrize("op", ["simple_gla", "kda"])
def test_packed_prefill_into_pool_rows_under_the_faithful_interpreter(op, race_reports, make_inputs, make_kda_inputs, assert_matches):
    # A packed prefill that reads and writes its sequences' pool rows by DMA, the next sequence's row read ahead while the
    # kernel works and each final row written while it goes on: an empty sequence (its row passes through), a padding
    # slot (no row), several sequences in one chunk, sequences across grid steps, a last step whose second chunk is past
    # the end (T=300: 5 chunks of 64, two a step), two simulated cores, NaN-filled memory.
    seed, seqlens, indices, pool_rows = SEEDS[0], (70, 0, 1, 57, 3, 169), (4, 0, 6, -1, 2, 5), 8
    T, H = sum(seqlens), 2
    if op == "simple_gla":
        arrays = make_inputs(1, T, H, 128, 128, jnp.float32, seed=seed, g=True)[0]
    else:
        arrays = make_kda_inputs(1, T, H, 128, 128, jnp.float32, seed=seed, initial_state=False)
    pool = jnp.asarray(np.random.default_rng(seed).standard_normal((pool_rows, H, 128, 128)), jnp.float32)
    cu_seqlens, indices = jnp.asarray(np.cumsum((0, *seqlens)), jnp.int32), jnp.asarray(indices, jnp.int32)

    def prefill(arrays, pool, implementation):
        return tops_core.op(op).forward(
            **arrays, initial_state=pool, cu_seqlens=cu_seqlens, ssm_state_indices=indices, output_final_state=True,
            implementation=implementation,
        )

    with tops_core.use(interpret=True, strict=True):
        config = {"chunk_size": 64, "num_steps": 2, "interpret": faithful(seed)}
        o, updated = jax.block_until_ready(prefill(arrays, pool, ("tpu_pallas.varlen", config)))
    assert race_reports and not any(report.races_found for report in race_reports)
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        as_float64 = {name: jnp.asarray(np.asarray(x, np.float64)) for name, x in arrays.items()}
        o_ref, updated_ref = (np.asarray(x) for x in prefill(as_float64, jnp.asarray(np.asarray(pool, np.float64)), "ref.recurrent"))
    finally:
        jax.config.update("jax_enable_x64", previous)
    assert_matches("o", o, o_ref, jnp.float32)
    assert_matches("pool", updated, updated_ref, jnp.float32)


@pytest.mark.parametrize("op_name, name, num_steps", [
    ("gla", "tpu_pallas.fused", 1), ("gla", "tpu_pallas.fused", 2), ("gated_delta_rule", "tpu_pallas.fused", 1),
    ("gla", "tpu_pallas.varlen", 1),
])
def test_states_walked_in_the_gradients_kernel_faithful_interpreter(op_name, name, num_steps, race_reports):
    # kda.backward where the gradients kernel walks its segment's states itself (walks_every_chunk false): gla's base case
    # (T=100, two chunks of 64) in two segments, the walk writing the first's end, and in one, no walk; gated_delta_rule's
    # (one chunk of 128) in one; gla's packed base (T=128, its sequences' states by DMA in both kernels) in two segments,
    # the walk over the first. Two simulated cores in a random order, NaN-filled memory; forward and every gradient
    # against the float64 reference through the kit.
    impl = next(i for i in tops_core.op(op_name).implementations() if i.name == name)
    case = next(c for c in case_grid(impl).supported if c.name == "base")
    config = (("interpret", faithful(SEEDS[0])), ("num_steps", num_steps))
    run_case(impl, dataclasses.replace(case, name=f"base-faithful-num_steps={num_steps}", config=config))
    assert len(race_reports) >= 2 and not any(report.races_found for report in race_reports)
