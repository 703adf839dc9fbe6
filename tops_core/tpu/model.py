"""``tops bench``'s modelled TPU section: a cost model of each TPU kernel, per generation, read from the compiled kernel.

It is a model: nothing runs. Every implementation that supports the workload natively on TPU
(the float64 reference excepted, it runs on the host) is forced through the public op and compiled
for a compile-only device of the generation by ``compile_only.DumpingCompiler``, whose libtpu
dumps each Mosaic kernel (``llo``). For each kernel:

- **HBM time**: the bytes its cost estimate declares (for this project's kernels, the traffic model
  of the launch plan that built it) over the chip's HBM bandwidth;
- **issue time**: the cycles its scheduled VLIW program issues (the backend's final bundles, every
  loop times its trip count, the kernel's body once per grid step) over the clock: the vector ALU,
  load/store, EUP, XLU and result-pop slots, register spills included, and the dependency chains the
  scheduler could not hide;
- **MXU time**: the LHS rows its pushes stream through the systolic arrays (Mosaic's final LLO),
  each worth ``2 * edge**2`` flops, over the peak rate: what a push of a few rows wastes of a wide
  MXU counts in full.

The kernel's modelled time is the largest of the three, and that one is the **limit that binds**.
When issue binds, the model also says whether the VLIW slots explain it (the busiest unit's
instructions in the scheduled program over its slots per bundle) or dependency chains do (the
schedule is much longer than its busiest unit needs). The op's time adds its kernels and the relayout copies XLA puts around
them (read off the compiled program) at HBM bandwidth, in two settings:

- **alone**: ``q``, ``k``, ``v`` are the program's ``[B, T, H, D]`` parameters;
- **in a layer**: every per-token argument (``q``, ``k``, ``v``, and ``g`` and ``beta`` where the op takes
  them per token) comes from ``x @ W`` reshaped to heads, and ``o`` is reshaped back and projected, as in
  a model.

An implementation with its own backward is modelled backward too: its backward alone as a training step runs it (the
pullback of ``jax.vjp``, given the inputs and what the forward hands on, ``Implementation.residuals``; with the final
state's cotangent ``dht`` when the workload outputs the final state; its kernels modelled the same way), against the
backward's floor, which reads ``q``, ``k``, ``v``,
``do`` and writes ``dq``, ``dk``, ``dv`` once, and reads each gate given per token (``g``, kda's ``beta``) and
writes its gradient; any other gradient, and recomputing the forward's states, is above it.

The floor time reads ``q``, ``k``, ``v`` and the per-token gates and writes ``o`` once at HBM bandwidth. The per-generation
constants (bandwidth, peak, clock, MXUs, VLIW slots) and their sources are in
``generations``. Not modelled: stalls (a DMA that is late, an MXU result not ready when
popped), the pipeline's first and last steps beyond their bundles, anything XLA overlaps across
ops, and how often a loop of traced trips runs: it counts once (a packed kernel's loop over the sequences
with a boundary in a chunk), and the limit says what share of the cycles such loops are. An implementation without a Mosaic kernel (jax.numpy) is listed as not modelled; a section with
nothing modelled is one line saying why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from tops_core.tpu import compile_only, fast_paths, llo
from tops_core.bench import case_json, describe_shape
from tops_core.callspec import CallSpec
from tops_core.conformance import data
from tops_core.conformance.cases import Case
from tops_core.conformance.checks import REFERENCE
from tops_core.ops import op
from tops_core.ops.base import state_dtype
from tops_core.tpu.generations import GENERATIONS, TpuGeneration

LIMITS = ("HBM", "issue", "MXU")
NO_TPU_KERNEL = "has no TPU kernel (no Mosaic kernel in its compiled program)"
"""Why an implementation is not modelled when XLA compiles all of it (jax.numpy): there is no kernel to read."""
CHAINS = 1.5
"""A schedule this many times longer than its busiest unit needs is bound by dependency chains, not slots."""


@dataclasses.dataclass(frozen=True)
class KernelModel:
    """One Mosaic kernel of an implementation, modelled on one generation (seconds for the whole kernel)."""

    name: str
    grid_steps: int
    hbm_bytes: int
    cycles: int  # issued by one TensorCore
    counts: llo.UnitCounts  # Mosaic's instructions, the whole grid
    issued: llo.Issued  # the scheduled program's, by one TensorCore: what the slots take
    hbm_seconds: float
    issue_seconds: float
    mxu_seconds: float
    busiest_unit: str
    busiest_unit_cycles: int  # the cycles the busiest unit's instructions need at its slots per bundle
    traced_loop_cycles: int = 0  # of ``cycles``, those in loops of traced trip counts, each counted once

    @property
    def seconds(self) -> float:
        return max(self.hbm_seconds, self.issue_seconds, self.mxu_seconds)

    @property
    def limit(self) -> str:
        times = dict(zip(LIMITS, (self.hbm_seconds, self.issue_seconds, self.mxu_seconds)))
        return max(LIMITS, key=lambda limit: times[limit])

    def describe_limit(self) -> str:
        if self.limit != "issue":
            return self.limit
        spills = self.spill_share()
        spilled = f"{spills:.0%} of them register spills" if spills else None
        # A loop of traced trips runs as often as the data says (a packed kernel's boundaries), which no compile can count.
        traced = f"{self.traced_loop_cycles / self.cycles:.0%} of the cycles in loops of traced trips, each counted once" if self.traced_loop_cycles else None
        if self.cycles > CHAINS * self.busiest_unit_cycles:
            need = f"{self.cycles / max(self.busiest_unit_cycles, 1):.1f}x the {self.busiest_unit} slots' need"
            return f"issue: dependency chains ({'; '.join(filter(None, (need, spilled, traced)))})"
        notes = "; ".join(filter(None, (spilled, traced)))
        return f"issue: {self.busiest_unit} slots" + (f" ({notes})" if notes else "")

    def spill_share(self) -> float | None:
        """The share of the busiest unit's instructions that move register spills, when that unit is the loads' or the
        stores' (None otherwise): a large share says the register allocator's traffic, not the kernel's own, fills it."""
        issued = self.issued
        moved = {"load": (issued.spill_loads, issued.loads), "store": (issued.spill_stores, issued.stores)}.get(self.busiest_unit)
        return moved[0] / moved[1] if moved and moved[1] else None


