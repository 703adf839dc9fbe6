"""``tops bench --decode``: a server's decode step on a state pool, timed beside a hand-written step.

The workload: ``B`` running requests, ``T`` tokens each (1, or a few for speculative decoding),
their states in a pool of ``P`` rows (``ssm_state_indices``), the pool donated so that it is
updated in place. Each implementation that serves the call on this machine is timed as a jitted,
donating step, in turns with ``hand_written_step`` (a pair at a time): the same math in plain jax.numpy (gather
the rows, the recurrence token by token, scatter the rows back), the least a decode step can do.
Accuracy: the output and the pool against the float64 reference on the same call.

Off TPU, ``model_on_tpu`` compiles the step for a compile-only TPU (the implementation the
dispatcher picks there) and sets XLA's count of the bytes it accesses against the floor: the
indexed rows read and written once, ``q, k, v`` and the gates read, ``o`` written.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tops_core import bench
from tops_core.conformance import data
from tops_core.conformance.cases import Case
from tops_core.conformance.checks import REFERENCE
from tops_core.conformance.compare import measure, tolerance
from tops_core.ops import op
from tops_core.ops.base import state_dtype
from tops_core.ops.kda import L2NORM_EPSILON, Activations

DEFAULT_SHAPE = (64, 1, 8, 128, 128)
DEFAULT_FEATURES = {"simple_gla": ["g"], "kda": ["use_qk_l2norm"], "gla": [], "gated_delta_rule": ["use_qk_l2norm"]}
SERVED_FEATURES = frozenset({"initial_state", "output_final_state"})
"""What every decode call has: the pool in, the pool out."""


@dataclasses.dataclass(frozen=True)
class Decode:
    """A decode workload: the call (``case``, whose ``batch`` is the running requests) and the pool's rows."""

    case: Case
    pool_rows: int

    def describe(self) -> str:
        c = self.case
        heads = f"H={c.heads}" + (f" HV={c.value_heads}" if c.value_heads != c.heads else "")
        features = ", ".join(sorted(c.features - SERVED_FEATURES)) or "no optional inputs"
        return (f"decode step: {c.op} B={c.batch} T={c.seq_len} {heads} K={c.key_dim} V={c.value_dim} {c.dtype}, "
                f"a pool of {self.pool_rows} rows (donated); {features}")


def workload(op_name: str, shape: Sequence[int], dtype: str, features: Sequence[str], pool_rows: int | None,
             value_heads: int | None = None) -> Decode:
    """The decode call: ``shape`` is ``B, T, H, K, V`` (``T`` small); ``pool_rows`` defaults to ``2 B``."""
    if "cu_seqlens" in features:
        raise ValueError("a decode step runs B requests of T tokens each; packed prefill (cu_seqlens) is the plain tops bench")
    case = bench.workload(op_name, shape, dtype, [*features, *SERVED_FEATURES], value_heads=value_heads)
    rows = 2 * case.batch if pool_rows is None else pool_rows
    if rows < case.batch:
        raise ValueError(f"the pool must hold a row for each of the B = {case.batch} requests, got {rows} rows")
    return Decode(case, rows)


def arrays(decode: Decode) -> tuple[jax.Array, dict[str, Any]]:
    """``(pool, the call's other arguments)``: the requests' states at scattered rows of a pool of random states."""
    inputs = data.forward_inputs(decode.case)
    states = inputs.pop("initial_state")
    rng = np.random.default_rng(7)
    indices = rng.permutation(decode.pool_rows)[: decode.case.batch]
    pool = rng.standard_normal((decode.pool_rows, *states.shape[1:])).astype(states.dtype)
    pool[indices] = np.asarray(states)
    inputs["ssm_state_indices"] = jnp.asarray(indices, jnp.int32)
    return jnp.asarray(pool), inputs


