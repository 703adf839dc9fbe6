"""State pools (``ssm_state_indices``) for both ops: the dense call of the indexed rows, the rows written back.

The expected results are built without the core's pool code: the rows gathered and scattered with
NumPy around a dense float64 reference call, and the gradients by ``jax.grad`` through JAX's own
indexing around the dense op.
"""

from __future__ import annotations

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tops_core
from tops_core.conformance.compare import measure, tolerance

sg = tops_core.op("simple_gla")
kda = tops_core.op("kda")

B, H, K, V, P = 3, 2, 8, 4, 6
INDICES = [4, -1, 1]  # the middle sequence is a padding slot
UNTOUCHED = [0, 2, 3, 5]


def inputs(op: str, T: int, seed: int = 0, batch: int = B, dims: tuple[int, int] = (K, V)) -> dict:
    rng = np.random.default_rng(seed)
    key_dim, value_dim = dims
    arrays = {name: rng.standard_normal((batch, T, H, dim)) for name, dim in (("q", key_dim), ("k", key_dim), ("v", value_dim))}
    if op == "simple_gla":
        arrays["g"] = -rng.random((batch, T, H))
    else:
        arrays["g"] = -rng.random((batch, T, H, key_dim))
        arrays["beta"] = rng.random((batch, T, H))
    arrays = {name: jnp.asarray(x, jnp.float32) for name, x in arrays.items()}
    arrays["initial_state"] = jnp.asarray(rng.standard_normal((P, H, key_dim, value_dim)), jnp.float32)
    return arrays


IMPLEMENTATIONS = [None, "tpu_pallas.recurrent", "tpu_pallas.fused"]
"""The dispatcher's choice (gathered rows: xla.recurrent, xla.chunk), and two Pallas kernels that serve the pool
themselves, in Pallas' TPU interpreter: the decode kernel, and the fused chunked kernel (an unpacked prefill; the rows
gathered where K or V is not a multiple of 128, as at these shapes, and in place in the test below)."""


def call(op: str, arrays: dict, indices, implementation: str | None = None, **options):
    contract = sg if op == "simple_gla" else kda
    options = dict(options, use_qk_l2norm=True) if op == "kda" else options
    if implementation is None:
        return contract.forward(**arrays, ssm_state_indices=indices, **options)
    with tops_core.use(interpret=True, strict=True, **{op: implementation}):
        return contract.forward(**arrays, ssm_state_indices=indices, **options)


def dense_reference(op: str, arrays: dict, indices: list[int], **options):
    """``(o, pool)`` in float64 from ``ref.recurrent`` on the gathered rows, written back with NumPy."""
    pool = np.asarray(arrays["initial_state"], np.float64)
    rows = np.stack([pool[i] if i >= 0 else np.zeros_like(pool[0]) for i in indices])
    dense = {name: np.asarray(x, np.float64) for name, x in arrays.items()} | {"initial_state": rows}
    with jax.enable_x64(True):
        contract = sg if op == "simple_gla" else kda
        extra = dict(use_qk_l2norm=True) if op == "kda" else {}
        o, final = contract.forward(**dense, output_final_state=True, implementation="ref.recurrent", **extra, **options)
        o, final = np.asarray(o), np.asarray(final)
    written = pool.copy()
    for n, i in enumerate(indices):
        if i >= 0:
            written[i] = final[n]
    return o, written


def assert_matches_the_reference(op: str, arrays: dict, indices: list[int], o, pool) -> None:
    """``o`` and the returned pool within float32's tolerance of ``dense_reference``; rows no index names bit for bit."""
    o_ref, pool_ref = dense_reference(op, arrays, indices)
    for name, got, want in (("o", o, o_ref), ("pool", pool, pool_ref)):
        result = measure(name, got, want, tolerance("float32", gradient=False))
        assert result.passed, result.describe()
    untouched = [row for row in range(P) if row not in indices]
    np.testing.assert_array_equal(np.asarray(pool)[untouched], np.asarray(arrays["initial_state"])[untouched])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("op", ["simple_gla", "kda"])