@dataclasses.dataclass(frozen=True)
class Setting:
    """The op in one setting: its bytes (kernels and copies around them) and its modelled time."""

    copies: int
    bytes: int
    copy_seconds: float
    seconds: float  # the kernels' modelled times and the copies'


@dataclasses.dataclass(frozen=True)
class Modelled:
    """One implementation compiled for the TPU: its kernels, the op alone and in a layer, and XLA's cost analysis of it alone.

    ``backward_kernels`` and ``backward`` (alone): its own backward's, when it has one. ``training_kernels``: the forward's
    kernels as a training step runs them, where they differ (writing what the forward hands the backward,
    ``Implementation.residuals``); ``forward_backward_in_a_layer``: a training step's modelled time in a layer.
    """

    implementation: str
    kernels: tuple[KernelModel, ...]
    alone: Setting
    in_a_layer: Setting
    xla_bytes: float
    xla_flops: float
    backward_kernels: tuple[KernelModel, ...] = ()
    backward: Setting | None = None
    training_kernels: tuple[KernelModel, ...] = ()

    @property
    def forward_backward_in_a_layer(self) -> float:
        """The forward in a layer, its kernels as a training step runs them, and the backward's kernels."""
        training = sum(k.seconds for k in self.training_kernels) - sum(k.seconds for k in self.kernels) if self.training_kernels else 0.0
        return self.in_a_layer.seconds + training + self.backward.seconds - self.backward.copy_seconds

    @property
    def limit(self) -> str:
        """The limit that binds the slowest kernel."""
        return max(self.kernels, key=lambda kernel: kernel.seconds).describe_limit()


