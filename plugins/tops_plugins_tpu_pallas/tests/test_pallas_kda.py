"""KDA's fused Pallas forward and backward (``tpu_pallas.fused`` for kda), in the fast interpreter and lowered for TPU.

The conformance kit covers the case grid; these tests cover what is particular to this kernel:
the chunk math against direct formulas (the exact inverse, decays of ``g = -10`` that never
overflow), ragged last blocks, chunks per grid step, lane-padded head dimensions, the capability
declaration and the pairing with its own backward (a packed call's with varlen's); and grouped value heads, the gate and beta
logits computed in the kernel, bit for bit what the kernel computes from repeated q, k and from
precomputed ``gate``, ``beta_activation``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tops_core
from tops_core.conformance.compare import measure, relative_error, tolerance
from tops_core.conformance.cases import grid
from tops_core.conformance.checks import run_case
from tops_core.ops.kda import Activations, beta_activation, gate
from tops_core.tpu import compile_only
from tops_core.tpu.generations import UNKNOWN_CHIP_VMEM_BUDGET

from tops_plugins_tpu_pallas import traffic
from tops_plugins_tpu_pallas.gated_delta_rule.fused import GatedDeltaRuleFusedConfig
from tops_plugins_tpu_pallas.grid import chunk_size_of, steps_of
from tops_plugins_tpu_pallas.gated_delta_rule.chunkwise import GATED_DELTA_RULE
from tops_plugins_tpu_pallas.gla.chunkwise import GLA
from tops_plugins_tpu_pallas.gla.fused import GlaFusedConfig
from tops_plugins_tpu_pallas.kda import backward as kda_backward
from tops_plugins_tpu_pallas.kda import chunkwise
from tops_plugins_tpu_pallas.kda import fused as kda_fused
from tops_plugins_tpu_pallas.kda.chunkwise import KDA

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


@pytest.mark.slow  # the gradients' test below covers the forward too: its cotangents are 2 o and 2 final_state
def test_num_steps_do_not_change_a_bit(make_kda_inputs):
    # 5 chunks of 64, the last ragged: one, two or three chunks per grid step (unrolled, the state carried as a value
    # between them; the last step's chunks past the end read as no tokens) run the same chunk body.
    inputs = make_kda_inputs(1, 300, 2, 128, 128, jnp.float32, seed=1)
    one = run(inputs, chunk_size=64, num_steps=1)
    for num_steps in (2, 3):
        for got, want in zip(run(inputs, chunk_size=64, num_steps=num_steps), one):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["fused", "varlen"])  # varlen: 19 s
def test_num_steps_do_not_change_a_bit_of_the_gradients(packed, make_kda_inputs, default_cpu_emitters):
    # The interpreter runs one chunk per step by default (grid.steps_of), a TPU eight: both backward walks, the
    # packed one's per-sequence loops too, give the same bits at one chunk per step as at two, g's gradient the same to
    # rounding (3 chunks, the last ragged: the second step's second chunk is past the end, packed a chunk of no sequence).
    inputs = make_kda_inputs(1, 190, 2, 64, 64, jnp.float32, seed=2)
    extra = {}
    if packed:
        extra["cu_seqlens"] = jnp.asarray([0, 3, 3, 100, 128, 190], jnp.int32)
        inputs["initial_state"] = inputs["initial_state"] * jnp.arange(1.0, 6.0)[:, None, None, None]  # one per sequence
    implementation = "tpu_pallas.varlen" if packed else "tpu_pallas.fused"

    def gradients(num_steps):
        def loss(inputs):
            o, final_state = kda.forward(
                **inputs, **extra, output_final_state=True, implementation=(implementation, dict(num_steps=num_steps)),
            )
            return jnp.sum(o * o) + jnp.sum(final_state * final_state)

        with tops_core.use(interpret=True, strict=True):
            return jax.jit(jax.grad(loss), compiler_options=default_cpu_emitters)(inputs)

    one, two = gradients(1), gradients(2)
    for name in inputs:
        if name == "g":
            # A step's chunks compute their decays side by side along lanes (chunkwise.Decays.of_chunks), and XLA's CPU
            # code for the decays' VJP rounds differently at two chunks' width than at one: g's gradient agrees to
            # float32 rounding (9.5e-7 of its largest, 16.3, here), not bit for bit.
            np.testing.assert_allclose(two[name], one[name], rtol=0, atol=1e-6 * np.abs(one[name]).max(), err_msg=name)
        else:
            np.testing.assert_array_equal(two[name], one[name], err_msg=name)


def _direct_pairs(q, k, g, beta, same_segment=True):
    """``Aqk`` and ``(I + diag(beta) Akk)^-1`` from their definitions, in float64 NumPy (``same_segment``: ``(C, C)``,
    whether no state reset lies between ``j`` and ``i``)."""
    b = np.cumsum(g, axis=0)
    C = q.shape[0]
    with np.errstate(over="ignore"):  # exp(b_i - b_j) above the diagonal is never used
        decay = np.exp(np.where(np.tril(np.ones((C, C), bool))[..., None], b[:, None, :] - b[None, :, :], 0.0))
    decay = decay * np.asarray(same_segment)[..., None] if same_segment is not True else decay
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


@pytest.mark.parametrize("known", [False, True], ids=["computed", "known"])
def test_a_product_with_the_inverse_of_a_strictly_lower_n_and_its_cotangents_are_their_definitions(known):
    # gated_delta_rule's inverse D = (I + N)^-1 from N whole, and Y = D R (chunkwise.solved, with Y computed or known)
    # with its VJP taken to N directly: dR = D^T dY, dN = -D^T dD D^T with dD = dY R^T, on N's strictly lower triangle
    # alone; no gradient flows through D besides (chunkwise.inverses_of).
    size, width = 128, 256
    rng = np.random.default_rng(3)
    n = np.tril(rng.standard_normal((size, size)) * 0.05, -1)
    rhs = rng.standard_normal((size, width))
    want = np.linalg.inv(np.eye(size) + n)
    given = jnp.asarray(want @ rhs, jnp.float32) if known else None
    ones = jnp.ones((size, 1), jnp.float32)

    def product(n, rhs):
        (inverse,) = chunkwise.inverses_of_strictly_lower((n,), jnp.float32)
        factors = chunkwise.Factors(ones, ones, ones, None, inverse, pairs=n)
        return inverse, chunkwise.solved(factors, rhs, jnp.float32, given)

    (inverse, y), vjp = jax.vjp(product, jnp.asarray(n, jnp.float32), jnp.asarray(rhs, jnp.float32))
    dy = rng.standard_normal((size, width))
    dn, drhs = vjp((jnp.zeros((size, size), jnp.float32), jnp.asarray(dy, jnp.float32)))
    want_dn = np.tril(-want.T @ (dy @ rhs.T) @ want.T, -1)
    expected = (("inverse", inverse, want), ("Y", y, want @ rhs), ("dN", dn, want_dn), ("dR", drhs, want.T @ dy))
    for name, x, y_want in expected:
        error = np.sqrt(np.mean((np.asarray(x, np.float64) - y_want) ** 2) / np.mean(y_want**2))
        assert error < 1e-6, (name, error)
    np.testing.assert_array_equal(np.triu(np.asarray(dn)), 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("recurrence", [KDA, GATED_DELTA_RULE, GLA], ids=lambda r: r.op)
def test_a_walk_without_queries_computes_the_same_states_and_no_outputs(recurrence, dtype):
    # The backward's checkpoints walk reads no q (kda.backward.plans): chunk_steps then builds no Aqk and no o, and the
    # states entering and leaving its chunks are the forward's. With the delta rule it takes the WY form
    # (chunkwise.ahead_of_walk), whose products round apart from the forward's solve: in bf16 the two agree to the
    # rounding of the operands (about 3e-3 here), not bit for bit; gla's walk is the forward's.
    rng = np.random.default_rng(3)
    C, K, V = 64, 128, 128
    chunks = []
    for _ in range(3):
        q, k, v = (jnp.asarray(rng.standard_normal((C, d)), dtype) for d in (K, K, V))
        g = -np.logaddexp(0.0, -rng.standard_normal((C, K if recurrence.gate_per_key else 1))) / 8
        beta = jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((C, 1)))), jnp.float32) if recurrence.delta_rule else None
        chunks.append((q, k, v, jnp.asarray(g, jnp.float32), beta, None))
    state = jnp.asarray(rng.standard_normal((K, V)), jnp.float32)
    steps = functools.partial(chunkwise.chunk_steps, scale=K**-0.5, use_qk_l2norm=True, recurrence=recurrence)
    outputs, entering, leaving, _ = steps(chunks, state)
    no_outputs, walked, walked_leaving, _ = steps([(None, *chunk[1:]) for chunk in chunks], state)
    assert all(o is not None for o in outputs) and all(o is None for o in no_outputs)
    tolerance = 1e-2 if recurrence.delta_rule and dtype == jnp.bfloat16 else 1e-5
    for got, want in zip([*walked, walked_leaving], [*entering, leaving]):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.linalg.norm(got - want) <= tolerance * np.linalg.norm(want)


@pytest.mark.parametrize("recurrence", [KDA, GATED_DELTA_RULE], ids=lambda r: r.op)
def test_the_wy_form_gives_the_solves_states_and_writes(recurrence):
    # through_state with W and u computed ahead (ahead_of_walk: delta = u - W S) against the solve (delta = D diag(beta)
    # (v - k exp(b) S)), float32 at HIGHEST, with a packed chunk's initial-state terms entering and without.
    rng = np.random.default_rng(5)
    C, K, V = 64, 128, 128
    k, v = (jnp.asarray(rng.standard_normal((C, d)), jnp.float32) for d in (K, V))
    g = -np.logaddexp(0.0, -rng.standard_normal((C, K if recurrence.gate_per_key else 1))) / 8
    beta = jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((C, 1)))), jnp.float32)
    k = chunkwise.l2_normalised(k)
    (factors,) = recurrence.factors([(None, k, jnp.asarray(g, jnp.float32), beta, None)], operands=jnp.float32, fine_size=None)
    ahead = chunkwise.ahead_of_walk(None, k, v, beta, factors, jnp.float32)
    assert factors.ahead is None and ahead.ahead is not None
    assert chunkwise.ahead_of_walk(k, k, v, beta, factors, jnp.float32) is factors  # with queries: the solve
    state = jnp.asarray(rng.standard_normal((K, V)), jnp.float32)
    entering = (jnp.asarray(rng.standard_normal((C, V)), jnp.float32), None, jnp.asarray(rng.standard_normal((K, V)), jnp.float32))
    for terms in (None, entering):
        _, want_state, want_delta = chunkwise.through_state(None, k, v, beta, state, terms, factors, jnp.float32)
        _, got_state, got_delta = chunkwise.through_state(None, k, v, beta, state, terms, ahead, jnp.float32)
        np.testing.assert_allclose(np.asarray(got_state), np.asarray(want_state), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got_delta), np.asarray(want_delta), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["solve", "wy"])
@pytest.mark.parametrize("recurrence", [KDA, GATED_DELTA_RULE], ids=lambda r: r.op)
def test_a_links_vjp_with_the_walks_products_known_is_its_vjp(recurrence, form):
    # Where the gradients kernel walks its own states (kda.backward), each link's VJP takes the walk's products with the
    # state as known (chunkwise.walked_link, mxu.known_product): the writes and every cotangent must be those of the VJP
    # that computes them, with a packed chunk's initial-state terms entering and without.
    rng = np.random.default_rng(11)
    C, K, V = 64, 128, 128
    q, k, v = (jnp.asarray(rng.standard_normal((C, d)), jnp.float32) for d in (K, K, V))
    g = -np.logaddexp(0.0, -rng.standard_normal((C, K if recurrence.gate_per_key else 1))) / 8
    beta = jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((C, 1)))), jnp.float32)
    q, k = chunkwise.l2_normalised(q), chunkwise.l2_normalised(k)
    chunk = (q, k, jnp.asarray(g, jnp.float32), beta, None)
    (factors,) = recurrence.factors([chunk], operands=jnp.float32, fine_size=None)
    if form == "wy":
        factors = chunkwise.with_wy(k, v, beta, factors, jnp.float32)
    state = jnp.asarray(rng.standard_normal((K, V)), jnp.float32)
    entering = tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((C, V), (C, V), (K, V)))
    cotangents = tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((C, V), (K, V), (C, V)))
    for terms in (None, entering):
        walked_state, known = chunkwise.walked_link(k, v, beta, state, terms, factors, jnp.float32)
        assert (known.solved is None) == (form == "wy")
        arguments = (q, k, v, beta, state, terms, factors)
        want, want_vjp = jax.vjp(functools.partial(chunkwise.through_state, operands=jnp.float32), *arguments)
        got, got_vjp = jax.vjp(functools.partial(chunkwise.through_state, operands=jnp.float32, known=known), *arguments)
        np.testing.assert_array_equal(np.asarray(walked_state), np.asarray(want[1]))
        got_leaves, want_leaves = (jax.tree.leaves((x, vjp(cotangents))) for x, vjp in ((got, got_vjp), (want, want_vjp)))
        assert len(got_leaves) == len(want_leaves)
        for got_leaf, want_leaf in zip(got_leaves, want_leaves):
            np.testing.assert_allclose(np.asarray(got_leaf), np.asarray(want_leaf), rtol=1e-6, atol=1e-6)


def test_the_backward_walk_reads_no_queries_and_writes_the_inverses():
    geometry = kda_fused.geometry_of(2, 1024, 4, 128, 128, kda_fused.KdaFusedConfig())
    walk, gradients = kda_backward.plans(geometry, jnp.bfloat16, use_qk_l2norm=True)
    assert "q" not in [x.name for x in walk.inputs] and "q" in [x.name for x in gradients.inputs]
    # It writes each chunk's inverse, in the bf16 its products take, and the gradients kernel reads it.
    (inverses,) = [x for x in walk.outputs if x.name == "inverses"]
    assert inverses.dtype == jnp.bfloat16 and "inverses" in [x.name for x in gradients.inputs]


def test_decays_near_one_keep_float32_accuracy_under_a_large_cumulative_gate():
    # Half the chunk at g = -10 drives b to -320; the later half's decays between its own tokens
    # (g = -1e-3) must still be exact to float32, which b_i - b_j as a difference would not be.
    g = np.concatenate([np.full((32, 128), -10.0), np.full((32, 128), -1e-3)]).astype(np.float32)
    decays = chunkwise.Decays.compute(jnp.asarray(g))
    neighbours = np.asarray(decays.levels[0])  # pairs (2m + 1, 2m): exp(g[2m + 1]) on odd rows, exp(0) on even
    np.testing.assert_allclose(neighbours[33::2], np.exp(np.float64(-1e-3)), rtol=2e-7)
    np.testing.assert_array_equal(neighbours[32::2], 1.0)  # an empty run: exp(0)


def _runs(size: int, levels: tuple[int, ...], fine: int | None) -> np.ndarray:
    """The run of tokens each exponent sums, one 0/1 (for e signed) row per token and section, from positions alone."""
    i, t = np.arange(size)[:, None], np.arange(size)[None, :]
    sections = [t <= i, t > i]  # b_i, b_C - b_i
    for s in levels:  # around r, the last token of the earlier half of i's block of 2s
        later, start = (i // s) % 2 == 1, (i // s) * s
        sections.append(np.where(later, (start <= t) & (t <= i), (i < t) & (t < start + s)))
    runs = np.concatenate(sections).astype(np.float64)
    if fine is not None:  # e_i = b_i - b_r, r the middle of i's sub-chunk of `fine`
        r = (i // fine) * fine + fine // 2 - 1
        runs = np.concatenate([runs, ((r < t) & (t <= i)).astype(np.float64) - ((i < t) & (t <= r))])
    return runs


@pytest.mark.parametrize("size, fine", [(8, None), (64, None), (64, 4), (64, 16), (128, 32), (128, 128)])
def test_decays_grown_from_run_groups_are_the_runs_decays(size, fine):
    # Runs inside a group (8 tokens, the bounded path's sub-chunk, or the whole chunk without levels) are summed on the
    # MXU, longer ones' decays are products of whole groups' on the VPU; every section is its run's decay to float32
    # accuracy, strong and weak gates side by side, and the bounded path's e its run's sum.
    g = -np.abs(np.random.default_rng(size).standard_normal((size, 128))) * np.where(np.arange(128) < 64, 10.0, 1e-3)
    levels = chunkwise.coarse_level_sizes(size, fine)
    decays, exponents = chunkwise.decay_sections(jnp.asarray(g, jnp.float32), levels, fine, 3)
    runs = _runs(size, levels, fine)
    want = np.exp(runs[: decays.shape[0]] @ g)
    assert decays.shape == want.shape
    np.testing.assert_allclose(np.asarray(decays, np.float64), want, rtol=1e-5, atol=1e-30)  # exp of an f32 exponent near -30
    if fine is None:
        assert exponents is None
    else:
        np.testing.assert_allclose(np.asarray(exponents, np.float64), runs[-size:] @ g, rtol=1e-6, atol=1e-6 * np.abs(g).max())
    # A packed chunk sums e apart: the same decays, summed inside the same groups, without it.
    alone, none = chunkwise.decay_sections(jnp.asarray(g, jnp.float32), levels, fine, 3, exponents=False)
    assert none is None
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(decays))


@pytest.mark.parametrize("fine, packed", [(None, False), (16, False), (16, True), (None, True)])
def test_chunks_side_by_side_get_each_chunk_own_decays(fine, packed):
    # Decays.of_chunks lays several chunks' g along lanes for one run-sum product and one pass of elementwise steps:
    # each chunk's decays must be exactly those it gets alone, resets (packed) and the bounded path's e included.
    rng = np.random.default_rng(3)
    gs = [-rng.uniform(0, 5, (64, 128)).astype(np.float32) for _ in range(3)]
    every_resets = [None] * 3
    if packed:
        every_resets = [jnp.asarray(np.isin(np.arange(64), starts)[:, None]) for starts in ([0, 9], [], [63])]
    together = chunkwise.Decays.of_chunks([jnp.asarray(g) for g in gs], fine, every_resets, 3)
    for g, resets, got in zip(gs, every_resets, together):
        want = chunkwise.Decays.compute(jnp.asarray(g), fine, resets)
        for got_leaf, want_leaf in zip(jax.tree.leaves(got.__dict__), jax.tree.leaves(want.__dict__)):
            np.testing.assert_array_equal(np.asarray(got_leaf), np.asarray(want_leaf))


def _spec(**changes):
    fields = dict(
        op="kda", platform="tpu", dtype="bfloat16", batch=8, seq_len=4096, heads=16, key_dim=128, value_dim=128,
        num_seqs=8, features={"use_qk_l2norm", "initial_state", "output_final_state"},
    )
    return tops_core.CallSpec(**{**fields, **changes})


def test_gradients_at_g_minus_10_on_half_the_keys_are_finite_and_match_the_reference(make_kda_inputs, kda_gradients):
    # The backward (kda.backward) takes no exp the forward does not: at chunk 128, where b reaches -1280 on the
    # strong keys, every gradient is finite and within float32's tolerance of the float64 reference.
    inputs = make_kda_inputs(1, 200, 1, 128, 128, jnp.float32)
    inputs["g"] = inputs["g"].at[..., ::2].set(-10.0)
    got, want = kda_gradients(inputs, ("tpu_pallas.fused", dict(chunk_size=128))), kda_gradients(inputs, "ref.recurrent")
    for name in inputs:
        assert np.all(np.isfinite(np.asarray(got[name]))), name
        assert relative_error(got[name], want[name]) < 5e-5, name


def test_packed_sequences_are_rejected_with_a_reason():
    fused = next(impl for impl in kda.implementations() if impl.name == "tpu_pallas.fused")
    assert not fused.reasons(_spec(), "forward")
    packed = _spec(batch=1, num_seqs=3, features={"cu_seqlens"})
    assert any("cu_seqlens" in reason for reason in fused.reasons(packed, "forward"))
    assert kda.decide(packed).implementation.name != "tpu_pallas.fused"


def test_explain_pairs_each_forward_with_its_own_backward(make_kda_inputs):
    inputs = make_kda_inputs(1, 64, 2, 128, 128, jnp.bfloat16)
    with tops_core.use(interpret=True):
        explanation = kda.explain(**inputs, output_final_state=True)
    assert "selected: tpu_pallas.fused" in str(explanation.forward) and "selected: tpu_pallas.fused" in str(explanation.backward)
    packed = _spec(batch=1, num_seqs=3, features={"cu_seqlens"})
    assert kda.decide(packed, "backward").implementation.name == "tpu_pallas.varlen"


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
    with pytest.raises(TypeError, match="wy_gradients"):
        kda_fused.KdaFusedConfig(wy_gradients=1)
    with pytest.raises(TypeError, match="keep_residuals"):
        kda_fused.KdaFusedConfig(keep_residuals=1)


@pytest.mark.parametrize("op_name", ["kda", "gated_delta_rule"])
def test_a_training_step_keeps_the_forwards_residuals_unless_the_config_says(op_name):
    # Under grad the forward writes what the backward's walk would (T = 640: five chunks of 128, more than one segment for
    # gated_delta_rule too), and the backward runs no walk; with keep_residuals off it walks again (the kit checks the
    # gradients of both paths: op.backward alone recomputes as this does).
    S = jax.ShapeDtypeStruct
    B, T, H, K, V = 1, 640, 2, 128, 128
    per_key = op_name == "kda"
    shapes = dict(
        q=S((B, T, H, K), jnp.bfloat16), k=S((B, T, H, K), jnp.bfloat16), v=S((B, T, H, V), jnp.bfloat16),
        g=S((B, T, H, K) if per_key else (B, T, H), jnp.float32), beta=S((B, T, H), jnp.float32),
    )
    config = dict(num_steps=2)

    def kernels(**overrides):
        def loss(arrays):
            implementation = ("tpu_pallas.fused", {**config, **overrides})
            o, _ = tops_core.op(op_name).forward(**arrays, use_qk_l2norm=True, implementation=implementation)
            return jnp.sum(o.astype(jnp.float32) ** 2)

        # Traced with a TPU as the default device, as on a TPU host: the host's decision keeps the residuals.
        with jax.default_device(compile_only.device("v6e")):
            text = jax.jit(jax.grad(loss)).trace(shapes).lower(lowering_platforms=("tpu",)).as_text()
        return text.count("tpu_custom_call")

    assert kernels() == 1 + 1  # the forward, writing the states and inverses too; the gradients kernel
    assert kernels(keep_residuals=False) == 1 + 2  # the walk again


def test_the_wy_gradients_are_taken_on_a_256_wide_mxu_unless_the_config_says():
    # The delta rule's gradients kernel in the WY form on v6e, the solve on 128-wide MXUs and in the interpreter (no chip).
    by_chip = {chip: kda_fused.wy_gradients_of(GatedDeltaRuleFusedConfig(), chip) for chip in (None, "v4", "v5e", "v5p", "v6e")}
    assert by_chip == {None: False, "v4": False, "v5e": False, "v5p": False, "v6e": True}
    assert kda_fused.wy_gradients_of(kda_fused.KdaFusedConfig(wy_gradients=True), None)
    assert not kda_fused.wy_gradients_of(kda_fused.KdaFusedConfig(wy_gradients=False), "v6e")


@pytest.mark.parametrize("op_name, num_steps", [("kda", 1), ("gated_delta_rule", 1), ("gated_delta_rule", 4)])
def test_the_wy_gradients_keep_the_bf16_tolerances(op_name, num_steps):
    # The kit's bf16 case (kda's with the in-kernel gate) in the WY form, which its default grid runs in float32 alone:
    # forward and every gradient against the float64 reference, its T=100 in two segments (the walk's checkpoints) and,
    # for gated_delta_rule, in one (the states walked in the gradients kernel: v6e's default at T=4096).
    impl = next(i for i in tops_core.op(op_name).implementations() if i.name == "tpu_pallas.fused")
    case = next(c for c in grid(impl).supported if c.name == "bfloat16")
    config = (("num_steps", num_steps), ("wy_gradients", True))
    run_case(impl, dataclasses.replace(case, name=f"bfloat16-wy-num_steps={num_steps}", config=config))


def test_lowered_for_a_tpu_the_chunks_per_step_are_each_ops_and_chips():
    # kda's backward keeps 8 (at 16 Mosaic's spills passed v5p's VMEM) but on v5e and v6e; gla's and gated_delta_rule's
    # walk 16, 32 on v6e (and gated_delta_rule's on v5e). On v6e every op's forward walks 32.
    configs = [config(interpret=False) for config in (kda_fused.KdaFusedConfig, GlaFusedConfig, GatedDeltaRuleFusedConfig)]

    def steps():
        return [(steps_of(config), steps_of(config, backward=True)) for config in configs]

    assert steps() == [(16, 8), (16, 16), (16, 16)]  # a TPU of no known generation
    with jax.default_device(compile_only.device("v6e")):
        assert steps() == [(32, 16), (32, 32), (32, 32)]
    with jax.default_device(compile_only.device("v5e")):
        assert steps() == [(16, 16), (16, 16), (16, 32)]
    with jax.default_device(compile_only.device("v5p")):
        assert steps() == [(16, 8), (16, 16), (16, 16)]
    assert steps_of(kda_fused.KdaFusedConfig(interpret=True), backward=True) == 1
    assert steps_of(kda_fused.KdaFusedConfig(num_steps=4, interpret=False), backward=True) == 4


def test_the_chunk_left_none_is_each_ops_and_chips():
    # kda and gla walk chunks of 128 on v6e's 256-wide MXU, 64 elsewhere and in the interpreter; gated_delta_rule 128
    # everywhere. The kernels, the capability check and explain all read the chunk from grid.chunk_size_of.
    configs = (kda_fused.KdaFusedConfig(), GlaFusedConfig(), GatedDeltaRuleFusedConfig())

    def chunks(chip):
        return [chunk_size_of(config, chip) for config in configs]

    assert chunks("v6e") == [128, 128, 128]
    assert chunks("v5e") == chunks("v5p") == chunks("v4") == chunks(None) == [64, 64, 128]
    assert [chunk_size_of(type(config)(chunk_size=64), "v6e") for config in configs] == [64, 64, 64]
    assert kda_fused.geometry_of(1, 4096, 1, 128, 128, configs[0]).chunk_size == 64  # traced on this host: no chip
    with jax.default_device(compile_only.device("v6e")):
        assert kda_fused.geometry_of(1, 4096, 1, 128, 128, configs[0]).chunk_size == 128
    for op, chip, line in [
        ("kda", "v6e", "chunk_size=128 (None: 128 on v6e, else 64; v6e)"),
        ("gla", "v5e", "chunk_size=64 (None: 128 on v6e, else 64; v5e)"),
        ("gated_delta_rule", "v6e", "chunk_size=128 (None: on every chip 128; v6e)"),
    ]:
        spec = _spec(op=op, chip=chip, num_seqs=1, features=set())
        decision = tops_core.op(op).decide(spec, "forward")
        assert decision.implementation.name == "tpu_pallas.fused"
        assert f"for this call: {line}" in decision.explain()
    # The delta rule's backward names its form too.
    for chip, form in (("v6e", "True (None: on a 256-wide MXU; v6e)"), ("v5e", "False (None: on a 256-wide MXU; v5e)")):
        decision = tops_core.op("gated_delta_rule").decide(_spec(op="gated_delta_rule", chip=chip, num_seqs=1, features=set()), "backward")
        assert f"wy_gradients={form}" in decision.explain()
    gla_backward = tops_core.op("gla").decide(_spec(op="gla", chip="v6e", num_seqs=1, features=set()), "backward")
    (line,) = [line for line in gla_backward.explain().splitlines() if "for this call:" in line]
    assert "wy_gradients" not in line


def test_vmem_fitting_walks_fewer_chunks_per_step_for_a_large_key_dim():
    # K = 1024: eight chunks of 64 per step would not fit the budget; the forward's launch takes fewer.
    geometry = kda_fused.geometry_of(1, 4096, 1, 1024, 128, kda_fused.KdaFusedConfig(num_steps=kda_fused.KdaFusedConfig.TPU_NUM_STEPS))
    (plan,) = kda_fused.fitted_plans(geometry, jnp.bfloat16)
    assert traffic.vmem_bytes(kda_fused.plans(geometry, jnp.bfloat16)[0]) > UNKNOWN_CHIP_VMEM_BUDGET
    assert plan.grid[3] > geometry.time_steps and traffic.vmem_bytes(plan) <= UNKNOWN_CHIP_VMEM_BUDGET
    # One implementation serves both directions: the backward's VJP holds more (kda.backward), and bounds K at 512.
    fused = next(impl for impl in kda.implementations() if impl.name == "tpu_pallas.fused")
    assert not fused.reasons(_spec(key_dim=512), "forward")
    assert any("kda_fused_backward" in reason and "VMEM" in reason for reason in fused.reasons(_spec(key_dim=640), "forward"))


# -- grouped value heads, the gate and beta logits in the kernel ------------------------------------


def call_kernel(inputs, use_qk_l2norm=False, config=None, **options):
    """The plugin's forward itself, in the interpreter (the op passes these options once its wiring lands)."""
    arrays = {"initial_state": None, **inputs}

    def call(arrays):
        return kda_fused.forward(
            **arrays, scale=arrays["q"].shape[-1] ** -0.5, output_final_state=True, cu_seqlens=None,
            use_qk_l2norm=use_qk_l2norm, config=kda_fused.KdaFusedConfig(**(config or {})), **options,
        )

    return jax.jit(call)(arrays)


