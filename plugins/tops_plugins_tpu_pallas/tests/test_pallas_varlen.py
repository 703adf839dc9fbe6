"""tpu_pallas.varlen, forward and backward, in the fast interpreter: packed sequences equal separate calls, one trace
for every packing, dispatch.

The conformance kit runs its packings against the float64 reference; these tests cover what is
particular to this kernel: packed results and gradients against separate per-sequence calls of the
fused kernel, boundaries in every position relative to chunks and grid steps, traced ``cu_seqlens``
under ``jit`` (one trace, any packing), and the dispatcher's choice on TPU, both directions.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tops_core
from tops_core.conformance.compare import measure, tolerance

from tops_plugins_tpu_pallas import VARLEN
from tops_plugins_tpu_pallas.simple_gla import varlen

sg = tops_core.op("simple_gla")

# Lengths packed along T = 300 (chunks of 64: 0..63, 64..127, ...): empty at token 0, in the middle
# and at the end; one-token sequences; boundaries inside chunks and on them (64, 128); one sequence over
# four chunks; a whole grid step of one-token sequences is not needed: a chunk of many short ones is.
PACKINGS = {
    "one-sequence": (300,),
    "chunk-aligned": (64, 64, 172),
    "anywhere": (0, 1, 70, 57, 0, 5, 1, 1, 1, 3, 161, 0),
    "long-then-short": (250, 1, 49),
}


def _packed(seqlens, dtype, *, seed=0, H=1, K=128, V=128):
    """Inputs of one packed call (float32 gates and states) and the boundaries."""
    rng = np.random.default_rng(seed)
    T, N = sum(seqlens), len(seqlens)
    inputs = {
        "q": jnp.asarray(rng.standard_normal((1, T, H, K)) * K**-0.5, dtype),
        "k": jnp.asarray(rng.standard_normal((1, T, H, K)) * K**-0.5, dtype),
        "v": jnp.asarray(rng.standard_normal((1, T, H, V)), dtype),
        "g": jnp.asarray(-np.logaddexp(0.0, -rng.standard_normal((1, T, H))) / 16, jnp.float32),
        "g_gamma": jnp.asarray(-(2.0 ** (-8.0 * np.arange(1, H + 1) / H)), jnp.float32),
        "initial_state": jnp.asarray(rng.standard_normal((N, H, K, V)), jnp.float32),
    }
    return inputs, np.cumsum((0, *seqlens)).astype(np.int32)


def _run_packed(inputs, cu_seqlens, **config):
    def call(inputs, cu_seqlens):
        with tops_core.use(interpret=True, strict=True):
            return sg.forward(**inputs, cu_seqlens=cu_seqlens, output_final_state=True, implementation=("tpu_pallas.varlen", config))

    return jax.jit(call)(inputs, jnp.asarray(cu_seqlens))


def _run_separately(inputs, cu_seqlens):
    """Each sequence alone through tpu_pallas.fused; an empty sequence keeps its initial state."""
    outputs, finals = [], []
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        if start == end:
            finals.append(inputs["initial_state"][n])
            continue
        piece = {name: x[:, start:end] for name, x in inputs.items() if name in ("q", "k", "v", "g")}
        with tops_core.use(interpret=True, strict=True), warnings.catch_warnings():
            warnings.simplefilter("ignore", tops_core.LayoutWarning)  # a one-token piece has T < H
            o, final = sg.forward(
                **piece, g_gamma=inputs["g_gamma"], initial_state=inputs["initial_state"][n : n + 1],
                output_final_state=True, implementation="tpu_pallas.fused",
            )
        outputs.append(o)
        finals.append(final[0])
    return jnp.concatenate(outputs, axis=1), jnp.stack(finals)


# Boundaries anywhere and on chunks by default; one sequence, a long one then short ones and bf16 with -m slow.
@pytest.mark.parametrize(
    ("packing", "dtype"),
    [(packing, jnp.float32) if packing in ("anywhere", "chunk-aligned") else pytest.param(packing, jnp.float32, marks=pytest.mark.slow)
     for packing in PACKINGS] + [pytest.param("anywhere", jnp.bfloat16, marks=pytest.mark.slow)],
    ids=[f"{packing}-f32" for packing in PACKINGS] + ["anywhere-bf16"],
)
def test_packed_equals_separate_calls(packing, dtype, assert_matches):
    inputs, cu_seqlens = _packed(PACKINGS[packing], dtype)
    o, final_state = _run_packed(inputs, cu_seqlens, chunk_size=64, num_steps=2)
    o_alone, final_alone = _run_separately(inputs, cu_seqlens)
    assert_matches("o", o, o_alone, dtype)
    assert_matches("final_state", final_state, final_alone, dtype)


def _cotangents(inputs, seed=7):
    """``do`` and a float32 ``dht`` for every sequence."""
    rng = np.random.default_rng(seed)
    N, H, K, V = inputs["initial_state"].shape
    do = jnp.asarray(rng.standard_normal(inputs["v"].shape), inputs["v"].dtype)
    return do, jnp.asarray(rng.standard_normal((N, H, K, V)), jnp.float32)


def _packed_gradients(inputs, cu_seqlens, do, dht, compiler_options=None, **config):
    def call(inputs, cu_seqlens):
        with tops_core.use(interpret=True, strict=True):
            _, vjp = jax.vjp(
                lambda a: sg.forward(**a, cu_seqlens=cu_seqlens, output_final_state=True, implementation=("tpu_pallas.varlen", config)),
                inputs,
            )
            return vjp((do, dht))[0]

    return jax.jit(call, compiler_options=compiler_options)(inputs, jnp.asarray(cu_seqlens))


def _gradients_separately(inputs, cu_seqlens, do, dht, implementation="tpu_pallas.fused"):
    """Each sequence alone through ``implementation`` and its own backward; an empty sequence passes dht to its initial state."""
    tokens = {name: [] for name in ("q", "k", "v", "g")}
    dg_gamma, dinitial_state = 0.0, []
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        if start == end:
            dinitial_state.append(dht[n])
            continue
        piece = {name: x[:, start:end] for name, x in inputs.items() if name in tokens}
        piece.update(g_gamma=inputs["g_gamma"], initial_state=inputs["initial_state"][n : n + 1])
        with tops_core.use(interpret=True, strict=True), warnings.catch_warnings():
            warnings.simplefilter("ignore", tops_core.LayoutWarning)  # a one-token piece has T < H
            _, vjp = jax.vjp(lambda a: sg.forward(**a, output_final_state=True, implementation=implementation), piece)
            grads = vjp((do[:, start:end], dht[n : n + 1]))[0]
        for name in tokens:
            tokens[name].append(grads[name])
        dg_gamma = dg_gamma + grads["g_gamma"]
        dinitial_state.append(grads["initial_state"][0])
    alone = {name: jnp.concatenate(x, axis=1) for name, x in tokens.items()}
    return {**alone, "g_gamma": dg_gamma, "initial_state": jnp.stack(dinitial_state)}


def _assert_gradients_match(grads, want, dtype):
    for name, x in want.items():
        measurement = measure(f"d{name}", grads[name], x, tolerance(jnp.dtype(dtype).name, gradient=True))
        assert measurement.passed, measurement.describe()


# Slow (each separate length compiles its own programs): the default run checks packed gradients against the
# reference through the kit (empty and one-token sequences, boundaries inside chunks and on their edges), and
# that backward segments change no bit (test_backward_segments_do_not_change_a_bit, below).
@pytest.mark.slow
@pytest.mark.parametrize(
    ("packing", "dtype"),
    [(packing, jnp.float32) for packing in PACKINGS] + [("anywhere", jnp.bfloat16)],
    ids=[f"{packing}-f32" for packing in PACKINGS] + ["anywhere-bf16"],
)
def test_packed_gradients_equal_separate_calls(packing, dtype):
    # Every gradient, dht given for every sequence. 5 chunks of 64 in one backward segment: the states of
    # the segment's chunks are recomputed from its checkpoint, pieces of several sequences among them.
    # bf16 over 4 heads (the next test has one head with the weakest decay).
    inputs, cu_seqlens = _packed(PACKINGS[packing], dtype, H=1 if dtype == jnp.float32 else 4)
    do, dht = _cotangents(inputs)
    grads = _packed_gradients(inputs, cu_seqlens, do, dht, chunk_size=64, backward_num_steps=5)
    _assert_gradients_match(grads, _gradients_separately(inputs, cu_seqlens, do, dht), dtype)


# The kit's bfloat16-weak cases run the packed kernel's by default (8 s here): every kernel with -m slow.
@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["varlen", "separate fused", "separate chunk"])
def test_bf16_decay_gradient_under_a_weak_decay(kernel, reference_gradients):
    # One head, g_gamma = -2**-8, g ~ -0.05, 12 sequences: dg_gamma sums per-token terms that nearly cancel. With
    # one bf16 pass for the state products every backward missed it by 0.21 to 0.27; their float32 operands now
    # go in as two bf16 parts (gradients.decay_gradient_operands).
    inputs, cu_seqlens = _packed(PACKINGS["anywhere"], jnp.bfloat16)
    do, dht = _cotangents(inputs)
    if kernel == "varlen":
        grads = _packed_gradients(inputs, cu_seqlens, do, dht, chunk_size=64, backward_num_steps=5)
    else:
        grads = _gradients_separately(inputs, cu_seqlens, do, dht, implementation="tpu_pallas." + kernel.split()[1])
    ref_inputs = {name: np.asarray(x, np.float64) for name, x in inputs.items()}
    want = reference_gradients({**ref_inputs, "cu_seqlens": cu_seqlens}, do, dht)
    _assert_gradients_match(grads, want, jnp.bfloat16)


@pytest.mark.slow  # 10 s; the fused backward's segments are checked bit for bit by default (test_pallas_backward.py)
@pytest.mark.parametrize(("chunk_size", "chunks"), [(64, 5), (64, 2), (128, 3)])
def test_backward_segments_do_not_change_a_bit(chunk_size, chunks, default_cpu_emitters):
    # The backward's segment (1 chunk or several) changes where states are checkpointed, not one result. Chunks of 64
    # walk pieces of g's columns, chunks of 128 fused's walk on the reset gates' rows; 5 chunks of 64 in segments of 2
    # end with one past T = 300, a chunk of no sequence.
    inputs, cu_seqlens = _packed(PACKINGS["anywhere"], jnp.float32, seed=2)
    do, dht = _cotangents(inputs)
    one = _packed_gradients(inputs, cu_seqlens, do, dht, default_cpu_emitters, chunk_size=chunk_size, backward_num_steps=1)
    for name, x in _packed_gradients(inputs, cu_seqlens, do, dht, default_cpu_emitters, chunk_size=chunk_size, backward_num_steps=chunks).items():
        np.testing.assert_array_equal(x, one[name], err_msg=name)


@pytest.mark.parametrize("decay", ["g_gamma", "none"])
def test_packed_gradients_without_states_or_g_match_the_reference(decay, reference_gradients):
    # No g and no state in or out, the usual training call of a constant decay: fused's kernels on the reset gates (zeros
    # but -inf where each sequence starts), dg_gamma the sum of their per-token gradients (exactly 0 at the resets).
    # Chunks of 64 in segments of 2: the checkpoints walk runs, and the last segment runs past T = 300 (5 chunks).
    packed, cu_seqlens = _packed(PACKINGS["anywhere"], jnp.float32, seed=4, H=2)
    inputs = {name: packed[name] for name in ("q", "k", "v")}
    if decay == "g_gamma":
        inputs["g_gamma"] = jnp.asarray([-1.0, -0.05], jnp.float32)  # a strong decay and a weak one
    do = jnp.asarray(np.random.default_rng(5).standard_normal(inputs["v"].shape), jnp.float32)

    def gradients(inputs, cu_seqlens):
        with tops_core.use(interpret=True, strict=True):
            implementation = ("tpu_pallas.varlen", dict(chunk_size=64, backward_num_steps=2))
            _, vjp = jax.vjp(lambda a: sg.forward(**a, cu_seqlens=cu_seqlens, implementation=implementation)[0], inputs)
            return vjp(do)[0]

    grads = jax.jit(gradients)(inputs, jnp.asarray(cu_seqlens))
    ref_inputs = {name: np.asarray(x, np.float64) for name, x in inputs.items()}
    _assert_gradients_match(grads, reference_gradients({**ref_inputs, "cu_seqlens": cu_seqlens}, do, None), jnp.float32)


def test_packed_matches_the_reference_at_chunk_128_lane_padded(make_inputs, reference, assert_matches):
    # K = 100, V = 200 go through the lane padding copy; chunk 128 with one chunk per grid step.
    seqlens = PACKINGS["anywhere"]
    inputs, cu_seqlens = _packed(seqlens, jnp.float32, seed=1, H=2, K=100, V=200)
    o, final_state = _run_packed(inputs, cu_seqlens, chunk_size=128, num_steps=1)
    ref_inputs = {name: np.asarray(x, np.float64) for name, x in inputs.items()}
    o_ref, final_ref = reference({**ref_inputs, "cu_seqlens": cu_seqlens})
    assert_matches("o", o, o_ref, jnp.float32)
    assert_matches("final_state", final_state, final_ref, jnp.float32)


def test_packed_gradients_match_the_reference_at_chunk_128_lane_padded(reference_gradients):
    # K = 100, V = 200 (lane padding copies of dht, initial_state and dinitial_state), 3 chunks of 128, one per segment.
    inputs, cu_seqlens = _packed(PACKINGS["anywhere"], jnp.float32, seed=3, H=2, K=100, V=200)
    do, dht = _cotangents(inputs)
    grads = _packed_gradients(inputs, cu_seqlens, do, dht, chunk_size=128, backward_num_steps=1)
    ref_inputs = {name: np.asarray(x, np.float64) for name, x in inputs.items()}
    _assert_gradients_match(grads, reference_gradients({**ref_inputs, "cu_seqlens": cu_seqlens}, do, dht), jnp.float32)


def test_one_trace_serves_every_packing_of_the_same_sizes(assert_matches):
    # cu_seqlens are traced scalars: packings of the same T and N reuse one trace (one compile on TPU).
    traces = []

    def call(inputs, cu_seqlens):
        traces.append(None)
        with tops_core.use(interpret=True, strict=True):
            return sg.forward(**inputs, cu_seqlens=cu_seqlens, output_final_state=True, implementation="tpu_pallas.varlen")

    jitted = jax.jit(call)
    inputs, _ = _packed((100, 100, 100), jnp.float32)
    for seqlens in ((100, 100, 100), (0, 299, 1), (300, 0, 0)):
        cu_seqlens = jnp.asarray(np.cumsum((0, *seqlens)), jnp.int32)
        o, final_state = jitted(inputs, cu_seqlens)
        o_xla, final_xla = sg.forward(**inputs, cu_seqlens=cu_seqlens, output_final_state=True, implementation="xla.chunk")
        assert_matches("o", o, o_xla, jnp.float32)
        assert_matches("final_state", final_state, final_xla, jnp.float32)
    assert len(traces) == 1


def test_one_gradient_trace_serves_every_packing_of_the_same_sizes():
    traces = []

    def gradients(inputs, cu_seqlens, do, dht, implementation):
        traces.append(implementation)
        with tops_core.use(interpret=True, strict=True):
            _, vjp = jax.vjp(
                lambda a: sg.forward(**a, cu_seqlens=cu_seqlens, output_final_state=True, implementation=implementation), inputs,
            )
            return vjp((do, dht))[0]

    jitted = jax.jit(gradients, static_argnums=4)
    inputs, _ = _packed((100, 100, 100), jnp.float32)
    do, dht = _cotangents(inputs)
    for seqlens in ((100, 100, 100), (0, 299, 1), (300, 0, 0)):
        cu_seqlens = jnp.asarray(np.cumsum((0, *seqlens)), jnp.int32)
        grads = jitted(inputs, cu_seqlens, do, dht, "tpu_pallas.varlen")
        _assert_gradients_match(grads, jitted(inputs, cu_seqlens, do, dht, "xla.chunk"), jnp.float32)
    assert traces.count("tpu_pallas.varlen") == 1


def test_chunks_know_the_sequences_they_overlap():
    # T = 200 in chunks of 64: tokens 0..63, 64..127, 128..191, 192..199. Empty sequences (1, 3, 5) hold no token.
    cu_seqlens = jnp.asarray([0, 64, 64, 70, 70, 199, 199, 200], jnp.int32)
    first, last = varlen.sequences_of_chunks(cu_seqlens, 200, 64)
    assert first.tolist() == [0, 2, 4, 4]
    assert last.tolist() == [0, 4, 4, 6]


def _packed_spec(platform="tpu", features=frozenset({"g_gamma", "cu_seqlens"})):
    return tops_core.CallSpec(
        op="simple_gla", platform=platform, dtype="bfloat16", batch=1, seq_len=8192, heads=16,
        key_dim=128, value_dim=128, num_seqs=16, features=features, ndims={"g_gamma": 1},
    )


def test_a_packed_call_on_tpu_picks_varlen_and_says_why():
    for direction in ("forward", "backward"):  # its own backward: nothing else is paired with it
        decision = sg.decide(_packed_spec(), direction)
        assert decision.implementation.name == "tpu_pallas.varlen"
        assert "the one Pallas kernel that takes cu_seqlens" in decision.explain()
    # fused and chunk do not declare cu_seqlens; varlen requires it, so an unpacked call never picks it.
    unpacked = sg.decide(_packed_spec(features=frozenset({"g_gamma"})))
    assert unpacked.implementation.name in ("tpu_pallas.fused", "tpu_pallas.chunk")
    assert any("requires cu_seqlens" in reason for reason in VARLEN.capabilities.reasons(_packed_spec(features=frozenset({"g_gamma"}))))


def test_the_public_op_compiles_the_kernel_where_lowered_for_tpu():
    inputs, cu_seqlens = _packed((0, 70, 130), jnp.bfloat16)

    def forward(inputs, cu_seqlens):
        return sg.forward(**inputs, cu_seqlens=cu_seqlens, output_final_state=True, implementation="tpu_pallas.varlen")

    traced = jax.jit(forward).trace(inputs, jnp.asarray(cu_seqlens))
    assert traced.lower(lowering_platforms=("tpu",)).as_text().count("tpu_custom_call") == 1