# A decode step, a speculative draft, a prefill; the draft's several tokens run the path the prefill's do: -m slow.
@pytest.mark.parametrize("T", [1, pytest.param(3, marks=pytest.mark.slow), 40], ids=lambda T: f"T={T}")
def test_a_pool_call_runs_the_indexed_rows_and_writes_them_back(op, T, implementation):
    arrays = inputs(op, T)
    o, pool = call(op, arrays, jnp.asarray(INDICES, jnp.int32), implementation, output_final_state=True)
    o_ref, pool_ref = dense_reference(op, arrays, INDICES)
    for name, got, want in (("o", o, o_ref), ("pool", pool, pool_ref)):
        result = measure(name, got, want, tolerance("float32", gradient=False))
        assert result.passed, result.describe()
    before = np.asarray(arrays["initial_state"])
    np.testing.assert_array_equal(np.asarray(pool)[UNTOUCHED], before[UNTOUCHED])  # bit for bit, padding's row 0 too
    assert pool.dtype == arrays["initial_state"].dtype and pool.shape == (P, H, K, V)


# Padding slots first, last, in runs, and every sequence one: the Pallas kernel gives a slot its neighbour's row (or,
# with no row written at all, copies the block through), which must leave every row as the reference does.
PATTERNS = [[-1, -1, 3], [2, -1, -1], [-1, 5, -1], [-1, -1, -1], [5, 0, 3]]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("op", ["simple_gla", "kda"])
@pytest.mark.parametrize("indices", PATTERNS, ids=lambda i: ",".join(map(str, i)))
def test_padding_slots_anywhere_leave_every_other_row_as_it_was(op, indices, implementation):
    arrays = inputs(op, 2, seed=7)
    o, pool = call(op, arrays, jnp.asarray(indices, jnp.int32), implementation, output_final_state=True)
    assert_matches_the_reference(op, arrays, indices, o, pool)
    o_read_only, no_pool = call(op, arrays, jnp.asarray(indices, jnp.int32), implementation, output_final_state=False)
    assert no_pool is None
    np.testing.assert_array_equal(np.asarray(o_read_only), np.asarray(o))


@pytest.mark.parametrize("op", ["simple_gla", "kda"])
@pytest.mark.parametrize("indices", [[-1, 5, 3], [-1, -1, -1]], ids=["slot-first", "all-slots"])
def test_an_unpacked_prefill_reads_and_writes_its_pool_rows_in_place(op, indices):
    # tpu_pallas.fused with whole lanes (K = V = 128): each sequence's row by DMA at its first and last grid step.
    arrays = inputs(op, 40, seed=3, dims=(128, 128))
    o, pool = call(op, arrays, jnp.asarray(indices, jnp.int32), "tpu_pallas.fused", output_final_state=True)
    assert_matches_the_reference(op, arrays, indices, o, pool)


# The packed Pallas kernel reads and writes the rows in place where K and V are whole lanes (128), and runs on
# gathered rows otherwise (a lane-padded copy of the pool would move more than its rows).
@pytest.mark.parametrize(("implementation", "dims"), [(None, (K, V)), ("tpu_pallas.varlen", (K, V)), ("tpu_pallas.varlen", (128, 128))],
                         ids=["dispatcher", "varlen-gathered", "varlen-in-place"])
@pytest.mark.parametrize("op", ["simple_gla", "kda"])
def test_packed_prefill_reads_and_writes_its_pool_rows(op, implementation, dims):
    seqlens = [5, 0, 9]  # an empty sequence keeps its row's state: it is written back unchanged
    arrays = inputs(op, sum(seqlens), batch=1, dims=dims)
    cu_seqlens = jnp.asarray(np.cumsum([0, *seqlens]), jnp.int32)
    o, pool = call(op, arrays, jnp.asarray([2, 5, -1], jnp.int32), implementation, cu_seqlens=cu_seqlens, output_final_state=True)
    rows = np.asarray(arrays["initial_state"], np.float64)
    want_o, want_pool = [], rows.copy()
    for (start, stop), index in zip(zip(np.cumsum([0, *seqlens[:-1]]), np.cumsum(seqlens)), [2, 5, -1]):
        piece = {name: x[:, start:stop] for name, x in arrays.items() if name != "initial_state"}
        if stop == start:
            continue  # no tokens, no output; its state passes through
        piece["initial_state"] = arrays["initial_state"]
        o_n, pool_n = dense_reference(op, piece, [index])
        want_o.append(o_n)
        if index >= 0:
            want_pool[index] = pool_n[index]
    result = measure("o", o, np.concatenate(want_o, axis=1), tolerance("float32", gradient=False))
    assert result.passed, result.describe()
    result = measure("pool", pool, want_pool, tolerance("float32", gradient=False))
    assert result.passed, result.describe()
    np.testing.assert_array_equal(np.asarray(pool)[[0, 1, 3, 4, 5]], np.asarray(arrays["initial_state"])[[0, 1, 3, 4, 5]])