def assert_same(got, want):
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)


def shared_query_keys(inputs, groups):
    """``inputs`` with one query/key head per ``groups`` value heads (``[B, T, HV / groups, K]``)."""
    return {**inputs, "q": inputs["q"][:, :, ::groups], "k": inputs["k"][:, :, ::groups]}


def repeated_query_keys(inputs, groups):
    """What grouped value heads mean: each query/key head repeated for the value heads of its group (fla's repeat_interleave)."""
    return {**inputs, "q": jnp.repeat(inputs["q"], groups, axis=2), "k": jnp.repeat(inputs["k"], groups, axis=2)}


def raw_inputs(inputs, dtype, *, A_log=True, dt_bias=True, seed=0):
    """``inputs`` with a raw gate and beta logits (unit normal, in ``dtype``), ``A_log = log(uniform(1, 16))``
    and ``dt_bias`` (normal / 2), float32, per value head."""
    rng = np.random.default_rng(seed)
    B, T, HV, K = inputs["g"].shape
    raw = dict(
        inputs, g=jnp.asarray(rng.standard_normal((B, T, HV, K)), dtype), beta=jnp.asarray(rng.standard_normal((B, T, HV)), dtype),
    )
    if A_log:
        raw["A_log"] = jnp.asarray(np.log(rng.uniform(1, 16, HV)), jnp.float32)
    if dt_bias:
        raw["dt_bias"] = jnp.asarray(rng.standard_normal(HV * K) / 2, jnp.float32)
    return raw


