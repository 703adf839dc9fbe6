"""The main job: time every implementation that supports a workload and check it against the reference.

For the workload, each implementation that the matcher accepts on this machine (TPU kernels
only in interpret mode, labelled as interpreted) is timed jitted, forward and forward+backward
(a forward-only kernel with the backward the dispatcher pairs it with). The float64 reference
sweeps token by token on the host, so accuracy and the speedup against it are measured at a
smaller *check* shape unless the workload itself is small; the table says which.

Each timing at the workload takes turns with one flat ``[B*T*H, K] @ [K, V]`` product in the
workload's dtype, the best-shaped product any algorithm with these head dims could have: its
rate is the *ceiling*, and an implementation's share of it is the op's counted FLOPs
(``forward_flops``) at that rate over the implementation's time. Taking turns puts both under
the same load when other jobs share the machine. The float64 reference's share is not given: it
runs another algorithm, on the host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from tops_core.callspec import CallSpec
from tops_core.capabilities import FLOAT_DTYPES
from tops_core.conformance import data
from tops_core.conformance.cases import Case
from tops_core.conformance.checks import REFERENCE, compare, evaluate
from tops_core.dispatch import NoImplementationError
from tops_core.implementation import Implementation
from tops_core.ops import op
from tops_core.ops.base import platform_of, state_dtype
from tops_core.policy import current_policy
from tops_core.registry import default_registry

DEFAULT_FEATURES = {"simple_gla": ["g_gamma"], "kda": ["use_qk_l2norm"], "gla": [], "gated_delta_rule": ["use_qk_l2norm"]}
REFERENCE_MAX_ELEMENTS = 2**24
"""The reference is timed at the workload itself only up to this many ``B*T*H*K*V`` state elements."""
COUNTED_CHUNK = 64
"""The chunk size the FLOP counts assume."""


@dataclasses.dataclass(frozen=True)
class Timing:
    median: float
    spread: float  # half the interquartile range, relative to the median
    repeats: int

    def describe(self) -> str:
        value, unit = (self.median * 1e3, "ms") if self.median < 1 else (self.median, "s")
        return f"{value:.3g} {unit} ±{self.spread * 100:.0f}%"


@dataclasses.dataclass
class Row:
    implementation: str
    selected: str = ""
    interpreted: bool = False
    forward: Timing | None = None
    forward_backward: Timing | None = None
    backward_by: str | None = None  # the paired backward of a forward-only implementation
    differentiable: bool = True
    forward_share: float | None = None  # of the ceiling, at the workload
    forward_backward_share: float | None = None
    check_forward: Timing | None = None
    check_forward_backward: Timing | None = None
    forward_error: float | None = None
    gradient_error: float | None = None
    within_tolerance: bool | None = None
    note: str = ""


@dataclasses.dataclass
class Report:
    workload: Case
    check: Case | None
    """Where accuracy and the speedup against the reference were measured; None when they were not."""
    platform: str
    reference_at_workload: bool
    rows: list[Row]
    ceiling: list[Timing] = dataclasses.field(default_factory=list)
    """The flat product's timings, one beside each timing at the workload but the reference's."""
    ceiling_flops: float = 0.0
    accuracy_not_checked: str | None = None
    """Why no row was checked against the reference; None when every row was."""

    def ceiling_rates(self) -> tuple[float, float] | None:
        """The lowest and highest FLOP/s of the flat product in this run."""
        if not self.ceiling:
            return None
        medians = [timing.median for timing in self.ceiling]
        return self.ceiling_flops / max(medians), self.ceiling_flops / min(medians)


def default_dtype(platform: str) -> str:
    """float32 on CPU (no fast bfloat16 matmul there), bfloat16 on accelerators."""
    return "float32" if platform == "cpu" else "bfloat16"


def workload(
    op_name: str, shape: Sequence[int], dtype: str, features: Sequence[str], num_seqs: int | None = None, value_heads: int | None = None,
) -> Case:
    """The benchmark call; with ``cu_seqlens`` (``B == 1``) the ``T`` tokens are packed into ``num_seqs`` uneven sequences.
    ``value_heads``: kda's ``HV`` (default: ``2H`` with ``grouped_value_heads``, else ``H``)."""
    B, T, H, K, V = shape
    contract = op(op_name)
    unknown = set(features) - contract.features
    if unknown:
        raise ValueError(f"unknown feature(s) {sorted(unknown)} for {op_name}; known: {', '.join(sorted(contract.features))}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}")
    case = Case(op_name, "workload", dtype=dtype, batch=B, seq_len=T, heads=H, key_dim=K, value_dim=V, value_heads=value_heads)
    if "cu_seqlens" not in features:
        if num_seqs is not None:
            raise ValueError("the number of sequences only applies to packed workloads (with cu_seqlens)")
        return case.with_features("workload", frozenset(features))
    if B != 1:
        raise ValueError(f"cu_seqlens packs the sequences along T and requires B == 1, got B = {B}")
    num_seqs = 1 if num_seqs is None else num_seqs
    if num_seqs < 1:
        raise ValueError(f"the number of packed sequences must be at least 1, got {num_seqs}")
    return case.with_features("workload", frozenset(features), seq_len=T, seqlens=packed_lengths(num_seqs, T))


