"""simple_gla's xla.chunk on gates of -inf and on packed sequences, against the float64 reference.

Cases go through the conformance kit: ``run_case`` where the kit's data has them, else the kit's
own ``compare`` on inputs made here (gates of -inf in ``g`` at chosen tokens, with packing).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tops_core
from tops_core.conformance import checks, data
from tops_core.conformance.cases import Case
from tops_plugins_xla.simple_gla import chunk, packed

IMPL = "xla.chunk"
SG = tops_core.op("simple_gla")
BASE = Case("simple_gla", "packed", dtype="float32", key_dim=32, value_dim=16, heads=2, scale=0.37)
STATES = frozenset({"initial_state", "output_final_state"})
# Empty and one-token sequences, boundaries off the chunk grid of 64, sequences longer than a piece.
MANY = (0, 1, 0, 150, 3, 1, 70, 0, 5, 2, 60, 8)


def packed_case(name, seqlens, gates=("g",), states=STATES, **changes):
    features = frozenset(gates) | states | {"cu_seqlens"}
    return BASE.with_features(name, features, batch=1, seqlens=tuple(seqlens), seq_len=sum(seqlens), **changes)


def implementation():
    return next(impl for impl in SG.implementations() if impl.name == IMPL)


def assert_matches_the_reference(case, inputs):
    """Forward and every gradient of xla.chunk and the reference on ``inputs``, at the case's tolerances."""
    backward_inputs = data.backward_inputs(case, inputs)
    results = []
    for name in (IMPL, checks.REFERENCE):
        with tops_core.use(strict=True):
            results.append((SG.forward(**inputs, implementation=name), SG.backward(**backward_inputs, implementation=name)))
    measurements = checks.compare(case, *results)
    assert all(m.passed for m in measurements), "\n".join(m.describe() for m in measurements)
    return results[0]


def with_minus_inf(inputs, name, index):
    array = np.asarray(inputs[name]).copy()
    array[index] = -np.inf
    return {**inputs, name: jnp.asarray(array, inputs[name].dtype)}


# -- gates of -inf ------------------------------------------------------------------------------


def test_minus_inf_in_g_at_chunk_starts_ends_and_in_a_row_gives_the_reference():
    """The kit's reset tokens on the chunk grid of 64, in both rows, one head each, and token 100 everywhere."""
    case = BASE.with_features("dense-reset", frozenset({"g"}) | STATES, batch=2, seq_len=200)
    inputs = data.forward_inputs(case)
    for row, head, token in ((0, 0, 0), (1, 1, 37), (1, 1, 38), (0, 1, 63), (1, 0, 64), (0, 0, 128), (1, 1, 199)):
        inputs = with_minus_inf(inputs, "g", (row, token, head))
    inputs = with_minus_inf(inputs, "g", (slice(None), 100))
    _, grads = assert_matches_the_reference(case, inputs)
    cut = np.isinf(np.asarray(inputs["g"]))
    np.testing.assert_array_equal(np.asarray(grads.dg)[cut], 0.0)


@pytest.mark.parametrize("seqlens", [MANY, (64, 200, 1, 0)], ids=["stream", "own-chunks"])
def test_minus_inf_in_g_with_packed_sequences_gives_the_reference(seqlens):
    """Cuts at a sequence's first token, inside one, on the chunk grid and at the call's last token."""
    case = packed_case("packed-reset", seqlens)
    inputs = data.forward_inputs(case)
    longest = int(np.argmax(seqlens))
    start = int(np.cumsum((0,) + seqlens)[longest])
    for token in (start, start + 5, 64, 65, case.seq_len - 1):
        inputs = with_minus_inf(inputs, "g", (0, token, token % 2))
    _, grads = assert_matches_the_reference(case, inputs)
    cut = np.isinf(np.asarray(inputs["g"]))
    np.testing.assert_array_equal(np.asarray(grads.dg)[cut], 0.0)