def gated(raw, lower_bound):
    """``raw`` with the log decay of its raw gate computed outside the kernel (float32), as the contract defines it."""
    B, T, HV, K = raw["g"].shape
    A_log, dt_bias = raw.get("A_log"), raw.get("dt_bias")
    g = gate(raw["g"], None if A_log is None else A_log[:, None], None if dt_bias is None else dt_bias.reshape(HV, K), lower_bound)
    return {**{name: x for name, x in raw.items() if name not in ("A_log", "dt_bias")}, "g": g}


GROUPED = {
    # groups, (B, T, HV, K, V), dtype, use_qk_l2norm, config
    "G=2-f32-ragged-two-chunks-per-step": (2, (1, 130, 4, 128, 128), jnp.float32, False, dict(num_steps=2)),
    "G=3-bf16-lane-padded-l2norm": (3, (2, 100, 6, 64, 96), jnp.bfloat16, True, {}),
}


# The conformance kit checks each form against the reference; these check the bits, the forms the default
# kit run leaves out (no A_log, no dt_bias) and two chunks per step by default, the others with -m slow.
SLOW_FORMS = {"G=3-bf16-lane-padded-l2norm", "softplus", "lower_bound", "lower_bound-alone"}


def _forms(cases):
    return [pytest.param(case, marks=pytest.mark.slow) if case in SLOW_FORMS else case for case in cases]