def forward_flops(case: Case, chunk_size: int = COUNTED_CHUNK) -> float:
    """The forward's FLOPs as this project counts them (each op's ``counted_flops_per_token``): the chunked
    algorithm's matrix products, causal triangles counted whole; forward+backward counts 3x this."""
    per_token = op(case.op).counted_flops_per_token(case.key_dim, case.value_dim, chunk_size)
    return case.batch * case.seq_len * case.value_heads * per_token


def flat_product(case: Case) -> tuple[Callable, tuple, float]:
    """One ``[B*T*H, K] @ [K, V]`` product in the workload's dtype, jitted, with its arguments and FLOPs."""
    rows = case.batch * case.seq_len * case.value_heads
    keys = jax.random.split(jax.random.PRNGKey(0))
    tokens = jax.random.normal(keys[0], (rows, case.key_dim), jnp.dtype(case.dtype))
    state = jax.random.normal(keys[1], (case.key_dim, case.value_dim), jnp.dtype(case.dtype))
    return jax.jit(jnp.dot), (tokens, state), 2.0 * rows * case.key_dim * case.value_dim


def packed_lengths(num_seqs: int, seq_len: int) -> tuple[int, ...]:
    """``num_seqs`` lengths summing to ``seq_len``, alternately a third shorter and a third longer than
    the mean, so that boundaries fall off any chunk grid."""
    mean = seq_len // num_seqs
    lengths = [mean - mean // 3 if i % 2 == 0 else mean + mean // 3 for i in range(num_seqs)]
    if num_seqs % 2:
        lengths[-1] = mean
    lengths[-1] += seq_len - sum(lengths)
    return tuple(lengths)


def check_shape(case: Case) -> Case:
    """A shape the float64 reference handles in seconds, with the workload's head dims and features."""
    seq_len = min(case.seq_len, 512)
    heads = min(case.heads, 4)
    changes: dict[str, Any] = dict(
        batch=1 if case.seqlens is None else case.batch, seq_len=seq_len, heads=heads, value_heads=heads * (case.value_heads // case.heads),
    )
    if case.seqlens is not None:
        changes["seqlens"] = packed_lengths(min(len(case.seqlens), seq_len), seq_len)
    return dataclasses.replace(case, name="check", **changes)


def elements(case: Case) -> int:
    return case.batch * case.seq_len * case.value_heads * case.key_dim * case.value_dim


REFERENCE_PLUGIN = "pip install -e plugins/tops_plugins_ref"
"""How the reference is installed: from this repository (it is not published)."""


def reference_unavailable(case: Case, platform: str) -> str | None:
    """Why ``case`` cannot be checked against the float64 reference here; None when it can."""
    registry = default_registry()
    reference = next((impl for impl in registry.implementations(case.op) if impl.name == REFERENCE), None)
    if reference is not None:
        reasons = reference.reasons(case.spec(platform, interpret=False), "backward")
        return f"the float64 reference ({REFERENCE}) does not support this workload here: {'; '.join(reasons)}" if reasons else None
    why = [f"plugin {plugin.name!r} is quarantined: {plugin.error}" for plugin in registry.quarantined() if plugin.name == "ref"]
    why += registry.environment_notes()  # TOPS_PLUGINS or TOPS_DISABLE_PLUGIN_AUTOLOAD kept it from loading
    return (f"the float64 reference ({REFERENCE}) is not registered" + (f" ({'; '.join(why)})" if why else "")
            + f"; it comes with the reference plugin ({REFERENCE_PLUGIN})")


@dataclasses.dataclass(frozen=True)
class MemoryNeed:
    """Bytes a benchmark of a workload holds at once (``memory_needed``): its arrays where it runs, and the
    float64 test data they are drawn from on the host (on a CPU, the same memory)."""

    arrays: int
    test_data: int


COVERED_BY_THE_MEMORY_ESTIMATE = ("inputs, outputs, gradients and their float64 test data, the flat product and per-chunk states; "
                                  "an implementation's other working memory comes on top")


def memory_needed(case: Case) -> MemoryNeed:
    """What a benchmark of ``case`` holds at once, estimated before anything is allocated.

    Counted: the inputs, ``o``, ``do`` and the gradients in the workload's dtypes (gates and states in
    their accumulator dtype); the flat product's operands and result; a chunked algorithm's state per
    chunk of ``COUNTED_CHUNK`` tokens, sequence and head; and the float64 arrays the test data is drawn
    in before it is cast (``q``, ``k``, ``v``, ``do``, the gates, the states). Not counted: whatever else
    an implementation keeps while it runs. ``xla.chunk``'s benchmark peaked at 63-77% of the sum on a CPU
    (resident memory above the process's own, simple_gla and kda, float32 and bfloat16, 1-2.6 GiB estimated).
    """
    B, T, H, K, V = case.batch, case.seq_len, case.value_heads, case.key_dim, case.value_dim  # q and k counted per value head: an upper bound
    itemsize, state_itemsize, tokens = jnp.dtype(case.dtype).itemsize, state_dtype(case.dtype).itemsize, B * T * H
    gates = gate_elements(case)
    inputs = tokens * ((2 * K + V) * itemsize + gates * state_itemsize)
    outputs = tokens * V * itemsize  # o, and do the same
    sequences = len(case.seqlens) if case.seqlens is not None else B
    states = len({"initial_state", "output_final_state"} & case.features) * sequences * H * K * V  # h0 or dht, each with its gradient
    flat = tokens * (K + V) * itemsize + K * V * itemsize
    chunk_states = B * H * math.ceil(T / COUNTED_CHUNK) * K * V * state_itemsize
    drawn = tokens * (2 * K + 2 * V + gates) + states
    return MemoryNeed(arrays=2 * inputs + 2 * outputs + 2 * states * state_itemsize + flat + chunk_states, test_data=drawn * 8)


def gate_elements(case: Case) -> int:
    """Elements per token and value head of the inputs besides ``q``, ``k`` and ``v`` that ``case`` passes (``g``, ``beta``)."""
    return sum(case.key_dim if per_token == "k" else 1 for per_token in op(case.op).gate_inputs(case.features).values())


def host_memory_available() -> int | None:
    """Bytes this host can still give a process: Linux's MemAvailable, else the free pages; None when unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # a name this system does not know, or not POSIX at all
        return None


def device_memory_available() -> int | None:
    """Bytes JAX's default device can still allocate, where it says (GPU, TPU); None when it does not (CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0) if "bytes_limit" in stats else None


def check_memory(case: Case, platform: str) -> None:
    """Refuse a workload whose ``memory_needed`` is more than this machine has available, before anything is allocated."""
    need = memory_needed(case)
    if platform == "cpu":
        checks = [("memory", need.arrays + need.test_data, host_memory_available())]
    else:
        checks = [(f"{platform} memory", need.arrays, device_memory_available()), ("host memory", need.test_data, host_memory_available())]
    for memory, needed, available in checks:
        if available is not None and needed > available:
            raise ValueError(f"{describe_shape(case)} {case.dtype} needs about {_bytes(needed)} of {memory} ({COVERED_BY_THE_MEMORY_ESTIMATE}), "
                             f"more than the {_bytes(available)} available; choose a smaller shape")


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.3g} {unit}"
        count /= 1024
    return f"{count:.3g} TiB"


def split_arguments(inputs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(differentiable arrays, other arrays, static options) of a forward call."""
    floats = {k: v for k, v in inputs.items() if isinstance(v, jax.Array) and jnp.issubdtype(v.dtype, jnp.floating)}
    others = {k: v for k, v in inputs.items() if isinstance(v, jax.Array) and k not in floats}
    static = {k: v for k, v in inputs.items() if not isinstance(v, jax.Array)}
    return floats, others, static


def programs(case: Case, name: str) -> tuple[Callable, Callable, tuple, tuple]:
    """Jitted forward and forward+backward of ``name`` on the case's data, with their arguments."""
    contract = op(case.op)
    inputs = data.forward_inputs(case)
    floats, others, static = split_arguments(inputs)
    do = data.backward_inputs(case, inputs)["do"]

    def output(floats, others):
        return contract.forward(**floats, **others, **static, implementation=name)[0]

    def forward_backward(floats, others, do):
        o, pullback = jax.vjp(lambda f: output(f, others), floats)
        return o, pullback(do)

    return jax.jit(output), jax.jit(forward_backward), (floats, others), (floats, others, do)


def time_call(function: Callable, args: tuple, budget: float, max_repeats: int) -> Timing:
    """Median and spread of wall time after one warm-up (compile) call."""
    return time_turns([(function, args)], budget, max_repeats)[0]


def time_turns(calls: Sequence[tuple[Callable, tuple]], budget: float, max_repeats: int) -> list[Timing]:
    """``time_call`` of several calls taking turns, so that load changes hit all of them alike."""
    for function, args in calls:
        jax.block_until_ready(function(*args))
    times: list[list[float]] = [[] for _ in calls]
    while len(times[0]) < 3 or (len(times[0]) < max_repeats and sum(map(sum, times)) < budget):
        for (function, args), column in zip(calls, times):
            start = time.perf_counter()
            jax.block_until_ready(function(*args))
            column.append(time.perf_counter() - start)
    return [_timing(column) for column in times]


def _timing(times: list[float]) -> Timing:
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    median = statistics.median(times)
    return Timing(median, (quartiles[2] - quartiles[0]) / 2 / median, len(times))


class Progress:
    """Progress on stderr: a one-line bar on a terminal, one plain line per step otherwise (logs, CI)."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.stream = total, 0, stream or sys.stderr
        self.terminal = self.stream.isatty()

    def step(self, label: str) -> None:
        if self.terminal:
            filled = int(24 * self.done / max(self.total, 1))
            self.stream.write(f"\r[{'#' * filled}{'.' * (24 - filled)}] {self.done}/{self.total} {label:<48.48}")
        else:
            self.stream.write(f"[{self.done + 1}/{self.total}] {label}\n")
        self.stream.flush()
        self.done += 1

    def close(self) -> None:
        if self.terminal:
            self.stream.write("\r" + " " * 80 + "\r")
            self.stream.flush()


def candidates(case: Case, platform: str, names: Sequence[str] | None) -> tuple[list[Implementation], CallSpec]:
    """The implementations that run ``case`` here (only ``names``, when given); naming one that cannot is an error."""
    contract = op(case.op)
    policy = current_policy(case.op)
    spec = case.spec(platform, policy.interpret)
    registered = {impl.name: impl for impl in contract.implementations()}
    if names:
        unknown = sorted(set(names) - set(registered))
        if unknown:
            raise ValueError(f"unknown implementation(s) {unknown} of {case.op}; registered: {', '.join(sorted(registered))}")
        for name in names:
            reasons = registered[name].reasons(spec, "forward")
            if reasons:
                raise ValueError(f"{name} cannot run this workload here: {'; '.join(reasons)}")
    implementations = [impl for impl in registered.values() if not impl.reasons(spec, "forward") and (not names or impl.name in names)]
    return sorted(implementations, key=lambda impl: impl.name), spec


@contextlib.contextmanager
def dtype_scope(case: Case) -> Iterator[None]:
    """float64 workloads need x64 on, or their arrays would silently be float32."""
    with contextlib.ExitStack() as stack:
        if case.dtype == "float64":
            stack.enter_context(jax.enable_x64(True))
        yield


def run(case: Case, names: Sequence[str] | None = None, budget: float = 2.0, max_repeats: int = 10) -> Report:
    """Benchmark ``case`` on this machine; see the module docstring."""
    with dtype_scope(case):
        return _run(case, names, budget, max_repeats)


def _run(case: Case, names: Sequence[str] | None, budget: float, max_repeats: int) -> Report:
    platform = platform_of([])
    contract = op(case.op)
    implementations, spec = candidates(case, platform, names)
    if not implementations:
        raise NoImplementationError(f"no implementation of {case.op} supports {spec.describe()} here (`tops explain` says why)")
    not_checked = reference_unavailable(case, platform)
    reference_at_workload = not_checked is None and elements(case) <= REFERENCE_MAX_ELEMENTS
    check = None if not_checked else case if reference_at_workload else check_shape(case)
    policy = current_policy(case.op)
    selected = {"fwd": contract.decide(spec, "forward", policy).implementation.name}
    try:
        selected["bwd"] = contract.decide(spec, "backward", policy).implementation.name
    except NoImplementationError:
        pass

    rows = []
    for impl in implementations:
        row = Row(impl.name, interpreted=impl.capabilities.interpreted(spec))
        row.selected = "+".join(label for label, name in selected.items() if name == impl.name)
        if impl.backward is None:
            row.backward_by = _paired_backward(case, spec, impl.name)
            row.differentiable = row.backward_by is not None
        if impl.name == REFERENCE and not reference_at_workload:
            row.note = "not timed at the workload (a sequential host sweep: seconds to minutes there)"
        rows.append(row)
    checked = check is not None
    shapes = {row.implementation: [] if row.note else [case] for row in rows}
    if checked and not reference_at_workload:  # timed at the check shape too, for the speedup against the reference
        for timed in shapes.values():
            timed.append(check)
    progress = Progress(total=int(checked) + sum(
        len(shapes[row.implementation]) * (1 + row.differentiable) + int(checked) for row in rows))

    report = Report(case, check, platform, reference_at_workload, rows, accuracy_not_checked=not_checked)
    flat, flat_args, report.ceiling_flops = flat_product(case)
    reference = None
    if checked:
        progress.step(f"{REFERENCE} at the check shape")
        reference = evaluate(check, REFERENCE, backward=True)
    for row in rows:
        for timed in shapes[row.implementation]:
            if timed is case and row.implementation != REFERENCE:
                _time_beside_the_ceiling(row, report, (flat, flat_args), progress, budget, max_repeats)
            else:
                fields = ("forward", "forward_backward") if timed is case else ("check_forward", "check_forward_backward")
                _time(row, timed, progress, budget if timed is case else budget / 2, max_repeats, *fields)
        if reference is not None:
            progress.step(f"{row.implementation} accuracy")
            _accuracy(row, check, reference)
    progress.close()
    return report


def _time(row: Row, case: Case, progress: Progress, budget: float, max_repeats: int, forward_field: str, both_field: str) -> None:
    forward, forward_backward, forward_args, backward_args = programs(case, row.implementation)
    progress.step(f"{row.implementation} forward, {case.name}")
    setattr(row, forward_field, time_call(forward, forward_args, budget, max_repeats))
    if row.differentiable:
        progress.step(f"{row.implementation} forward+backward, {case.name}")
        setattr(row, both_field, time_call(forward_backward, backward_args, budget, max_repeats))


def _time_beside_the_ceiling(row: Row, report: Report, flat: tuple[Callable, tuple], progress: Progress, budget: float,
                             max_repeats: int) -> None:
    """Time the row at the workload, each call taking turns with the flat product, and its shares of the ceiling."""
    case = report.workload
    forward, forward_backward, forward_args, backward_args = programs(case, row.implementation)
    counted = forward_flops(case)
    progress.step(f"{row.implementation} forward, {case.name}")
    row.forward, ceiling = time_turns([(forward, forward_args), flat], budget, max_repeats)
    report.ceiling.append(ceiling)
    row.forward_share = counted / report.ceiling_flops * ceiling.median / row.forward.median
    if row.differentiable:
        progress.step(f"{row.implementation} forward+backward, {case.name}")
        row.forward_backward, ceiling = time_turns([(forward_backward, backward_args), flat], budget, max_repeats)
        report.ceiling.append(ceiling)
        row.forward_backward_share = 3 * counted / report.ceiling_flops * ceiling.median / row.forward_backward.median


def _paired_backward(case: Case, spec: CallSpec, name: str) -> str | None:
    """The backward the dispatcher pairs a forward-only implementation with, or None when there is none."""
    try:
        return op(case.op).decide(spec, "backward", current_policy(case.op, name)).implementation.name
    except NoImplementationError:
        return None


def _accuracy(row: Row, case: Case, reference: tuple) -> None:
    """Worst relative RMS error of the row's implementation against the reference's results on ``case``."""
    measurements = compare(case, evaluate(case, row.implementation, backward=row.differentiable), reference)
    forward = [m for m in measurements if m.name in ("o", "final_state")]
    gradients = [m for m in measurements if m.name not in ("o", "final_state")]
    row.forward_error = max(m.error for m in forward)
    row.gradient_error = max((m.error for m in gradients), default=None)
    row.within_tolerance = all(m.passed for m in measurements)


def describe_shape(case: Case) -> str:
    """``B=.. T=.. H=.. K=.. V=..`` (and ``HV=..`` with grouped value heads), as the report writes a shape."""
    heads = f"H={case.heads}" + (f" HV={case.value_heads}" if case.value_heads != case.heads else "")
    return f"B={case.batch} T={case.seq_len} {heads} K={case.key_dim} V={case.value_dim}"


def describe_workload(case: Case, platform: str) -> str:
    """The report's first line: the op, the workload and where it runs."""
    shape = describe_shape(case)
    if case.seqlens is not None:
        shape += f" N={len(case.seqlens)}"
    features = ", ".join(sorted(case.features)) or "no optional inputs"
    return f"tops bench {case.op}: {shape} {case.dtype} on {platform}, with {features}"


def failures(report: Report) -> list[str]:
    """The implementations whose results were outside the tolerance."""
    return [row.implementation for row in report.rows if row.within_tolerance is False]


def format_report(report: Report, header: bool = True) -> str:
    """The report as text; ``header=False`` leaves out the workload line (printed before the run)."""
    case = report.workload
    lines = [describe_workload(case, report.platform), ""] if header else []
    reference = next((r for r in report.rows if r.implementation == REFERENCE), None)
    header = ("implementation", "selected", "forward", "fwd+bwd", "speedup vs ref (fwd / fwd+bwd)", "of ceiling (fwd / fwd+bwd)",
              "rel. error (out / grad)")
    table = [header]
    for row in report.rows:
        label = row.implementation + (" [interpreted]" if row.interpreted else "")
        fwd = row.forward.describe() if row.forward else "-"
        fwdbwd = row.forward_backward.describe() if row.forward_backward else ("-" if row.differentiable else "no backward")
        if row.backward_by and row.forward_backward:
            fwdbwd += f" (bwd {row.backward_by})"
        shares = " / ".join("-" if share is None else f"{share:.0%}" for share in (row.forward_share, row.forward_backward_share))
        table.append((label, row.selected or "-", fwd, fwdbwd, _speedup(row, reference, report.reference_at_workload), shares,
                      _errors(row) if report.check else "not checked"))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table]
    lines.append("")
    if report.check is None:
        lines.append(f"Accuracy not checked: {report.accuracy_not_checked}.")
    else:
        check = report.check
        at = "workload" if report.reference_at_workload else describe_shape(check)
        lines.append(f"Speedup and error measured at {at} against the float64 reference ({REFERENCE}); "
                     "errors are relative RMS, 'ok' = within the tolerance for the dtype (docs/ops.md).")
    rates = report.ceiling_rates()
    if rates:
        low, high = (f"{rate / 1e9:.3g}" for rate in rates)
        lines.append(f"Of ceiling: {forward_flops(case) / 1e9:.3g} GFLOP counted for the forward (3x for fwd+bwd; the chunked "
                     f"algorithm's products at chunk {COUNTED_CHUNK}) at the rate of one flat [B*T*H, K] @ [K, V] product "
                     f"timed in turns with each ({low if low == high else f'{low}-{high}'} GFLOP/s), over the measured time.")
    for row in report.rows:
        if row.note:
            lines.append(f"{row.implementation}: {row.note}.")
    return "\n".join(lines)


def report_json(report: Report) -> dict[str, Any]:
    """Every figure of the report as JSON values (timings in seconds, relative errors), for ``tops bench --json``."""
    return {
        "workload": case_json(report.workload),
        "check": None if report.check is None else case_json(report.check),
        "platform": report.platform,
        "accuracy_checked": report.check is not None,
        "accuracy_not_checked": report.accuracy_not_checked,
        "reference_at_workload": report.reference_at_workload,
        "rows": [dataclasses.asdict(row) for row in report.rows],
        "ceiling": {"flops": report.ceiling_flops, "counted_forward_flops": forward_flops(report.workload),
                    "timings": [dataclasses.asdict(timing) for timing in report.ceiling]} if report.rows else None,
    }


def case_json(case: Case) -> dict[str, Any]:
    """A workload's fields as JSON values."""
    fields = dataclasses.asdict(case)
    fields["features"] = sorted(case.features)
    return fields


def _speedup(row: Row, reference: Row | None, at_workload: bool) -> str:
    if reference is None:
        return "-"
    pairs = [("check_forward", "check_forward_backward"), ("forward", "forward_backward")][at_workload]
    parts = []
    for field in pairs:
        mine, theirs = getattr(row, field), getattr(reference, field)
        parts.append(f"{theirs.median / mine.median:.0f}x" if mine and theirs else "-")
    return " / ".join(parts)


def _errors(row: Row) -> str:
    if row.forward_error is None:
        return "-"
    gradient = f"{row.gradient_error:.1e}" if row.gradient_error is not None else "-"
    return f"{row.forward_error:.1e} / {gradient} {'ok' if row.within_tolerance else 'FAIL'}"


def pyplot():
    """matplotlib's pyplot on the Agg backend; a ValueError naming the extra when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'tops-core[plot]'") from None
    return plt


def plot_workloads(case: Case) -> list[Case]:
    """The workloads ``plot`` times, shortest first: ``T`` a quarter, half (at least 64), once and twice the workload's."""
    lengths = sorted({max(case.seq_len // 4, 64), max(case.seq_len // 2, 64), case.seq_len, case.seq_len * 2})
    return [dataclasses.replace(case, seq_len=T, seqlens=None if case.seqlens is None else packed_lengths(len(case.seqlens), T))
            for T in lengths]


def plot(case: Case, names: Sequence[str] | None, path: str, budget: float = 1.0) -> None:
    """A PNG of time against sequence length per implementation, forward and forward+backward."""
    with dtype_scope(case):
        _plot(case, names, path, budget)


def _plot(case: Case, names: Sequence[str] | None, path: str, budget: float) -> None:
    plt = pyplot()
    from matplotlib.ticker import NullLocator

    workloads = plot_workloads(case)
    lengths = [at.seq_len for at in workloads]
    implementations, spec = candidates(case, platform_of([]), names)
    implementations = [impl for impl in implementations if impl.name != REFERENCE or elements(case) * 2 <= REFERENCE_MAX_ELEMENTS]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    progress = Progress(total=2 * len(implementations) * len(lengths))
    for impl in implementations:
        series: dict[str, list[float]] = {"forward": [], "forward+backward": []}
        for at in workloads:
            forward, forward_backward, forward_args, backward_args = programs(at, impl.name)
            progress.step(f"{impl.name} T={at.seq_len} forward")
            series["forward"].append(time_call(forward, forward_args, budget, 5).median)
            progress.step(f"{impl.name} T={at.seq_len} forward+backward")
            series["forward+backward"].append(time_call(forward_backward, backward_args, budget, 5).median)
        for axis, (direction, values) in zip(axes, series.items()):
            label_name = impl.name + (" [interpreted]" if impl.capabilities.interpreted(spec) else "")
            axis.plot(lengths, [v * 1e3 for v in values], marker="o", label=label_name)
            axis.set_title(f"{case.op} {direction}")
    progress.close()
    for axis in axes:
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks(lengths, [str(length) for length in lengths])
        axis.xaxis.set_minor_locator(NullLocator())
        axis.set_xlabel("sequence length T")
        axis.set_ylabel("time (ms)")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.suptitle(f"B={case.batch} H={case.heads} K={case.key_dim} V={case.value_dim} {case.dtype} on {platform_of([])}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