# The dispatcher's choice by default; each Pallas kernel's pool gradients are the conformance kit's state-pool cases
# (against the reference), so comparing them with a gather around the dense call again runs with -m slow.
@pytest.mark.parametrize("implementation", [IMPLEMENTATIONS[0], *(pytest.param(name, marks=pytest.mark.slow) for name in IMPLEMENTATIONS[1:])])
@pytest.mark.parametrize("op", ["simple_gla", "kda"])
@pytest.mark.parametrize("output_final_state", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["pool-out", "pool-read-only"])
def test_gradients_flow_to_the_pool_rows_read(op, output_final_state, implementation):
    arrays = inputs(op, 5, seed=1)
    indices = jnp.asarray(INDICES, jnp.int32)
    weights = jnp.asarray(np.random.default_rng(2).standard_normal((P, H, K, V)), jnp.float32)

    def loss(arrays, pooled):
        if pooled:
            o, pool = call(op, arrays, indices, implementation, output_final_state=output_final_state)
        else:  # the same call by JAX's own gather and scatter around the dense op
            pool = arrays["initial_state"]
            rows = jnp.where((indices < 0)[:, None, None, None], 0, pool[jnp.maximum(indices, 0)])
            o, final = call(op, {**arrays, "initial_state": rows}, None, implementation, output_final_state=output_final_state)
            pool = None if final is None else pool.at[jnp.where(indices < 0, P, indices)].set(final, mode="drop")
        return jnp.sum(o * o) + (0 if pool is None else jnp.sum(weights * pool))

    got = jax.grad(loss)(arrays, True)
    want = jax.grad(loss)(arrays, False)
    for name in arrays:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
    assert np.abs(np.asarray(got["initial_state"])[[4, 1]]).min() > 0  # the rows read get a gradient
    if output_final_state:
        np.testing.assert_array_equal(got["initial_state"][np.asarray(UNTOUCHED)], weights[np.asarray(UNTOUCHED)])


def test_the_explicit_backward_takes_the_pools_cotangent():
    arrays = inputs("simple_gla", 4, seed=3)
    indices = jnp.asarray(INDICES, jnp.int32)
    do = jnp.ones((B, 4, H, V), jnp.float32)
    dht = jnp.asarray(np.random.default_rng(4).standard_normal((P, H, K, V)), jnp.float32)
    grads = sg.backward(arrays["q"], arrays["k"], arrays["v"], do, g=arrays["g"], initial_state=arrays["initial_state"],
                        dht=dht, ssm_state_indices=indices)
    _, vjp = jax.vjp(lambda a: sg.forward(**a, output_final_state=True, ssm_state_indices=indices), arrays)
    want = vjp((do, dht))[0]
    np.testing.assert_allclose(grads.dinitial_state, want["initial_state"], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"dht must have shape \[P, H, K, V\] like the pool"):
        sg.backward(arrays["q"], arrays["k"], arrays["v"], do, initial_state=arrays["initial_state"], dht=dht[:3],
                    ssm_state_indices=indices)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("op", ["simple_gla", "kda"])
def test_traced_indices_that_break_the_rules_give_nan_never_a_race(op, implementation):
    arrays = inputs(op, 1)
    run = jax.jit(lambda arrays, indices: call(op, arrays, indices, implementation, output_final_state=True))
    before = np.asarray(arrays["initial_state"])
    o, pool = run(arrays, jnp.asarray([3, 3, 0], jnp.int32))  # two sequences write row 3
    pool = np.asarray(pool)
    assert np.isnan(pool[3]).all() and np.isfinite(pool[0]).all()
    np.testing.assert_array_equal(pool[[1, 2, 4, 5]], before[[1, 2, 4, 5]])
    assert np.isfinite(np.asarray(o)[2]).all()
    # Gathered first, both writers read row 3 as it was; a kernel serving the pool may let one read the other's write,
    # so their outputs are NaN there (docs/ops.md).
    assert np.isfinite(np.asarray(o)).all() if implementation is None else np.isnan(np.asarray(o)[:2]).all()
    o, pool = run(arrays, jnp.asarray([0, P, 1], jnp.int32))  # past the pool, which a kernel must never address
    assert np.isnan(np.asarray(o)[1]).all() and np.isfinite(np.asarray(o)[[0, 2]]).all()
    np.testing.assert_array_equal(np.asarray(pool)[2:], before[2:])