@pytest.mark.parametrize("case", _forms(GROUPED))
def test_grouped_value_heads_are_the_kernel_on_repeated_query_keys(case, make_kda_inputs):
    groups, shape, dtype, use_qk_l2norm, config = GROUPED[case]
    inputs = shared_query_keys(make_kda_inputs(*shape, dtype, normalised=not use_qk_l2norm), groups)
    repeated = repeated_query_keys(inputs, groups)
    assert_same(call_kernel(inputs, use_qk_l2norm, config), call_kernel(repeated, use_qk_l2norm, config))


GATES = {
    # lower_bound, A_log given, dt_bias given
    "softplus": (None, True, True),
    "softplus-no-dt_bias": (None, True, False),
    "lower_bound": (-5.0, True, True),
    "lower_bound-no-A_log": (-5.0, False, True),
    "lower_bound-alone": (-5.0, False, False),
}


@pytest.mark.parametrize("case", _forms(GATES))
def test_the_gate_in_the_kernel_is_the_kernel_on_the_precomputed_gate(case, make_kda_inputs):
    # K = 64 is lane-padded (the raw gate's padded lanes activate to a decay of state rows that stay
    # zero) and T = 130 ragged (rows past the end, read as zeros, must still decay nothing).
    lower_bound, A_log, dt_bias = GATES[case]
    inputs = make_kda_inputs(1, 130, 2, 64, 128, jnp.float32)
    raw = {**raw_inputs(inputs, jnp.float32, A_log=A_log, dt_bias=dt_bias), "beta": inputs["beta"]}  # strengths as given
    config = dict(num_steps=2)
    in_kernel = call_kernel(raw, config=config, use_gate=True, lower_bound=lower_bound)
    # The precomputed bounded gate comes with its bound as a promise: the same bounded path as in the kernel.
    assert_same(in_kernel, call_kernel(gated(raw, lower_bound), config=config, lower_bound=lower_bound))


