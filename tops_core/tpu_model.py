"""``tops bench``'s modelled TPU section: the workload compiled for a TPU generation on a host without one.

Every implementation that supports the workload natively on TPU (the float64 reference excepted,
it runs on the host) is forced through the public op and compiled for a compile-only device
(``compile_only``), in two settings:

- **alone**: ``q``, ``k``, ``v`` are the program's ``[B, T, H, D]`` parameters;
- **in a layer**: ``q``, ``k``, ``v`` come from ``x @ W`` reshaped to heads, and ``o`` is reshaped back
  and projected, as in a model.

In each, the op's bytes are what its Mosaic kernels told XLA they move (their ``pl.CostEstimate``)
plus the relayout copies XLA put around them, as if every array lived in HBM; the roofline time
is ``max(bytes / HBM bandwidth, kernel flops / peak)`` with the generation's figures
(``tpu_generations``); the floor is reading ``q``, ``k``, ``v`` and writing ``o`` once. XLA's own
cost analysis of the op alone is shown beside: it also counts XLA's prefetches of whole arrays
into VMEM, which programs of a few tens of MiB get. Nothing runs: every figure is modelled. An
implementation without a Mosaic kernel (jax.numpy, whose chunk loop XLA's cost analysis counts
once) is listed as not modelled.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from tops_core import compile_only
from tops_core.conformance import data
from tops_core.conformance.cases import Case
from tops_core.conformance.checks import REFERENCE
from tops_core.ops import op
from tops_core.tpu_generations import GENERATIONS, TpuGeneration


@dataclasses.dataclass(frozen=True)
class Setting:
    """The op in one setting: its bytes (kernels and copies around them) and its roofline time."""

    copies: int
    bytes: int
    seconds: float
    bound: str  # "memory" or "compute"


@dataclasses.dataclass(frozen=True)
class Modelled:
    """One implementation compiled for the TPU, alone and in a layer, and XLA's cost analysis of it alone."""

    implementation: str
    alone: Setting
    in_a_layer: Setting
    xla_bytes: float
    xla_flops: float


@dataclasses.dataclass(frozen=True)
class TpuModel:
    workload: Case
    generation: TpuGeneration
    rows: tuple[Modelled, ...]
    not_modelled: tuple[tuple[str, str], ...]  # (implementation, why)
    unavailable: str | None = None  # why there is no section at all

    @property
    def tokens(self) -> int:
        return self.workload.batch * self.workload.seq_len * self.workload.heads

    @property
    def floor_bytes(self) -> int:
        """Read q, k, v and write o once: ``B*T*H*(2K + 2V)`` elements."""
        case = self.workload
        return self.tokens * (2 * case.key_dim + 2 * case.value_dim) * jnp.dtype(case.dtype).itemsize


def model(case: Case, generation: str = "v6e", names: Sequence[str] | None = None) -> TpuModel:
    """Compile the workload's forward for a compile-only ``generation`` TPU with every TPU implementation (or ``names``)."""
    tpu = GENERATIONS[generation]
    try:
        cores = compile_only.device(generation).num_cores
    except compile_only.CompileOnlyUnavailable as error:
        return TpuModel(case, tpu, (), (), unavailable=str(error))
    contract = op(case.op)
    spec = case.spec("tpu", interpret=False)
    candidates = [
        impl for impl in sorted(contract.implementations(), key=lambda impl: impl.name)
        if impl.name != REFERENCE and not impl.reasons(spec, "forward") and (not names or impl.name in names)
    ]
    inputs = data.forward_inputs(case)
    arrays = {name: jax.ShapeDtypeStruct(x.shape, x.dtype) for name, x in inputs.items() if isinstance(x, jax.Array)}
    static = {name: x for name, x in inputs.items() if name not in arrays}
    # A device may be one of the chip's TensorCores (v4's compile-only devices are).
    share = cores / tpu.tensorcores
    bandwidth, peak = tpu.hbm_bytes_per_second * share, tpu.peak_flops(case.dtype) * share

    def setting(facts: compile_only.ProgramFacts) -> Setting:
        memory, compute = facts.hbm_bytes / bandwidth, facts.kernel_cost.flops / peak
        return Setting(len(facts.relayouts), facts.hbm_bytes, max(memory, compute), "memory" if memory >= compute else "compute")

    rows, not_modelled = [], []
    for impl in candidates:
        forward = functools.partial(contract.forward, **static, implementation=impl.name)
        alone = compile_only.ProgramFacts.of(compile_only.compile_for(generation, lambda arrays: forward(**arrays), arrays))
        if not alone.kernels:
            not_modelled.append((impl.name, "no Mosaic kernel to read a cost estimate from"))
            continue
        in_layer = compile_only.ProgramFacts.of(compile_only.compile_for(generation, *_in_a_layer(case, forward, arrays)))
        rows.append(Modelled(impl.name, setting(alone), setting(in_layer), alone.bytes_accessed, alone.flops))
    return TpuModel(case, tpu, tuple(rows), tuple(not_modelled))