@dataclasses.dataclass(frozen=True)
class TpuModel:
    workload: Case
    generation: TpuGeneration
    rows: tuple[Modelled, ...]
    not_modelled: tuple[tuple[str, str], ...]  # (implementation, why: a predicate, "does not compile: ...")
    unavailable: str | None = None  # why there is no section at all
    share: float = 1.0  # of the chip's bandwidth and peak one device has (a v4 device is one of two TensorCores)

    @property
    def tokens(self) -> int:
        """Tokens times value heads: what the per-token figures divide by."""
        return self.workload.batch * self.workload.seq_len * self.workload.value_heads

    @property
    def gates(self) -> dict[str, str]:
        """The workload's per-token inputs besides q, k and v (``g``, ``beta``), each ``"k"`` (one per key) or ``"1"``."""
        return op(self.workload.op).gate_inputs(self.workload.features)

    @property
    def gate_bytes(self) -> int:
        """The gates' bytes, all tokens and value heads: in their accumulator dtype (float32, float64 for float64)."""
        case = self.workload
        per_token = sum(case.key_dim if size == "k" else 1 for size in self.gates.values())
        return self.tokens * per_token * state_dtype(case.dtype).itemsize

    @property
    def floor_bytes(self) -> int:
        """Read q, k, v and the gates and write o once: ``B*T*(2*H*K + 2*HV*V)`` elements and ``gate_bytes``."""
        case = self.workload
        per_token = 2 * case.heads * case.key_dim + 2 * case.value_heads * case.value_dim
        return case.batch * case.seq_len * per_token * jnp.dtype(case.dtype).itemsize + self.gate_bytes

    @property
    def floor_reads(self) -> str:
        """What the floor reads, for the section's text."""
        return ", ".join(("q", "k", "v", *self.gates))

    @property
    def cores(self) -> int:
        """TensorCores of one device (its cycles per token are each TensorCore's, over its share of the tokens)."""
        return round(self.share * self.generation.tensorcores)

    @property
    def bandwidth(self) -> float:
        return self.generation.hbm_bytes_per_second * self.share

    @property
    def floor_seconds(self) -> float:
        return self.floor_bytes / self.bandwidth

    @property
    def backward_floor_bytes(self) -> int:
        """Read q, k, v, do and write dq, dk, dv once: ``B*T*(4*H*K + 3*HV*V)`` elements; and read each gate and
        write its gradient (``2 gate_bytes``)."""
        case = self.workload
        per_token = 4 * case.heads * case.key_dim + 3 * case.value_heads * case.value_dim
        return case.batch * case.seq_len * per_token * jnp.dtype(case.dtype).itemsize + 2 * self.gate_bytes

    @property
    def backward_floor_moves(self) -> str:
        """What the backward's floor reads and writes, for the section's text."""
        reads = ", ".join(("q", "k", "v", *self.gates, "do"))
        writes = ", ".join("d" + name for name in ("q", "k", "v", *self.gates))
        return f"read {reads} and write {writes} once"

    @property
    def backward_floor_seconds(self) -> float:
        return self.backward_floor_bytes / self.bandwidth


def model(case: Case, generation: str = "v6e", names: Sequence[str] | None = None, compiler: compile_only.DumpingCompiler | None = None) -> TpuModel:
    """Model the workload's forward, and the backward of those that have their own, on a ``generation`` TPU
    with every TPU implementation (or ``names``).

    ``compiler``: a ``DumpingCompiler`` to use (and keep open), for several models in a row; one of
    its own otherwise.
    """
    tpu = GENERATIONS[generation]
    contract = op(case.op)
    spec = tpu_spec(case, generation)
    candidates = [
        impl for impl in sorted(contract.implementations(), key=lambda impl: impl.name)
        if impl.name != REFERENCE and not impl.reasons(spec, "forward") and (not names or impl.name in names)
    ]
    rows, not_modelled, share = [], [], 1.0
    try:
        with contextlib.nullcontext(compiler) if compiler else compile_only.DumpingCompiler() as compiler:
            for impl in candidates:
                def compiled(setting: str, arm: str = fast_paths.GENERAL) -> compile_only.Dumped:
                    return compiler.compile(generation, f"{__name__}:program", case=case_json(case), implementation=impl.name,
                                            setting=setting, arm=arm, chip=generation)

                try:
                    alone = compiled("alone")
                    if not alone.kernels:
                        not_modelled.append((impl.name, NO_TPU_KERNEL))
                        continue
                    own_backward = impl.backward is not None and not impl.reasons(spec, "backward")
                    # An implementation whose forward hands its backward residuals runs another forward kernel in a training
                    # step: the same, writing them too.
                    training = own_backward and impl.residuals
                    settings = ("alone", "in a layer", "backward" if own_backward else None, "training" if training else None)
                    dumped = (alone, *(None if setting is None else compiled(setting) for setting in settings[1:]))
                    # A kernel that chooses fast paths from its data: its general sides above, each fast arm in a row of
                    # its own, named "implementation (arm)": what inputs that take it cost.
                    arms = dict.fromkeys(arm for each in dumped if each is not None for arm in each.fast_arms)
                    fast = {arm: tuple(None if setting is None else compiled(setting, arm) for setting in settings)
                            for arm in arms}
                except RuntimeError as error:  # the compiler's own words, e.g. the program needs more HBM than the chip has
                    not_modelled.append((impl.name, f"does not compile: {str(error).strip().splitlines()[-1][:200]}"))
                    continue
                share = alone.cores / tpu.tensorcores
                rows.append(_modelled(impl.name, tpu, share, *dumped))
                rows += [_modelled(f"{impl.name} ({arm})", tpu, share, *each) for arm, each in fast.items()]
    except compile_only.CompileOnlyUnavailable as error:
        return TpuModel(case, tpu, (), (), unavailable=str(error))
    return TpuModel(case, tpu, tuple(rows), tuple(not_modelled), share=share)


