"""Gates of ``-inf`` (``exp(-inf) = 0``: the state is reset there) in every kernel, in the fast interpreter.

The conformance kit's ``reset-g`` and ``reset-g_gamma`` cases run each kernel at its default config
against the float64 reference; these tests cover the rest: the chunk math against the decays'
definition (sums of the gates over each span, so a span holding a ``-inf`` decays to exactly 0), the
configs the kit does not reset (fused at chunks 64 and 256, whose gates are columns and 2 x 2
blocks of rows, the chunk kernel at 64, varlen's boundaries on a reset, a scalar ``g_gamma`` of
``-inf``), and that the decay gradient at a ``-inf`` gate is exactly 0, the reference's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tops_core
from tops_core.conformance.compare import measure, tolerance

from tops_plugins_tpu_pallas.exponents import RESET_LOG_DECAY
from tops_plugins_tpu_pallas.kda import chunkwise as kda_chunkwise
from tops_plugins_tpu_pallas.simple_gla import chunkwise, fused, varlen

sg = tops_core.op("simple_gla")


def _gates_with_resets(size: int, resets, seed: int = 0) -> np.ndarray:
    """Mild float32 gates ``(size,)`` (no decay underflows to 0 by itself), ``-inf`` at the tokens ``resets``."""
    g = -np.random.default_rng(seed).exponential(0.05, size).astype(np.float32)
    g[list(resets)] = -np.inf
    return g


def _defined_decays(decay: float, g: np.ndarray, valid_rows: int | None):
    """The chunk's decays from their definition, in float64: ``exp`` of the gates summed over each span.

    ``a_t = g_t + decay`` for the real tokens (none past ``valid_rows``); ``D_ij = exp(a_{j+1} + ... + a_i)``
    for ``j <= i``, the query decays ``exp(a_0 + ... + a_i)``, the key decays ``exp(a_{j+1} + ... + a_C)``
    and the chunk's ``exp(a_0 + ... + a_C)``: a span holding a ``-inf`` sums to ``-inf``, whose ``exp`` is 0.
    """
    size = g.shape[0]
    a = g.astype(np.float64) + decay
    if valid_rows is not None:
        a[valid_rows:] = 0.0
    spans = np.full((size + 1, size + 1), -np.inf)  # spans[j + 1, i + 1]: the sum of a over (j, i]
    for start in range(size + 1):
        spans[start, start:] = np.concatenate([[0.0], np.cumsum(a[start:])])
    decays = np.exp(spans[1:, 1:].T)  # (i, j); -inf above the diagonal
    return decays, np.exp(spans[0, 1:])[:, None], np.exp(spans[1:, size])[:, None], np.exp(spans[0, size])


RESETS = (0, 37, 38, 127, 128, 200, 255)  # the first token, two in a row, the last of a 128-block and the next, the last


@pytest.mark.parametrize(("size", "valid_rows"), [(64, None), (128, 100), (256, None), (256, 201)])
@pytest.mark.parametrize("along_lanes", [False, True], ids=["columns", "rows"])
def test_gates_are_the_definitions_and_exactly_zero_across_a_reset(size, valid_rows, along_lanes):
    g = _gates_with_resets(size, [t for t in RESETS if t < min(size, valid_rows or size)])
    if valid_rows is not None:
        g[valid_rows:] = 0.0  # as Chunk.read leaves a ragged chunk's rows past the end
    valid = None if valid_rows is None else jnp.int32(valid_rows)
    decay = jnp.float32(-0.01)
    if along_lanes:
        gates = chunkwise.ChunkGates.along_lanes(decay, jnp.asarray(g)[None, :], [valid])[0].with_decays()
        key = gates.key_row.T
    else:
        gates = chunkwise.ChunkGates.compute(decay, jnp.asarray(g)[:, None], valid, size)
        key = gates.key
    for name, got, want in zip(("decays", "query", "key", "chunk"), (gates.decays, gates.query, key, gates.chunk), _defined_decays(-0.01, g, valid_rows)):
        got = np.asarray(got, np.float64)
        np.testing.assert_array_equal(got == 0, want == 0, err_msg=name)  # zeros exactly where a reset (or the causal mask) is
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=0, err_msg=name)  # float32 differences of sums up to -15


@pytest.mark.parametrize(("size", "valid_rows"), [(64, None), (128, 100), (256, None), (256, 201)])
def test_a_constant_decays_gates_cut_at_sequence_starts_are_its_reset_gates_bit_for_bit(size, valid_rows):
    # The packed backward without g (backward_fused, ChunkGates.cut_at): g_gamma's gates cut where sequences start are
    # those exponentiated from the reset gates (0, -inf at each start), and the decays' definition.
    starts = np.zeros(size, bool)
    starts[[t for t in RESETS if t < min(size, valid_rows or size)]] = True
    g = np.where(starts, -np.inf, 0.0).astype(np.float32)
    valid = None if valid_rows is None else jnp.int32(valid_rows)
    decay = jnp.float32(-0.01)
    cuts = varlen.sequence_cuts(jnp.asarray(starts), size, 1)
    cut = chunkwise.ChunkGates.compute(decay, None, valid, size).cut_at(
        cuts["first_starts"][0], cuts["last_starts"][0], cuts["next_starts"],
    ).with_decays()
    reset = chunkwise.ChunkGates.compute(decay, jnp.asarray(g)[:, None], valid, size)
    for name, want in zip(("decays", "query", "key", "chunk"), _defined_decays(-0.01, g, valid_rows)):
        np.testing.assert_array_equal(getattr(cut, name), getattr(reset, name), err_msg=name)
        np.testing.assert_allclose(np.asarray(getattr(cut, name), np.float64), want, rtol=1e-5, atol=0, err_msg=name)


def test_sequence_cuts_give_each_chunk_its_starts_and_each_token_the_next_start_in_its_chunk():
    T, chunk, chunks = 300, 64, 6  # the sixth chunk lies past T, as a grid's padded last step's may
    starts = np.zeros(T, bool)
    starts[[0, 1, 63, 64, 70, 71, 72, 191, 299]] = True
    cuts = {name: np.asarray(x) for name, x in varlen.sequence_cuts(jnp.asarray(starts), chunk, chunks).items()}
    for c in range(chunks):
        positions = [t - c * chunk for t in range(c * chunk, min(c * chunk + chunk, T)) if starts[t]]
        assert (cuts["first_starts"][c], cuts["last_starts"][c]) == (min(positions, default=chunk), max(positions, default=0)), c
    for t in range(T):
        end = min(t // chunk * chunk + chunk, T)
        after = [u for u in range(t + 1, end) if starts[u]]
        assert cuts["next_starts"][0, t] == (after[0] - t // chunk * chunk if after else chunk), t


@pytest.mark.parametrize(("size", "valid_rows"), [(128, None), (256, None), (256, 201)])
def test_reset_counts_held_in_bfloat16_give_the_same_gates_bit_for_bit(size, valid_rows):
    # fused.resets_dtype: v6e's forward holds R's column in bfloat16 for the masks; a count of at most 256 is exact there.
    g = _gates_with_resets(size, [t for t in RESETS if t < min(size, valid_rows or size)] + list(range(140, min(size, 200))))
    if valid_rows is not None:
        g[valid_rows:] = 0.0
    valid = None if valid_rows is None else jnp.int32(valid_rows)
    held = [chunkwise.ChunkGates.along_lanes(jnp.float32(-0.01), jnp.asarray(g)[None, :], [valid], dtype)[0].with_decays() for dtype in (jnp.float32, jnp.bfloat16)]
    for name in ("decays", "query", "chunk"):
        np.testing.assert_array_equal(getattr(held[1], name), getattr(held[0], name), err_msg=name)


def test_the_forward_holds_reset_counts_in_bfloat16_where_it_measured_faster():
    assert fused.resets_dtype("v6e") == jnp.bfloat16
    for chip in ("v4", "v5e", "v5p", None):
        assert fused.resets_dtype(chip) == jnp.float32


@pytest.mark.parametrize("valid_rows", [None, 90])
def test_a_constant_decay_of_minus_inf_resets_at_every_token(valid_rows):
    size = 128
    valid = None if valid_rows is None else jnp.int32(valid_rows)
    decay = chunkwise.constant_decay({"decay": jnp.asarray([-jnp.inf], jnp.float32)}, 0)  # as the kernels read it from SMEM
    gates = chunkwise.ChunkGates.compute(decay, None, valid, size)
    last = size - 1 if valid_rows is None else valid_rows - 1
    real = last + 1
    np.testing.assert_array_equal(gates.decays[:real, :real], np.eye(real))  # each token keeps only its own key-value product
    np.testing.assert_array_equal(gates.query, 0.0)
    np.testing.assert_array_equal(gates.key[:, 0], np.arange(size) >= last)  # the last real token's (rows past it are zero)
    np.testing.assert_array_equal(gates.chunk, 0.0)


def test_the_cumulative_sums_count_the_resets_exactly():
    size = 128
    g = _gates_with_resets(size, RESETS[:4])
    finite, resets = chunkwise.cumulative_sum(jnp.asarray(g)[:, None])
    np.testing.assert_array_equal(resets[:, 0], np.cumsum(np.isneginf(g)))
    exact = np.cumsum(np.where(np.isneginf(g), 0.0, g.astype(np.float64)))
    np.testing.assert_allclose(finite[:, 0], exact, rtol=size * np.finfo(np.float32).eps)
    # Along lanes, a step's chunks at once (three here, so the stacked parts are padded to whole tiles): each row as its column.
    rows = np.stack([g, np.roll(g, 50), -g[::-1]])
    row_finite, row_resets = chunkwise.cumulative_sums_along_lanes(jnp.asarray(rows))
    for row, row_sums, row_counts in zip(rows, row_finite, row_resets):
        column_sums, column_counts = chunkwise.cumulative_sum(jnp.asarray(row)[:, None])
        np.testing.assert_array_equal(row_counts, column_counts[:, 0])
        np.testing.assert_allclose(row_sums, column_sums[:, 0], rtol=1e-6)


@pytest.mark.parametrize("counts_resets", [True, False], ids=["any gates", "finite gates"])
def test_a_steps_log_decays_from_rows_are_each_chunks_own(counts_resets):
    # gated_delta_rule's factors take a grid step's log decays at once from its chunks' rows (LogDecays.of_rows).
    size = 128
    g = _gates_with_resets(size, RESETS[:4] if counts_resets else ())
    rows = np.stack([g, np.roll(g, 50), -np.abs(g[::-1]), np.zeros_like(g)])
    for row, log in zip(rows, chunkwise.LogDecays.of_rows(jnp.asarray(rows), counts_resets)):
        own = chunkwise.LogDecays.compute(0.0, jnp.asarray(row)[:, None], None, size, counts_resets)
        np.testing.assert_allclose(log.column, own.column, rtol=1e-6)
        np.testing.assert_allclose(log.row, own.row, rtol=1e-6)
        # B_i - B_i is exactly 0 on the decays' diagonal: the column is the row's values, bit for bit.
        np.testing.assert_array_equal(log.column[:, 0], log.row[0])
        if counts_resets:
            np.testing.assert_array_equal(log.resets_column, own.resets_column)
            np.testing.assert_array_equal(log.resets_row, own.resets_row)
        else:
            assert log.resets_column is None and log.resets_row is None


@pytest.mark.parametrize("counts_resets", [True, False], ids=["any gates", "finite gates"])
def test_the_cumulative_sums_along_lanes_differentiate_in_float32(counts_resets):
    # jax's own rule would round the cotangent to bf16 on its way through the gates' bf16 parts (about 2e-3).
    size = 128
    rng = np.random.default_rng(1)
    g = np.stack([_gates_with_resets(size, RESETS[:4] if counts_resets else (), seed) for seed in range(3)])
    weights = rng.standard_normal(g.shape).astype(np.float32)
    dg = jax.grad(lambda g: jnp.sum(chunkwise.cumulative_sums_along_lanes(g, counts_resets)[0] * weights))(jnp.asarray(g))
    exact = np.where(np.isneginf(g), 0.0, np.cumsum(weights[:, ::-1].astype(np.float64), axis=1)[:, ::-1])
    assert np.sqrt(np.mean((np.asarray(dg) - exact) ** 2) / np.mean(exact**2)) < 1e-6
    if counts_resets:
        np.testing.assert_array_equal(np.asarray(dg)[np.isneginf(g)], 0.0)


def test_chunk_math_with_resets_never_makes_a_nan():
    # -inf - -inf or 0 * -inf anywhere on the way would be a NaN, even where a where() hides it from the result.
    size = 256
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((size, 128)), jnp.float32) for _ in range(3))
    state = jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)
    g = jnp.asarray(np.where(np.arange(size) % 50 == 3, -np.inf, -1.0), jnp.float32)
    with jax.debug_nans(True):
        for gates in (
            chunkwise.ChunkGates.compute(jnp.float32(-1.0), g[:, None], None, size),
            chunkwise.ChunkGates.along_lanes(jnp.float32(-1.0), g[None, :], [None])[0].with_decays(),
            chunkwise.ChunkGates.compute(jnp.float32(RESET_LOG_DECAY), g[:, None], None, size),
        ):
            o = chunkwise.output_from_state(chunkwise.intra_chunk_output(q, k, v, gates), q, state, gates, 0.1)
            new_state = chunkwise.advance_state(state, k.T, v, gates, keys_transposed=True)
            assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(new_state)).all()


# -- the kernels, forward and every gradient, against the reference ----------------------------------


def _inputs(B, T, H, dtype, *, resets, g_gamma=None, seed=0, N=None):
    """Kernel inputs (``q, k, v`` in ``dtype``, the rest float32) with ``g = -inf`` at ``resets`` (``(b, t, h)`` tuples)."""
    rng = np.random.default_rng(seed)
    K = V = 128
    inputs = {
        "q": jnp.asarray(rng.standard_normal((B, T, H, K)) * K**-0.5, dtype),
        "k": jnp.asarray(rng.standard_normal((B, T, H, K)) * K**-0.5, dtype),
        "v": jnp.asarray(rng.standard_normal((B, T, H, V)), dtype),
        "initial_state": jnp.asarray(rng.standard_normal((N or B, H, K, V)), jnp.float32),
    }
    gates = -np.logaddexp(0.0, -rng.standard_normal((B, T, H))) / 16
    for b, t, h in resets:
        gates[b, t, h] = -np.inf
    inputs["g"] = jnp.asarray(gates, jnp.float32)
    if g_gamma is not None:
        inputs["g_gamma"] = jnp.asarray(g_gamma, jnp.float32)
    return inputs


def _forward_and_gradients(implementation, config, inputs, cu_seqlens=None, seed=1):
    """``(o, final_state)`` and every gradient for random cotangents, and the same from ``ref.recurrent`` in float64."""
    rng = np.random.default_rng(seed)
    B, T, H, K = inputs["q"].shape
    N = inputs["initial_state"].shape[0]
    do = jnp.asarray(rng.standard_normal((B, T, H, inputs["v"].shape[-1])), inputs["v"].dtype)
    dht = jnp.asarray(rng.standard_normal((N, H, K, inputs["v"].shape[-1])), jnp.float32)
    packed = {} if cu_seqlens is None else {"cu_seqlens": jnp.asarray(cu_seqlens, jnp.int32)}

    def run(arrays, impl):
        outputs, vjp = jax.vjp(lambda a: sg.forward(**a, **packed, output_final_state=True, implementation=impl), arrays)
        return outputs, vjp((do.astype(arrays["v"].dtype), dht.astype(arrays["initial_state"].dtype)))[0]

    with tops_core.use(interpret=True, strict=True):
        got = jax.jit(lambda a: run(a, (implementation, config)))(inputs)
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        want = run({n: jnp.asarray(x, jnp.float64) for n, x in inputs.items()}, "ref.recurrent")
    finally:
        jax.config.update("jax_enable_x64", previous)
    return got, jax.tree.map(np.asarray, want)


def _assert_matches(got, want, dtype):
    (o, final_state), grads = got
    (o_ref, final_ref), ref_grads = want
    for name, x, ref, gradient in (("o", o, o_ref, False), ("final_state", final_state, final_ref, False)):
        measurement = measure(name, x, ref, tolerance(jnp.dtype(dtype).name, gradient=gradient))
        assert measurement.passed, measurement.describe()
    for name, ref in ref_grads.items():
        measurement = measure(f"d{name}", grads[name], ref, tolerance(jnp.dtype(dtype).name, gradient=True))
        assert measurement.passed, measurement.describe()


# (b, t, h): the first token, two in a row, on the chunk grid of 64, 128 and 256, the ragged last chunk's last token, token 100 everywhere.
RESET_TOKENS = [(0, 0, 0), (1, 37, 1), (1, 38, 1), (0, 64, 1), (1, 128, 0), (0, 256, 0), (1, 599, 1)] + [(b, 100, h) for b in range(2) for h in range(2)]


@pytest.mark.parametrize(("implementation", "config"), [
    ("tpu_pallas.fused", dict(chunk_size=64, num_steps=2, backward_num_steps=2)),  # gates as columns
    ("tpu_pallas.fused", dict(chunk_size=256, num_steps=2, backward_num_steps=1)),  # v6e's forward: rows, 2 x 2 blocks of decays
    pytest.param("tpu_pallas.chunk", dict(chunk_size=64, num_steps=2), marks=pytest.mark.slow),  # the kit's reset cases run it
])
def test_kernels_match_the_reference_with_resets(implementation, config):
    inputs = _inputs(2, 600, 2, jnp.float32, resets=RESET_TOKENS, g_gamma=[-0.05, -0.2])
    got, want = _forward_and_gradients(implementation, config, inputs)
    _assert_matches(got, want, jnp.float32)
    dg = np.asarray(got[1]["g"])
    for b, t, h in RESET_TOKENS:  # the reference's gradient there: d exp(a) S / da = exp(a) S = 0
        assert dg[b, t, h] == 0.0, (b, t, h, dg[b, t, h])


# tpu_pallas.chunk with -m slow: the kit's reset cases run it.
@pytest.mark.parametrize("implementation", ["tpu_pallas.fused", pytest.param("tpu_pallas.chunk", marks=pytest.mark.slow)])
def test_a_scalar_g_gamma_of_minus_inf_with_g(implementation):
    inputs = _inputs(1, 200, 2, jnp.bfloat16, resets=[(0, 50, 0)], g_gamma=-np.inf)
    got, want = _forward_and_gradients(implementation, dict(chunk_size=64, num_steps=2), inputs)
    _assert_matches(got, want, jnp.bfloat16)
    assert got[1]["g_gamma"] == 0.0 and not np.asarray(got[1]["g"], np.float32).any()


def test_varlen_with_resets_on_and_beside_its_boundaries():
    # Sequences start at 0, 70, 127 and 200 (chunks of 64): resets at a sequence's first token (whose
    # initial state then counts for nothing), just before a boundary, inside a chunk and at the last token.
    seqlens = (70, 57, 73, 100)
    resets = [(0, t, h) for t, h in ((0, 0), (69, 1), (70, 1), (127, 0), (150, 0), (150, 1), (299, 1))]
    inputs = _inputs(1, sum(seqlens), 2, jnp.float32, resets=resets, g_gamma=[-np.inf, -0.1], N=len(seqlens))
    got, want = _forward_and_gradients("tpu_pallas.varlen", dict(chunk_size=64, num_steps=2, backward_num_steps=2), inputs, np.cumsum((0, *seqlens)))
    _assert_matches(got, want, jnp.float32)
    dg = np.asarray(got[1]["g"])
    assert not dg[..., 0].any()  # head 0 has g_gamma = -inf
    assert all(dg[b, t, h] == 0.0 for b, t, h in resets)


# -- kda ------------------------------------------------------------------------------------------


def test_kda_decays_are_exactly_zero_across_a_reset_of_their_key():
    size, keys = 64, 128
    rng = np.random.default_rng(0)
    g = -rng.exponential(0.05, (size, keys)).astype(np.float32)
    g[[0, 10, 11, 40], :64] = -np.inf  # the first half of the keys resets at these tokens
    decays = kda_chunkwise.Decays.compute(jnp.asarray(g))
    b = np.cumsum(g.astype(np.float64), axis=0)  # -inf from a key's first reset on
    np.testing.assert_allclose(decays.to_token, np.exp(b), rtol=2e-6, atol=0)
    whole = np.exp(np.sum(g.astype(np.float64), axis=0))
    np.testing.assert_array_equal(np.asarray(decays.whole)[:, 0] == 0, whole == 0)
    np.testing.assert_allclose(np.asarray(decays.whole)[:, 0], whole, rtol=2e-6)
    for level in decays.levels:
        assert np.isfinite(np.asarray(level)).all()


def test_kda_at_chunk_128_with_resets(make_kda_inputs, kda_reference, assert_matches):
    inputs = make_kda_inputs(1, 300, 2, 128, 128, jnp.float32)
    g = np.array(inputs["g"])
    g[0, [0, 127, 128, 200], 0, :64] = -np.inf
    g[0, 100] = -np.inf
    inputs["g"] = jnp.asarray(g)

    def call(inputs):
        with tops_core.use(interpret=True, strict=True):
            return tops_core.op("kda").forward(**inputs, output_final_state=True, implementation=("tpu_pallas.fused", dict(chunk_size=128)))

    o, final_state = jax.jit(call)(inputs)
    o_ref, final_ref = kda_reference(inputs)
    assert_matches("o", o, o_ref, jnp.float32)
    assert_matches("final_state", final_state, final_ref, jnp.float32)