def _arrays_and_options(inputs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(every array, the static options) of a call: a decode step takes its arrays as one argument."""
    floats, others, static = bench.split_arguments(inputs)
    return {**floats, **others}, static


def tops_step(decode: Decode, implementation: str | None, inputs: dict[str, Any]):
    """The op as a server calls it: jitted, the pool donated; ``implementation`` None lets the dispatcher choose."""
    contract = op(decode.case.op)
    static = _arrays_and_options(inputs)[1]

    @functools.partial(jax.jit, donate_argnums=0)
    def step(pool, arrays):
        return contract.forward(**arrays, **static, initial_state=pool, implementation=implementation)

    return step


def hand_written_step(decode: Decode, inputs: dict[str, Any]):
    """The same decode step written directly in jax.numpy (no validation, no dispatch), jitted, the pool donated."""
    case, static = decode.case, _arrays_and_options(inputs)[1]
    scale = static.get("scale", case.key_dim**-0.5)
    activations = Activations.of(static.get("use_gate", False), static.get("lower_bound"), static.get("use_beta_sigmoid", False),
                                 static.get("allow_neg_eigval", False))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(pool, arrays):
        dtype = state_dtype(arrays["q"].dtype)
        rows = arrays["ssm_state_indices"]
        state = pool[rows].astype(dtype)
        q, k, v = (arrays[name].astype(dtype) for name in ("q", "k", "v"))
        if case.op == "simple_gla":
            decay = sum(arrays[name].astype(dtype) for name in ("g", "g_gamma") if name in arrays) + jnp.zeros(q.shape[:3], dtype)
        elif case.op == "gla":
            decay = arrays["g"].astype(dtype)
        else:  # the delta rule: kda's gate per key, gated_delta_rule's per head (as one of width 1)
            A_log, dt_bias = arrays.get("A_log"), arrays.get("dt_bias")
            g = arrays["g"] if case.op == "kda" else arrays["g"][..., None]
            decay = activations.decay(g, None if A_log is None else A_log[:, None],
                                      None if dt_bias is None else dt_bias.reshape(case.value_heads, case.key_dim)).astype(dtype)
            beta = activations.strength(arrays["beta"]).astype(dtype)
            if static.get("use_qk_l2norm"):
                q, k = (x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPSILON) for x in (q, k))
            q, k = (jnp.repeat(x, case.value_heads // case.heads, axis=2) for x in (q, k))
        outputs = []
        for t in range(case.seq_len):
            if case.op in ("simple_gla", "gla"):  # one decay per head, or per key row
                state = jnp.exp(decay[:, t]).reshape(*state.shape[:2], -1, 1) * state + k[:, t, :, :, None] * v[:, t, :, None, :]
            else:
                state = jnp.exp(decay[:, t])[..., None] * state
                delta = beta[:, t, :, None] * (v[:, t] - jnp.einsum("bhk,bhkv->bhv", k[:, t], state, precision="highest"))
                state = state + k[:, t, :, :, None] * delta[..., None, :]
            outputs.append(jnp.einsum("bhk,bhkv->bhv", q[:, t] * scale, state, precision="highest"))
        o = jnp.stack(outputs, axis=1).astype(arrays["v"].dtype)
        return o, pool.at[rows].set(state.astype(pool.dtype))

    return step


class _Loop:
    """A donating step called again and again, each call fed the pool the last one returned."""

    def __init__(self, step, pool: jax.Array, arrays: dict[str, Any]):
        self.step, self.pool, self.arrays = step, jnp.array(pool), arrays  # a copy: the first call donates it

    def __call__(self):
        o, self.pool = self.step(self.pool, self.arrays)
        return self.pool


@dataclasses.dataclass(frozen=True)
class Row:
    implementation: str  # "hand-written" for the baseline
    timing: bench.Timing
    baseline: bench.Timing  # the hand-written step's, timed in turns with this one
    errors: dict[str, float]  # "o", "pool": relative error against the float64 reference (the baseline's included)
    passed: bool

    @property
    def ratio(self) -> float:
        return self.timing.median / self.baseline.median


def run(decode: Decode, names: Sequence[str] | None = None, budget: float = 2.0, max_repeats: int = 30) -> list[Row]:
    """Time each implementation that serves the decode call here (or those named), each in turns with the hand-written
    step alone: a step timed right after another implementation's larger one pays for what that one left in the caches."""
    pool, inputs = arrays(decode)
    arrays_only = _arrays_and_options(inputs)[0]
    candidates, _ = bench.candidates(decode.case, bench.platform_of([]), names)
    hand_written = hand_written_step(decode, inputs)
    steps = {impl.name: tops_step(decode, impl.name, inputs) for impl in candidates if impl.name != REFERENCE}
    timings = {name: bench.time_turns([(_Loop(hand_written, pool, arrays_only), ()), (_Loop(step, pool, arrays_only), ())],
                                      budget, max_repeats) for name, step in steps.items()}
    baseline = min((pair[0] for pair in timings.values()), key=lambda timing: timing.median, default=None)
    if baseline is None:
        baseline = bench.time_call(_Loop(hand_written, pool, arrays_only), (), budget, max_repeats)
    want = _reference(decode, pool, inputs)
    rows = []
    for name, step in {"hand-written": hand_written, **steps}.items():
        base, timing = timings[name] if name in timings else (baseline, baseline)
        got = step(jnp.array(pool), arrays_only)
        results = {label: measure(label, x, w, tolerance(decode.case.dtype, gradient=False)) for label, x, w in zip(("o", "pool"), got, want)}
        rows.append(Row(name, timing, base, {label: r.error for label, r in results.items()},
                        all(r.passed for r in results.values())))
    return rows


def _reference(decode: Decode, pool: jax.Array, inputs: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    with jax.enable_x64(True):
        wide = {k: jnp.asarray(np.asarray(v, np.float64)) if isinstance(v, jax.Array) and jnp.issubdtype(v.dtype, jnp.floating) else v
                for k, v in inputs.items()}
        o, written = op(decode.case.op).forward(**wide, initial_state=jnp.asarray(np.asarray(pool, np.float64)), implementation=REFERENCE)
        return np.asarray(o), np.asarray(written)


def format_rows(decode: Decode, rows: list[Row], platform: str) -> str:
    lines = [f"{decode.describe()}; on {platform}", "",
             "  implementation   time              vs hand-written (in turns with it)   error o    error pool"]
    for row in rows:
        verdict = "" if row.passed else "  OUTSIDE THE TOLERANCE"
        lines.append(f"  {row.implementation:<16} {row.timing.describe():<17} {row.ratio:>6.2f}x{'':<29}"
                     f"{row.errors['o']:<10.2e} {row.errors['pool']:.2e}{verdict}")
    return "\n".join(lines)


def rows_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [{"implementation": row.implementation, "median_s": row.timing.median, "spread": row.timing.spread,
             "repeats": row.timing.repeats, "hand_written_median_s": row.baseline.median, "ratio_to_hand_written": row.ratio,
             "errors": row.errors, "within_tolerance": row.passed} for row in rows]


def floor_bytes(decode: Decode) -> int:
    """What a decode step must move: each request's row read and written once (in the states' dtype), its tokens and
    gates read and its outputs written (in their dtypes)."""
    c = decode.case
    itemsize, states = jnp.dtype(c.dtype).itemsize, state_dtype(c.dtype).itemsize
    tokens = c.batch * c.seq_len
    gates = c.value_heads * bench.gate_elements(c)
    return (2 * c.batch * c.value_heads * c.key_dim * c.value_dim * states
            + tokens * (2 * c.heads * c.key_dim + 2 * c.value_heads * c.value_dim) * itemsize + tokens * gates * states)


def model_on_tpu(decode: Decode, generation: str) -> dict[str, Any]:
    """XLA's count of the bytes the decode step accesses, compiled for a compile-only ``generation`` TPU in a child
    process (libtpu stays out of this one), against ``floor_bytes``."""
    from tops_core.tpu import compile_only

    environment = compile_only.child_environment()
    request = json.dumps({"generation": generation, "case": dataclasses.asdict(decode.case), "pool_rows": decode.pool_rows}, default=list)
    result = subprocess.run([sys.executable, "-m", "tops_core.decode_bench", request], env=environment, capture_output=True,
                            text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"compiling the decode step for {generation} failed:\n{result.stderr[-3000:]}")
    accessed, implementation = json.loads(result.stdout.strip().splitlines()[-1])
    floor = floor_bytes(decode)
    return {"generation": generation, "implementation": implementation, "bytes_accessed": accessed, "floor_bytes": floor,
            "ratio_to_floor": accessed / floor}


def format_model(model: dict[str, Any]) -> str:
    return (f"Modelled on a compile-only TPU {model['generation']} ({model['implementation']}, XLA's cost analysis): "
            f"{model['bytes_accessed'] / 2**20:.1f} MiB accessed, {model['ratio_to_floor']:.2f}x the floor of "
            f"{model['floor_bytes'] / 2**20:.1f} MiB (the rows read and written once, the tokens read, o written)")


def _compile_for_tpu(request: dict[str, Any]) -> tuple[float, str]:
    """In the child process: ``(bytes accessed, the implementation chosen)`` of the step compiled for the TPU."""
    from tops_core.tpu import compile_only

    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in request["case"].items()}
    fields.update(features=frozenset(fields["features"]), ndims=tuple(map(tuple, fields["ndims"])))
    decode = Decode(Case(**fields), request["pool_rows"])
    pool, inputs = arrays(decode)
    arrays_only, static = _arrays_and_options(inputs)
    contract = op(decode.case.op)
    step = jax.jit(lambda pool, arrays: contract.forward(**arrays, **static, initial_state=pool), donate_argnums=0)
    on_tpu = jax.sharding.SingleDeviceSharding(compile_only.device(request["generation"]))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_tpu), (pool, arrays_only))
    cost = step.lower(*abstract).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    spec = dataclasses.replace(decode.case.spec("tpu", interpret=False), chip=request["generation"])
    return float(cost["bytes accessed"]), contract.decide(spec, "forward").implementation.name


if __name__ == "__main__":
    print(json.dumps(_compile_for_tpu(json.loads(sys.argv[1]))))