def tpu_spec(case: Case, generation: str) -> CallSpec:
    """The call spec ``model`` matches implementations with: the workload lowered for a ``generation`` TPU, the chip named,
    since a capability may turn on it (kda's packed backward does not compile on every chip)."""
    return dataclasses.replace(case.spec("tpu", interpret=False), chip=generation)


def _modelled(
    name: str, tpu: TpuGeneration, share: float, alone: compile_only.Dumped, in_layer: compile_only.Dumped,
    backward: compile_only.Dumped | None, training: compile_only.Dumped | None,
) -> Modelled:
    bandwidth, peak = tpu.hbm_bytes_per_second * share, tpu.peak_bf16_flops * share

    def kernels_of(dumped: compile_only.Dumped) -> tuple[KernelModel, ...]:
        costs = dict(dumped.facts.kernel_costs)
        return tuple(_kernel(tpu, kernel, costs[kernel.name].bytes_accessed, bandwidth, peak) for kernel in dumped.kernels)

    def setting(facts: compile_only.ProgramFacts, kernels: tuple[KernelModel, ...]) -> Setting:
        copy_seconds = facts.relayout_bytes / bandwidth
        return Setting(len(facts.relayouts), facts.hbm_bytes, copy_seconds, sum(kernel.seconds for kernel in kernels) + copy_seconds)

    kernels = kernels_of(alone)
    modelled = Modelled(name, kernels, setting(alone.facts, kernels), setting(in_layer.facts, kernels), alone.facts.bytes_accessed, alone.facts.flops)
    if backward is None:
        return modelled
    backward_kernels = kernels_of(backward)
    return dataclasses.replace(
        modelled, backward_kernels=backward_kernels, backward=setting(backward.facts, backward_kernels),
        training_kernels=() if training is None else kernels_of(training),
    )


def _kernel(tpu: TpuGeneration, kernel: llo.DumpedKernel, hbm_bytes: int, bandwidth: float, peak: float) -> KernelModel:
    cycles, counts, issued, slots = kernel.cycles, kernel.mosaic.total, kernel.issued, dict(tpu.vliw_slots)
    needs = {
        "vector ALU": issued.vector_alu / slots["vector ALU"], "EUP": issued.eup / slots["EUP"],
        "load": issued.loads / slots["load"], "store": issued.stores / slots["store"],
        "result pop": issued.result_pops / slots["result pop"], "XLU": issued.xlu / slots["XLU"],
    }
    busiest = max(needs, key=needs.get)
    return KernelModel(
        name=kernel.name,
        grid_steps=kernel.mosaic.steps,
        hbm_bytes=hbm_bytes,
        cycles=cycles,
        counts=counts,
        issued=issued,
        hbm_seconds=hbm_bytes / bandwidth,
        issue_seconds=cycles / tpu.clock_hz,
        mxu_seconds=counts.mxu_rows * tpu.mxu_row_flops() / peak,
        busiest_unit=busiest,
        busiest_unit_cycles=round(needs[busiest]),
        traced_loop_cycles=kernel.traced_loop_cycles,
    )


def program(
    case: dict[str, Any], implementation: str, setting: str, arm: str = fast_paths.GENERAL, chip: str | None = None,
) -> tuple[Any, ...]:
    """The workload's forward forced to ``implementation``, alone or in a layer, or its backward alone as a training step
    runs it, and the abstract arguments (``DumpingCompiler``'s factory) for a ``chip`` TPU (a generation); every kernel's choices
    traced alone as ``arm`` has them (``fast_paths.assume``)."""
    jax.clear_caches()  # the op's inner programs were traced under whichever arm the previous compile assumed
    with fast_paths.assume(arm):  # the backward's arguments come from tracing the forward (what it hands on)
        function, *arguments = _program(case, implementation, setting, chip)

    def traced(*args):
        with fast_paths.assume(arm):
            return function(*args)

    return (traced, *arguments)