@pytest.mark.parametrize(("implementation", "dims"), [(None, (K, V)), ("tpu_pallas.varlen", (128, 128))], ids=["gathered", "varlen-in-place"])
@pytest.mark.parametrize("op", ["simple_gla", "kda"])
def test_a_packed_pool_call_that_breaks_a_traced_rule_is_nan_where_it_writes_and_nowhere_else(op, implementation, dims):
    arrays = inputs(op, 17, batch=1, dims=dims)
    before = np.asarray(arrays["initial_state"])
    run = jax.jit(lambda arrays, cu_seqlens, indices: call(op, arrays, indices, implementation, cu_seqlens=cu_seqlens,
                                                           output_final_state=True))
    o, pool = (np.asarray(x) for x in run(arrays, jnp.asarray([0, 5, 8, 17], jnp.int32), jnp.asarray([2, 2, 4], jnp.int32)))
    assert np.isnan(pool[2]).all(), "a row two sequences write"
    if implementation is None:  # gathered rows: only the contested row
        assert np.isfinite(pool[4]).all() and np.isfinite(o).all()
    else:  # in place, the sequences share the packed inputs: every output and every row the call writes
        assert np.isnan(pool[4]).all() and np.isnan(o).all()
    np.testing.assert_array_equal(pool[[0, 1, 3, 5]], before[[0, 1, 3, 5]])
    o, pool = (np.asarray(x) for x in run(arrays, jnp.asarray([0, 9, 5, 17], jnp.int32), jnp.asarray([2, 1, 4], jnp.int32)))
    assert np.isnan(o).all() and np.isnan(pool[[1, 2, 4]]).all(), "boundaries out of order"
    np.testing.assert_array_equal(pool[[0, 3, 5]], before[[0, 3, 5]])


def test_bad_pools_and_indices_are_named():
    arrays = inputs("simple_gla", 1)
    q, k, v, pool = arrays["q"], arrays["k"], arrays["v"], arrays["initial_state"]
    with pytest.raises(ValueError, match=r"ssm_state_indices must be below the pool's P = 6 rows"):
        sg.forward(q, k, v, initial_state=pool, ssm_state_indices=[0, 6, 1])
    with pytest.raises(ValueError, match=r"ssm_state_indices must be distinct where non-negative.*rows \[1\]"):
        sg.forward(q, k, v, initial_state=pool, ssm_state_indices=[1, -1, 1])
    with pytest.raises(ValueError, match=r"ssm_state_indices names rows of a state pool.*pass the pool as initial_state"):
        sg.forward(q, k, v, ssm_state_indices=[0, 1, 2])
    with pytest.raises(ValueError, match=r"ssm_state_indices must have shape \[N\] = \(3,\)"):
        sg.forward(q, k, v, initial_state=pool, ssm_state_indices=[0, 1])
    with pytest.raises(TypeError, match=r"ssm_state_indices must be an int32 array"):
        sg.forward(q, k, v, initial_state=pool, ssm_state_indices=jnp.zeros(3))
    with pytest.raises(ValueError, match=r"initial_state must have shape a pool \[P, H, K, V\]"):
        sg.forward(q, k, v, initial_state=pool[:, :1], ssm_state_indices=[0, 1, 2])
    with pytest.raises(TypeError, match=r"initial_state is a state pool here.*float32, got bfloat16"):
        sg.forward(q, k, v, initial_state=pool.astype(jnp.bfloat16), ssm_state_indices=[0, 1, 2])
    with pytest.raises(ValueError, match=r"initial_state must have rank 4 \(a pool"):
        kda.forward(q, k, v, arrays["q"], jnp.ones((B, 1, H)), initial_state=pool[0], ssm_state_indices=[0, 1, 2])


@pytest.mark.parametrize("op", ["simple_gla", "kda"])
def test_a_donated_pool_is_updated_in_place(op):
    arrays = inputs(op, 1)
    pool = arrays.pop("initial_state")
    step = jax.jit(lambda pool, arrays, indices: call(op, {**arrays, "initial_state": pool}, indices, output_final_state=True),
                   donate_argnums=0)
    text = step.lower(pool, arrays, jnp.asarray(INDICES, jnp.int32)).compile().as_text()
    assert re.search(r"input_output_alias=\{ \{1\}: \(0, \{\}", text), "the pool (argument 0) is the returned pool's buffer"
    pool_type = f"f32[{P},{H},{K},{V}]"
    copies = [line for line in text.splitlines() if re.search(rf"= {re.escape(pool_type)}\S* copy\(", line)]
    assert not copies, copies