@pytest.mark.slow
@pytest.mark.parametrize("allow_neg_eigval", [False, True])
def test_beta_logits_in_the_kernel_are_the_kernel_on_the_precomputed_strengths(allow_neg_eigval, make_kda_inputs):
    inputs = make_kda_inputs(2, 100, 2, 128, 64, jnp.float32)
    logits = {**inputs, "beta": raw_inputs(inputs, jnp.float32)["beta"]}
    strengths = {**inputs, "beta": beta_activation(logits["beta"], allow_neg_eigval)}
    assert_same(call_kernel(logits, use_beta_sigmoid=True, allow_neg_eigval=allow_neg_eigval), call_kernel(strengths))


@pytest.mark.slow
def test_bf16_with_a_bf16_raw_gate_grouped_heads_and_beta_logits(make_kda_inputs, kda_reference, assert_matches):
    # Everything at once, the raw gate and the logits in bf16 like q, k, v: the same bits as the kernel
    # on repeated q, k and the float32 activations, and that within tolerance of the float64 reference.
    groups = 2
    raw = raw_inputs(shared_query_keys(make_kda_inputs(1, 130, 4, 128, 128, jnp.bfloat16), groups), jnp.bfloat16)
    o, final_state = call_kernel(raw, True, use_gate=True, lower_bound=None, use_beta_sigmoid=True, allow_neg_eigval=True)
    expanded = repeated_query_keys({**gated(raw, None), "beta": beta_activation(raw["beta"], True)}, groups)
    assert_same((o, final_state), call_kernel(expanded, True))
    o_ref, final_ref = kda_reference(expanded, True)
    assert_matches("o", o, o_ref, jnp.bfloat16)
    assert_matches("final_state", final_state, final_ref, jnp.bfloat16)