def _program(case: dict[str, Any], implementation: str, setting: str, chip: str | None = None) -> tuple[Any, ...]:
    case = Case(**{
        **case, "features": frozenset(case["features"]), "ndims": tuple(tuple(pair) for pair in case["ndims"]),
        "seqlens": None if case["seqlens"] is None else tuple(case["seqlens"]),
        "config": tuple(tuple(pair) for pair in case["config"]),
    })
    arrays, static = _arguments(case)
    forward = functools.partial(op(case.op).forward, **static, implementation=implementation)
    if setting == "training":  # the forward as a training step runs it, with what it hands the backward
        def training(arrays):
            outputs, pullback = jax.vjp(lambda arrays: forward(**arrays), arrays)
            return outputs, jax.tree.leaves(pullback)

        return (training, arrays)
    if setting == "backward":
        # As a training step runs it: the pullback of jax.vjp, whose leaves (the program's parameters) are the inputs and
        # whatever else the forward hands on (Implementation.residuals).
        # Traced for the chip, as compile_only.lower_for traces the program, so the forward hands on what it would there.
        with contextlib.nullcontext() if chip is None else jax.default_device(compile_only.device(chip)):
            pullback = jax.eval_shape(lambda arrays: jax.vjp(lambda arrays: forward(**arrays), arrays)[1], arrays)
        do = jax.ShapeDtypeStruct((case.batch, case.seq_len, case.value_heads, case.value_dim), jnp.dtype(case.dtype))
        if not static.get("output_final_state"):
            return (lambda pullback, do: pullback((do, None)), pullback, do)
        # The final state is an output: under grad its cotangent reaches the backward (zeros where nothing uses it).
        num_seqs = case.batch if case.seqlens is None else len(case.seqlens)
        dht = jax.ShapeDtypeStruct((num_seqs, case.value_heads, case.key_dim, case.value_dim), state_dtype(case.dtype))
        return (lambda pullback, do, dht: pullback((do, dht)), pullback, do, dht)
    if setting == "alone":
        return (lambda arrays: forward(**arrays), arrays)
    return in_a_layer(forward, arrays)


TOKEN_ARRAYS = ("q", "k", "v", "g", "beta")
"""The arguments laid out ``[B, T, H, ...]`` (docs/ops.md): the only ones whose shape depends on ``T``."""


def _arguments(case: Case) -> tuple[dict[str, jax.ShapeDtypeStruct], dict[str, Any]]:
    """The case's abstract arrays and static options.

    Made from the test data of the case cut to one token per sequence (the data of a realistic
    workload takes seconds to make, and only its shapes are needed), with ``T`` put back.
    """
    probe = dataclasses.replace(case, seq_len=1 if case.seqlens is None else len(case.seqlens), seqlens=None if case.seqlens is None else (1,) * len(case.seqlens))
    inputs = data.forward_inputs(probe)
    arrays = {
        name: jax.ShapeDtypeStruct((x.shape[0], case.seq_len, *x.shape[2:]) if name in TOKEN_ARRAYS else x.shape, x.dtype)
        for name, x in inputs.items() if isinstance(x, jax.Array)
    }
    return arrays, {name: x for name, x in inputs.items() if name not in arrays}


def in_a_layer(forward: Callable, arrays: dict[str, jax.ShapeDtypeStruct]) -> tuple[Any, ...]:
    """The op between projections, and its abstract arguments: every per-token argument (``q``, ``k``, ``v`` and
    the gates and ``beta`` where the op takes them) is ``x @ W`` reshaped to heads, as a model's layer computes
    them, then ``forward(**inputs)``, and ``o`` reshaped back and projected.

    A per-token argument given as a parameter instead would arrive in XLA's default layout for it, and a kernel
    reading another layout would pay a copy that no layer pays: the projection writes the layout its reader wants.
    """
    B, T, HV, V = arrays["v"].shape
    width, dtype = arrays["q"].shape[2] * arrays["q"].shape[3], arrays["q"].dtype
    projected = {name: x for name, x in arrays.items() if name in TOKEN_ARRAYS}
    others = {name: x for name, x in arrays.items() if name not in TOKEN_ARRAYS}

    def layer(x, weights, wo, others):
        inputs = {
            name: jnp.matmul(x, weights[name], preferred_element_type=shape.dtype).reshape(shape.shape)
            for name, shape in projected.items()
        }
        o, state = forward(**inputs, **others)
        return o.reshape(B, T, HV * V) @ wo, state

    weights = {name: jax.ShapeDtypeStruct((width, math.prod(shape.shape[2:])), dtype) for name, shape in projected.items()}
    return (layer, jax.ShapeDtypeStruct((B, T, width), dtype), weights, jax.ShapeDtypeStruct((HV * V, width), dtype), others)


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} us"