def test_explain_says_how_a_pool_is_served_and_that_a_decode_step_runs_token_by_token():
    arrays = inputs("simple_gla", 1)
    text = str(sg.explain(**arrays, output_final_state=True, ssm_state_indices=jnp.asarray(INDICES, jnp.int32)))
    assert text.startswith("state pool: initial_state holds P=6 rows; the core gathers the N=3 rows")
    assert "selected: xla.recurrent" in text and "T=1 <= 16: a decode step" in text
    assert "pairing: xla.recurrent is forward-only; gradients come from xla.chunk's backward" in text
    prefill = inputs("simple_gla", 40)
    assert "selected: xla.chunk" in str(sg.explain(**prefill, ssm_state_indices=jnp.asarray(INDICES, jnp.int32)))
    with tops_core.use(interpret=True):  # the Pallas kernels join, the decode kernel first
        text = str(sg.explain(**arrays, output_final_state=True, ssm_state_indices=jnp.asarray(INDICES, jnp.int32)))
    assert text.startswith("state pool: initial_state holds P=6 rows; the forward reads and writes the N=3 rows")
    assert "selected: tpu_pallas.recurrent" in text


TPU_DECODE_STEP = """
import glob, sys
import jax, jax.numpy as jnp, tops_core
from tops_core.tpu import compile_only

tpu = jax.sharding.SingleDeviceSharding(compile_only.device("v6e"))
B, H, K, V, P = 8, 2, 128, 128, 16
arrays = {name: jax.ShapeDtypeStruct(shape, dtype, sharding=tpu) for name, shape, dtype in (
    ("q", (B, 1, H, K), jnp.bfloat16), ("k", (B, 1, H, K), jnp.bfloat16), ("v", (B, 1, H, V), jnp.bfloat16),
    ("g", (B, 1, H), jnp.float32), ("ssm_state_indices", (B,), jnp.int32))}
pool = jax.ShapeDtypeStruct((P, H, K, V), jnp.float32, sharding=tpu)
step = jax.jit(lambda pool, arrays: tops_core.op("simple_gla").forward(**arrays, initial_state=pool, output_final_state=True),
               donate_argnums=0)
step.lower(pool, arrays).compile()
print(open(sorted(glob.glob(sys.argv[1] + "/*after_optimizations.txt"))[-1]).read())
"""


def test_a_donated_pool_is_updated_in_place_on_a_tpu(tmp_path):
    # Compile-only v6e, in a child process whose XLA dumps the optimised program (the compiled
    # program's own text is not readable for this one: JAX fails on its asynchronous scatter).
    from tops_core.tpu import compile_only

    environment = compile_only.child_environment({"XLA_FLAGS": f"--xla_dump_to={tmp_path} --xla_dump_hlo_pass_re=^$"})
    result = subprocess.run([sys.executable, "-c", TPU_DECODE_STEP, str(tmp_path)], env=environment, capture_output=True,
                            text=True, timeout=300)
    if "CompileOnlyUnavailable" in result.stderr:
        pytest.skip(result.stderr.strip().splitlines()[-1])
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"input_output_alias=\{ \{1\}: \(0, \{\}", result.stdout), "the pool (argument 0) is the returned pool's buffer"
    assert not re.search(r"= f32\[16,2,128,128\]\S* copy\(", result.stdout), "no copy of the pool"
    assert "custom_call_target=\"tpu_custom_call\"" in result.stdout and "tops_recurrent" in result.stdout, "the Pallas decode kernel"


def test_a_kda_pool_has_the_value_heads_with_grouped_heads_and_the_gate():
    rng = np.random.default_rng(5)
    heads, value_heads = 2, 4
    q, k = (jnp.asarray(rng.standard_normal((B, 2, heads, K)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, 2, value_heads, V)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((B, 2, value_heads, K)), jnp.float32)
    beta = jnp.asarray(rng.standard_normal((B, 2, value_heads)), jnp.float32)
    pool = jnp.asarray(rng.standard_normal((P, value_heads, K, V)), jnp.float32)
    options = dict(use_qk_l2norm=True, use_gate=True, A_log=jnp.zeros(value_heads), dt_bias=jnp.zeros(value_heads * K),
                   use_beta_sigmoid=True, output_final_state=True)
    o, written = kda.forward(q, k, v, g, beta, initial_state=pool, ssm_state_indices=jnp.asarray(INDICES), **options)
    rows = np.stack([np.asarray(pool)[i] if i >= 0 else np.zeros((value_heads, K, V), np.float32) for i in INDICES])
    want_o, final = kda.forward(q, k, v, g, beta, initial_state=jnp.asarray(rows), implementation="ref.recurrent", **options)
    np.testing.assert_allclose(o, want_o, atol=1e-5)
    np.testing.assert_allclose(np.asarray(written)[[4, 1]], np.asarray(final)[[0, 2]], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(written)[UNTOUCHED], np.asarray(pool)[UNTOUCHED])