# -- bounded gates: chunkwise's bounded path -------------------------------------------------------


@pytest.mark.parametrize("lower_bound, size, packed", [(-5.0, 64, False), (-5.0, 64, True), (-1.0, 64, True), (-40.0, 128, False)])
def test_the_bounded_chunk_pairs_match_their_definitions_at_and_within_the_bound(lower_bound, size, packed):
    # Sub-chunks of 16, 64 (the whole chunk: no coarse level) and 2 tokens; every g at the bound (the largest
    # decays relative to a sub-chunk's middle, e^+-40 at most), then uniform in [L, 0]. Packed: rows that reset
    # the state, one at the chunk's start, two neighbours and the last; no pair across one may survive.
    rng = np.random.default_rng(size)
    fine = chunkwise.fine_block_size(size, lower_bound)
    assert fine == {-5.0: 16, -1.0: 64, -40.0: 2}[lower_bound]
    resets = np.zeros((size, 1), bool)
    if packed:
        resets[[0, 5, 6, 17, 40, size - 1]] = True
    for g in (np.full((size, 128), lower_bound), rng.uniform(lower_bound, 0, (size, 128))):
        q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in rng.standard_normal((2, size, 128)))
        beta = 1 / (1 + np.exp(-rng.standard_normal((size, 1))))
        given = jnp.asarray(resets) if packed else None
        with jax.debug_infs(True), jax.debug_nans(True):  # no exp on the way overflows, no inf * 0
            decays = chunkwise.Decays.compute(jnp.asarray(g, jnp.float32), fine, given)
            pairs = chunkwise.pairs(*(jnp.asarray(x, jnp.float32) for x in (q, k, beta)), decays, jnp.float32, given)
        segment = np.cumsum(resets[:, 0])
        aqk, inverse = _direct_pairs(q, k, g, beta, same_segment=segment[:, None] == segment[None, :])
        for name, got, want in (("Aqk", pairs.aqk, aqk), ("inverse", pairs.inverse, inverse)):
            assert relative_error(got, want) < 1e-6, (name, relative_error(got, want))