def format_model(model: TpuModel) -> str:
    case, tpu = model.workload, model.generation
    title = (
        f"Modelled on TPU {tpu.name} (a model, nothing ran; compiled for a compile-only device): {case.op} "
        f"{describe_shape(case)} {case.dtype}"
    )
    if model.unavailable:
        return f"{title}\n  not available: {model.unavailable}"
    if not model.rows:
        why = "; ".join(f"{name} {why}" for name, why in model.not_modelled) or (
            "no implementation supports it natively on TPU (see `tops explain --platform tpu`)")
        return f"Modelled on TPU {tpu.name}: nothing to model for {case.op} {describe_shape(case)} {case.dtype}: {why}."
    floor, tokens = model.floor_bytes, model.tokens
    lines = [title, ""]
    kernels = [("implementation", "pass", "kernel", "B/token", "cycles/token", "MXU rows/token", "HBM", "issue", "MXU", "modelled", "limit")]
    for row in model.rows:
        passes = [("forward", kernel) for kernel in row.kernels] + [("training", kernel) for kernel in row.training_kernels]
        passes += [("backward", kernel) for kernel in row.backward_kernels]
        for index, (direction, kernel) in enumerate(passes):
            kernels.append((
                row.implementation if index == 0 else "", direction, kernel.name, f"{kernel.hbm_bytes / tokens:.0f}",
                f"{kernel.cycles * model.cores / tokens:.2f}", f"{kernel.counts.mxu_rows / tokens:.2f}",
                _time(kernel.hbm_seconds), _time(kernel.issue_seconds), _time(kernel.mxu_seconds), _time(kernel.seconds),
                kernel.describe_limit(),
            ))
    ops = [("implementation", "copies alone / in a layer", "B/token alone", "B/token in a layer", "modelled alone", "modelled in a layer", "XLA's count alone")]
    for row in model.rows:
        ops.append((
            row.implementation, f"{row.alone.copies} / {row.in_a_layer.copies}",
            f"{row.alone.bytes / tokens:.0f} ({row.alone.bytes / floor:.2f}x)", f"{row.in_a_layer.bytes / tokens:.0f} ({row.in_a_layer.bytes / floor:.2f}x)",
            f"{_time(row.alone.seconds)} ({row.alone.seconds / model.floor_seconds:.2f}x)",
            f"{_time(row.in_a_layer.seconds)} ({row.in_a_layer.seconds / model.floor_seconds:.2f}x)",
            f"{row.xla_bytes / tokens:.0f} B/token, {row.xla_flops / 1e9:.1f} GFLOP",
        ))
    lines += [*_table(kernels), "", *_table(ops), ""]
    backwards = [("implementation", "backward: copies alone", "B/token alone", "modelled alone", "its kernels", "forward+backward in a layer")]
    for row in model.rows:
        if row.backward is not None:
            kernels_seconds = row.backward.seconds - row.backward.copy_seconds
            backwards.append((
                row.implementation, str(row.backward.copies),
                f"{row.backward.bytes / tokens:.0f} ({row.backward.bytes / model.backward_floor_bytes:.2f}x)",
                f"{_time(row.backward.seconds)} ({row.backward.seconds / model.backward_floor_seconds:.2f}x)",
                f"{_time(kernels_seconds)} ({kernels_seconds / model.backward_floor_seconds:.2f}x)",
                _time(row.forward_backward_in_a_layer),
            ))
    if len(backwards) > 1:
        lines += [*_table(backwards), ""]
    per_core = " per TensorCore" if model.share < 1 else ""
    lines += [
        f"Floor (read {model.floor_reads} and write o once): {floor / tokens:.0f} B/token, {_time(model.floor_seconds)} at "
        f"{model.bandwidth / 1e9:.0f} GB/s{per_core}; (x) is against it.",
        f"Per kernel: HBM = its declared bytes / bandwidth; issue = the cycles its scheduled VLIW bundles issue / "
        f"{tpu.clock_hz / 1e9:.2f} GHz; MXU = the rows its pushes stream x {tpu.mxu_row_flops()} flops ({tpu.mxu}x{tpu.mxu} MXU) / "
        f"{tpu.peak_bf16_flops * model.share / 1e12:.0f} TFLOP/s; modelled = the largest, the limit that binds (tops_core/tpu/model.py).",
        "Per op: its kernels plus the relayout copies XLA adds around them at HBM bandwidth; alone: q, k, v, o are [B, T, H, D] "
        "parameters; in a layer: every per-token input projected from x (x @ W), o projected back. XLA's count: its own cost analysis of the op alone.",
    ]
    if any(row.backward is not None for row in model.rows):
        lines.append(
            "Backward (an implementation's own): alone, its kernels and the copies around them; (x) is against its floor "
            f"({model.backward_floor_moves}): {model.backward_floor_bytes / tokens:.0f} B/token, {_time(model.backward_floor_seconds)}. "
            "Forward+backward in a layer: the forward in a layer and the backward's kernels"
            + ("; a training row's forward kernels write what they hand the backward, in place of the forward's."
               if any(row.training_kernels for row in model.rows) else ".")
        )
    lines += [f"{name}: not modelled, {why}." for name, why in model.not_modelled]
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def model_json(model: TpuModel) -> dict[str, Any]:
    """Every figure of the section as JSON values (seconds, bytes, counts), for ``tops bench --json``."""
    case, tpu = model.workload, model.generation
    document: dict[str, Any] = {
        "generation": tpu.name, "workload": case_json(case), "tokens": model.tokens, "unavailable": model.unavailable,
        "floor_bytes_per_token": model.floor_bytes / model.tokens, "floor_seconds": model.floor_seconds,
        "backward_floor_bytes_per_token": model.backward_floor_bytes / model.tokens, "backward_floor_seconds": model.backward_floor_seconds,
        "bandwidth_bytes_per_second": model.bandwidth, "clock_hz": tpu.clock_hz,
        "not_modelled": [{"implementation": name, "why": why} for name, why in model.not_modelled],
        "implementations": [],
    }
    for row in model.rows:
        document["implementations"].append({
            "implementation": row.implementation,
            "limit": row.limit,
            "kernels": [_kernel_json(kernel, model.tokens) for kernel in row.kernels],
            **{
                key: {
                    "copies": setting.copies, "bytes_per_token": setting.bytes / model.tokens,
                    "modelled_seconds": setting.seconds, "times_floor": setting.seconds / model.floor_seconds,
                }
                for key, setting in (("alone", row.alone), ("in_a_layer", row.in_a_layer))
            },
            "xla_bytes": row.xla_bytes, "xla_flops": row.xla_flops,
            "backward": None if row.backward is None else {
                "kernels": [_kernel_json(kernel, model.tokens) for kernel in row.backward_kernels],
                "alone": {
                    "copies": row.backward.copies, "bytes_per_token": row.backward.bytes / model.tokens,
                    "modelled_seconds": row.backward.seconds, "times_floor": row.backward.seconds / model.backward_floor_seconds,
                },
                "kernels_seconds": row.backward.seconds - row.backward.copy_seconds,
                "kernels_times_floor": (row.backward.seconds - row.backward.copy_seconds) / model.backward_floor_seconds,
                "training_forward_kernels": [_kernel_json(kernel, model.tokens) for kernel in row.training_kernels],
                "forward_backward_in_a_layer_seconds": row.forward_backward_in_a_layer,
            },
        })
    return document


def _kernel_json(kernel: KernelModel, tokens: int) -> dict[str, Any]:
    return {
        "kernel": kernel.name, "grid_steps": kernel.grid_steps, "bytes_per_token": kernel.hbm_bytes / tokens,
        "cycles": kernel.cycles, "traced_loop_cycles": kernel.traced_loop_cycles,
        "counts": dataclasses.asdict(kernel.counts), "issued": dataclasses.asdict(kernel.issued),
        "hbm_seconds": kernel.hbm_seconds, "issue_seconds": kernel.issue_seconds, "mxu_seconds": kernel.mxu_seconds,
        "modelled_seconds": kernel.seconds, "limit": kernel.describe_limit(),
    }