def test_minus_inf_in_g_gamma_beside_g_gives_the_reference():
    case = BASE.with_features("both-gates", frozenset({"g", "g_gamma"}) | STATES, batch=2, seq_len=130)
    inputs = data.forward_inputs(case)
    inputs["g_gamma"] = jnp.asarray([-np.inf, -0.2], jnp.float32)
    assert_matches_the_reference(case, inputs)


@pytest.mark.parametrize("seqlens", [MANY, (64, 200, 1, 0)], ids=["stream", "own-chunks"])
@pytest.mark.parametrize("ndim", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_g_gamma_of_minus_inf_with_packed_sequences(seqlens, ndim):
    case = dataclasses.replace(packed_case("packed-reset-g_gamma", seqlens, gates=("g_gamma",), reset=True), ndims=(("g_gamma", ndim),))
    checks.run_case(implementation(), case)


# -- packed sequences -------------------------------------------------------------------------------


STATE_OPTIONS = {"no-states": frozenset(), "initial": frozenset({"initial_state"}), "final": frozenset({"output_final_state"}),
                 "both": STATES}
GATE_OPTIONS = {"g": ("g",), "g_gamma": ("g_gamma",), "no-gate": ()}
# The default run takes each gate option and each state option once; the rest of the grid is slow.
DEFAULT_RUN = {("g", "both"), ("g_gamma", "no-states"), ("no-gate", "final"), ("g_gamma", "initial")}


@pytest.mark.parametrize("gates, states", [
    pytest.param(gates, states, id=f"{gates}-{states}", marks=() if (gates, states) in DEFAULT_RUN else pytest.mark.slow)
    for gates in GATE_OPTIONS for states in STATE_OPTIONS
])
def test_many_short_sequences_give_the_reference(gates, states):
    """Twelve sequences in 300 tokens run as one stream, the states' terms over pieces (past the first ones too)."""
    checks.run_case(implementation(), packed_case("many", MANY, gates=GATE_OPTIONS[gates], states=STATE_OPTIONS[states]))


@pytest.mark.parametrize("dtype", [pytest.param("float64", marks=pytest.mark.slow), "bfloat16"])
def test_many_short_sequences_in_other_dtypes(dtype):
    checks.run_case(implementation(), packed_case("many", MANY, dtype=dtype))


def test_packed_without_states_runs_one_stream_of_regular_chunks():
    """The chunks of a packed call do not depend on the number of sequences (they were ``T // C + N``)."""
    T, N, C = 256, 100, 16
    q = jnp.zeros((1, T, 1, 4))
    cu_seqlens = jnp.asarray(np.linspace(0, T, N + 1).astype(np.int32))
    layouts = []

    def prepare(cu_seqlens):  # traced, not run: only the static layout is read
        layouts.append(chunk._chunked(q, q, q, None, jnp.zeros((1,)), None, cu_seqlens, 1.0, C, with_states=False))
        return cu_seqlens

    jax.make_jaxpr(prepare)(cu_seqlens)
    x, = layouts
    assert x.layout.num_chunks == T // C
    assert x.packed is not None


def test_few_sequences_with_states_keep_chunks_of_their_own():
    assert chunk._sequences_own_chunks(4096, 64, 64, with_states=True)
    assert not chunk._sequences_own_chunks(4096, 65, 64, with_states=True)
    assert not chunk._sequences_own_chunks(4096, 1, 64, with_states=False)


def test_traced_boundaries_compile_once_for_every_packing_of_the_same_t_and_n():
    case = packed_case("traced", MANY)
    inputs = data.forward_inputs(case)
    traces = []

    @jax.jit
    def loss(q, cu_seqlens):
        traces.append(None)
        o, ht = SG.forward(**{**inputs, "q": q, "cu_seqlens": cu_seqlens}, implementation=IMPL)
        return jnp.sum(o**2) + jnp.sum(ht**2)

    step = jax.jit(jax.value_and_grad(loss))
    for seqlens in (MANY, tuple(reversed(MANY)), (25,) * 12):
        cu_seqlens = jnp.asarray(np.cumsum((0,) + seqlens), jnp.int32)
        value, dq = step(inputs["q"], cu_seqlens)
        with tops_core.use(strict=True):
            want = jax.value_and_grad(lambda q: jnp.sum(SG.forward(
                **{**inputs, "q": q, "cu_seqlens": cu_seqlens}, implementation=checks.REFERENCE)[0] ** 2) + jnp.sum(
                SG.forward(**{**inputs, "q": q, "cu_seqlens": cu_seqlens}, implementation=checks.REFERENCE)[1] ** 2))(inputs["q"])
        np.testing.assert_allclose(value, want[0], rtol=1e-5)
        np.testing.assert_allclose(dq, want[1], rtol=1e-4, atol=1e-5)
    assert len(traces) == 1


# -- the pieces -----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [pytest.param(1, marks=pytest.mark.slow), 3, pytest.param(8, marks=pytest.mark.slow), 512])
def test_state_terms_equal_plain_sums_over_each_sequence(monkeypatch, size):
    """With no decay, ``o_i += q_i h0_n`` and ``final_n = h0_n + sum_j k_j^T v_j``, whatever the piece size
    (small ones send most tokens through the loop over the pieces past each sequence's first)."""
    monkeypatch.setattr(packed, "piece_size", lambda num_tokens, num_sequences: size)
    rng = np.random.default_rng(0)
    cu = np.cumsum((0,) + MANY)
    T, N, H, K, V = cu[-1], len(MANY), 2, 3, 4
    q, k, v = rng.normal(size=(1, T, H, K)), rng.normal(size=(1, T, H, K)), rng.normal(size=(1, T, H, V))
    h0 = rng.normal(size=(N, H, K, V))

    @jax.jit
    def terms(q, k, v, h0, cu_seqlens):
        states = packed.packed_states(jnp.zeros((1, T, H)), cu_seqlens)
        return states.initial_state_outputs(q, h0), states.final_states(k, v, h0)

    outputs, finals = terms(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, h0)), jnp.asarray(cu, jnp.int32))
    for n, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        np.testing.assert_allclose(outputs[0, start:end], np.einsum("thk,hkv->thv", q[0, start:end], h0[n]), rtol=1e-5, atol=1e-5)
        want = h0[n] + np.einsum("thk,thv->hkv", k[0, start:end], v[0, start:end])
        np.testing.assert_allclose(finals[n], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens", [5, 64, 200, pytest.param(4200, marks=pytest.mark.slow)])
@pytest.mark.parametrize("reverse", [False, True])
def test_segment_cumsum_sums_each_segment_alone(num_tokens, reverse):
    """4200 tokens take three levels of blocks. The first segment is huge: a sum over the whole
    stream would carry its rounding into the later segments, which must come out as exact as alone."""
    rng = np.random.default_rng(num_tokens)
    x = rng.normal(size=(1, num_tokens, 2)).astype(np.float32)
    first = rng.random(num_tokens) < 0.1
    first[0 if not reverse else -1] = True
    cut = num_tokens // 3
    head = slice(0, cut) if not reverse else slice(num_tokens - cut, num_tokens)
    x[0, head] *= 1e6
    (first if not reverse else first[::-1])[cut] = True  # the huge segment ends there
    got = np.asarray(packed._segment_cumsum(jnp.asarray(x), jnp.asarray(first), reverse=reverse))

    order = np.arange(num_tokens)[::-1] if reverse else np.arange(num_tokens)
    want, running = np.zeros((num_tokens, 2)), np.zeros(2)
    for t in order:
        running = x[0, t].astype(np.float64) + (0 if first[t] else running)
        want[t] = running
    later = np.ones(num_tokens, bool)
    later[head] = False
    np.testing.assert_allclose(got[0][later], want[later], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got[0][head], want[head], rtol=1e-5, atol=2.0)  # float32 sums of terms near 1e6