@pytest.mark.parametrize("size", [64, 128])
def test_wide_sub_chunks_pair_as_their_definitions_at_and_within_the_bound(size):
    # bf16 operands and normalised rows: sub-chunks of 32 at L = -5, their factors reaching e^+-80 at the bound
    # (pairs the mask drops overflow there, so no debug_infs). The error is bf16's operand rounding, as on the narrow
    # path with the same operands; every kept pair finite.
    rng = np.random.default_rng(size)
    assert chunkwise.sub_chunk_size(size, -5.0, jnp.bfloat16, use_qk_l2norm=True, scale=1.0) == 32
    for g in (np.full((size, 128), -5.0), rng.uniform(-5.0, 0, (size, 128))):
        q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in rng.standard_normal((2, size, 128)))
        beta = 1 / (1 + np.exp(-rng.standard_normal((size, 1))))
        aqk, inverse = _direct_pairs(q, k, g, beta)
        errors = {}
        for fine in (16, 32):
            decays = chunkwise.Decays.compute(jnp.asarray(g, jnp.float32), fine)
            pairs = chunkwise.pairs(*(jnp.asarray(x, jnp.float32) for x in (q, k, beta)), decays, jnp.bfloat16)
            assert np.isfinite(np.asarray(pairs.aqk)).all() and np.isfinite(np.asarray(pairs.inverse)).all()
            errors[fine] = [relative_error(got, want) for got, want in ((pairs.aqk, aqk), (pairs.inverse, inverse))]
        assert max(errors[32]) < 4e-3, errors
        assert all(wide < 1.5 * narrow + 1e-4 for wide, narrow in zip(errors[32], errors[16])), errors