def _in_a_layer(case: Case, forward: Callable, arrays: dict[str, jax.ShapeDtypeStruct]) -> tuple[Any, ...]:
    """The op between projections, and its abstract arguments: ``x @ W`` reshaped to heads, the op, ``o`` reshaped back and projected."""
    B, T, H, K, V = case.batch, case.seq_len, case.heads, case.key_dim, case.value_dim
    width, dtype = H * K, jnp.dtype(case.dtype)
    others = {name: x for name, x in arrays.items() if name not in ("q", "k", "v")}

    def layer(x, wq, wk, wv, wo, others):
        q, k, v = (x @ wq).reshape(B, T, H, K), (x @ wk).reshape(B, T, H, K), (x @ wv).reshape(B, T, H, V)
        o, state = forward(q, k, v, **others)
        return o.reshape(B, T, H * V) @ wo, state

    shapes = ((B, T, width), (width, H * K), (width, H * K), (width, H * V), (H * V, width))
    return (layer, *(jax.ShapeDtypeStruct(shape, dtype) for shape in shapes), others)


def format_model(model: TpuModel) -> str:
    case, tpu = model.workload, model.generation
    title = (
        f"Modelled on TPU {tpu.name}, compiled for a compile-only device (nothing ran): {case.op} "
        f"B={case.batch} T={case.seq_len} H={case.heads} K={case.key_dim} V={case.value_dim} {case.dtype}"
    )
    if model.unavailable:
        return f"{title}\n  not available: {model.unavailable}"
    floor, tokens = model.floor_bytes, model.tokens

    def per_token(setting: Setting) -> str:
        return f"{setting.bytes / tokens:.0f} ({setting.bytes / floor:.2f}x)"

    def roofline(setting: Setting) -> str:
        time = f"{setting.seconds * 1e3:.3g} ms" if setting.seconds >= 1e-3 else f"{setting.seconds * 1e6:.3g} us"
        return f"{time} ({setting.bound})"

    header = ("implementation", "copies alone / in a layer", "B/token alone", "B/token in a layer", "roofline alone", "roofline in a layer", "XLA's count alone")
    table = [header]
    for row in model.rows:
        table.append((
            row.implementation, f"{row.alone.copies} / {row.in_a_layer.copies}", per_token(row.alone), per_token(row.in_a_layer),
            roofline(row.alone), roofline(row.in_a_layer),
            f"{row.xla_bytes / tokens:.0f} B/token, {row.xla_flops / 1e9:.1f} GFLOP",
        ))
    lines = [title, ""]
    if model.rows:
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table] + [""]
    lines += [
        f"B/token (per token and head): the kernels' cost estimates plus the relayout copies XLA adds around the op, in HBM; "
        f"(x) against the floor, reading q, k, v and writing o once: {floor / tokens:.0f} B/token.",
        f"roofline: max(bytes / {tpu.hbm_bytes_per_second / 1e9:.0f} GB/s, kernel flops / {tpu.peak_flops(case.dtype) / 1e12:.0f} TFLOP/s "
        f"{case.dtype}); alone: q, k, v, o are [B, T, H, D] parameters; in a layer: between x @ W projections.",
        "XLA's count: its cost analysis of the op alone, which adds its prefetches of whole arrays into VMEM.",
    ]
    lines += [f"{name}: not modelled ({why})." for name, why in model.not_modelled]
    if not model.rows and not model.not_modelled:
        lines.append("No implementation supports this workload natively on TPU (see `tops explain --platform tpu`).")
    return "\n".join(lines)