def test_the_bounded_path_is_chosen_statically_where_it_pays():
    assert chunkwise.fine_block_size(64, None) is None
    assert chunkwise.fine_block_size(64, -5.0) == 16  # Kimi Linear: |L| s <= 80
    assert chunkwise.fine_block_size(64, -0.5) == 64  # at most the chunk
    assert chunkwise.fine_block_size(64, -60.0) is None  # sub-chunks of one token pair nothing
    assert chunkwise.fine_block_size(64, -5.0, wide=True) == 32  # |L| s <= 160
    # Wide only for bf16 operands of normalised rows and |scale| <= 1: float32 keeps its low parts off subnormals,
    # unnormalised rows or a larger scale could overflow exp(80).
    wide_at = functools.partial(chunkwise.sub_chunk_size, 128, -5.0)
    assert wide_at(jnp.bfloat16, use_qk_l2norm=True, scale=128**-0.5) == 32
    assert wide_at(jnp.float32, use_qk_l2norm=True, scale=128**-0.5) == 16
    assert wide_at(jnp.bfloat16, use_qk_l2norm=False, scale=128**-0.5) == 16
    assert wide_at(jnp.bfloat16, use_qk_l2norm=True, scale=2.0) == 16
    assert Activations.of(False, -5.0, False, False).decay_lower_bound is None  # xla.chunk's: the promise dropped
    assert Activations.of(False, -5.0, False, False, keep_promise=True).decay_lower_bound == -5.0
    assert Activations.of(True, -5.0, False, False).decay_lower_bound == -5.0
    assert Activations.of(True, None, False, False, keep_promise=True).decay_lower_bound is None
    geometry = kda_fused.geometry_of(2, 4096, 8, 128, 128, kda_fused.KdaFusedConfig())
    exact, bounded = (chunkwise.chunk_work(geometry, True, bound) for bound in (None, -5.0))
    assert bounded.flops < 0.75 * exact.flops
    assert chunkwise.chunk_body_vmem(geometry, -5.0) < chunkwise.chunk_body_vmem(geometry)


@pytest.mark.parametrize("dtype, use_qk_l2norm, chunk_size", [
    (jnp.float32, False, 64),
    pytest.param(jnp.bfloat16, False, 64, marks=pytest.mark.slow),  # bf16: also the kit's base case
    (jnp.bfloat16, True, 64),  # the wide sub-chunks (wide_sub_chunks)
    (jnp.bfloat16, True, 128),  # and their two coarse levels in v6e's chunks
])
def test_the_bounded_path_at_the_bound_everywhere_matches_the_reference(dtype, use_qk_l2norm, chunk_size, make_kda_inputs, kda_reference, assert_matches):
    # The worst case: every token and key at g = L = -5, T = 200 ragged over chunks of 64 or 128 (sub-chunks of 16; of
    # 32 for bf16 with use_qk_l2norm, their decays reaching e^+-80).
    inputs = make_kda_inputs(1, 200, 2, 128, 128, dtype, gate=-5.0)
    o, final_state = call_kernel(inputs, use_qk_l2norm, config={"chunk_size": chunk_size}, lower_bound=-5.0)
    assert np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(np.asarray(final_state)).all()
    o_ref, final_ref = kda_reference(inputs, use_qk_l2norm)
    assert_matches("o", o, o_ref, dtype)
    assert_matches("final_state", final_state, final_ref, dtype)


def test_the_gradients_after_wide_sub_chunks_at_the_bound_everywhere_match_the_reference(make_kda_inputs, kda_gradients):
    # The backward's walk for the states takes the forward's wide sub-chunks (chunk_steps) and hands the gradients kernel,
    # which keeps the narrow ones, its states and inverses: every gradient finite and within bf16's tolerance, every gate
    # at the bound.
    inputs = make_kda_inputs(1, 130, 2, 128, 128, jnp.bfloat16, gate=-5.0)
    options = dict(use_qk_l2norm=True, lower_bound=-5.0)
    got = kda_gradients(inputs, ("tpu_pallas.fused", {"chunk_size": 64}), **options)
    want = kda_gradients(inputs, "ref.recurrent", **options)
    for name in inputs:
        assert np.isfinite(np.asarray(got[name], np.float32)).all(), name
        measurement = measure(f"d{name}", got[name], want[name], tolerance("bfloat16", gradient=True))
        assert measurement.passed, measurement.describe()


@pytest.mark.slow  # the kit's bounded cases check it against the reference by default
def test_the_bounded_path_far_from_the_bound_is_the_exact_paths_result(make_kda_inputs):
    # docs/ops.md's gates (log_sigmoid / 16, about -0.04): the same outputs to float32 rounding.
    inputs = make_kda_inputs(1, 100, 2, 128, 128, jnp.float32)
    for got, want in zip(call_kernel(inputs, lower_bound=-5.0), call_kernel(inputs)):
        assert relative_error(got, want) < 1e-6


def test_the_issue_28_features_are_declared():
    fused = next(impl for impl in kda.implementations() if impl.name == "tpu_pallas.fused")
    features = {"grouped_value_heads", "use_gate", "A_log", "dt_bias", "lower_bound", "use_beta_sigmoid", "allow_neg_eigval"}
    assert not fused.reasons(_spec(value_heads=32, features=_spec().features | features), "forward")


def test_the_traffic_of_grouped_heads_a_raw_bf16_gate_and_its_parameters():
    # q and k stay [B, T, H * K] in HBM; each value head reads its group's block once per step, as it
    # would a repeated copy. The raw gate moves its own bf16 (2 bytes a key, float32 g 4); dt_bias adds
    # one K-row per (batch, value head), A_log its [HV] float32 in SMEM.
    B, T, H, groups, K = 2, 4096, 4, 2, 128
    HV = H * groups
    config = kda_fused.KdaFusedConfig()
    (plain,) = kda_fused.plans(kda_fused.geometry_of(B, T, HV, K, K, config), jnp.bfloat16)
    (with_gate,) = kda_fused.plans(
        kda_fused.geometry_of(B, T, HV, K, K, config, groups), jnp.bfloat16, gate_dtype=jnp.bfloat16,
        activations=Activations(use_gate=True), with_A_log=True, dt_bias_dtype=jnp.float32,
    )
    assert [x.shape for x in with_gate.inputs[:2]] == [(B, T, H * K)] * 2
    saved = B * T * HV * K * (4 - 2)
    assert sum(traffic.kernel_traffic(with_gate)) == sum(traffic.kernel_traffic(plain)) - saved + HV * 4 + B * HV * K * 4
    assert with_gate.transcendentals == plain.transcendentals + 2 * B * HV * T * K
