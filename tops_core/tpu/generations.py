"""What each TPU generation offers, in one place: the figures the modelled TPU numbers rest on.

Per chip as Google Cloud publishes them (a JAX device is one chip, both TensorCores of a v4 or
v5p chip together), except what is per TensorCore (VMEM, MXUs, the VLIW bundle). Sources:

- HBM bandwidth and peak bf16 compute: the Cloud TPU system architecture pages,
  cloud.google.com/tpu/docs/v4, /v5e, /v5p and /v6e ("Peak compute per chip (bf16)", "HBM
  bandwidth per chip" or "HBM2 capacity and bandwidth").
- Peak float32: the MXU multiplies bf16; a float32 matmul at ``Precision.HIGHEST`` (what the
  Pallas kernels use for float32 inputs) "performs float32 computations in 6 bfloat16" passes
  (the ``jax.lax.Precision`` docstring), so a sixth of the bf16 peak.
- VMEM per TensorCore and the MXU edge: JAX's Pallas TPU hardware reference
  (docs.jax.dev/en/latest/pallas/tpu/hardware.html); v6e's 256 x 256 MXUs are also on its Cloud page.
- The default scoped VMEM limit (what a Mosaic kernel may use without ``vmem_limit_bytes``) and
  the usable VMEM: measured, compiling kernels of growing VMEM for each compile-only chip
  (libtpu 0.0.52: "Scoped allocation ... limit 16.00M", 32.00M on v6e; v4 has no more than its 16 MiB).
- MXUs per TensorCore and the VLIW bundle (how many instructions of each kind one cycle issues):
  libtpu's own machine model, as its scheduled code shows it (the MXUs it names, ``mxu0`` to
  ``mxu3`` or ``mxu1``, and the "CAPACITY" line of its per-bundle utilization dump).
- The clock: ``peak bf16 / (TensorCores x MXUs x 2 x edge**2 x rows)``, one bf16 LHS row per MXU
  per cycle on the 128-wide MXUs: 1.05 GHz (v4, the clock Google's TPU v4 paper gives), 1.5 GHz
  (v5e), 1.75 GHz (v5p). v6e's is not published: its two 256-wide MXUs reach 918 TFLOP/s at
  1.75 GHz taking two rows a cycle, or at 3.5 GHz taking one. We take 1.75 GHz, the conservative
  reading: at 3.5 GHz every issue-bound v6e time in the model halves. One revision of the v6e
  Cloud page says 4 MXUs per TensorCore, which at one row a cycle also gives 1.75 GHz; the others
  say 2, as libtpu's bundles do.
- The compile-only topology: the names ``jax.experimental.topologies.get_topology_desc`` accepts;
  the device kinds: what those devices (and JAX's ``device_kind`` on the real chips) report.
- The VMEM budget (what the Pallas kernels plan their blocks for, asking Mosaic for it with
  ``vmem_limit_bytes``): three quarters of the VMEM where there is room beyond the default
  scoped limit, leaving a quarter for Mosaic's own scratch and spills; on v4, three quarters of its
  16 MiB too (``MOSAIC_HEADROOM_BUDGET``: planning all of it let a backward spill past it). Measured with the compile-only chips (libtpu
  0.0.52): a kernel may allocate up to the whole VMEM when it asks for it (128 MiB on v5e and
  v6e, 64 MiB on v5p), and no more than 16 MiB on v4 whatever it asks.
"""

from __future__ import annotations

import dataclasses

FLOAT32_PASSES = 6
"""bf16 MXU passes of one float32 matmul at Precision.HIGHEST on TPU."""


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    """One TPU generation's figures (see the module docstring for their sources)."""

    name: str
    topology: str  # a compile-only topology of this generation, for get_topology_desc
    hbm_bytes_per_second: float  # per chip
    peak_bf16_flops: float  # per chip, flop/s
    tensorcores: int  # per chip
    vmem_bytes: int  # per TensorCore
    mxu: int  # edge of the square systolic array
    mxus: int  # per TensorCore
    clock_hz: float
    scoped_vmem_bytes: int  # what a kernel may use without vmem_limit_bytes
    vmem_budget_bytes: int  # what the Pallas kernels plan for on this chip, asking for it with vmem_limit_bytes
    device_kinds: tuple[str, ...]  # jax.Device.device_kind of its chips
    vliw_slots: tuple[tuple[str, int], ...]  # instructions of each kind one bundle (cycle) issues, per TensorCore

    @property
    def peak_float32_flops(self) -> float:
        return self.peak_bf16_flops / FLOAT32_PASSES

    def peak_flops(self, dtype: str) -> float:
        """Peak matmul rate for inputs of ``dtype``: bf16's for bfloat16, float32's (HIGHEST) otherwise."""
        return self.peak_bf16_flops if dtype == "bfloat16" else self.peak_float32_flops

    def mxu_row_flops(self) -> int:
        """The MXU work one LHS row streamed through a systolic array stands for: ``2 * edge**2`` flops."""
        return 2 * self.mxu * self.mxu


def _slots(vector_alu: int, loads: int, stores: int, xlu: int, matmul: int) -> tuple[tuple[str, int], ...]:
    return (("matmul", matmul), ("vector ALU", vector_alu), ("EUP", 1), ("XLU", xlu), ("load", loads), ("store", stores), ("result pop", 2))


MOSAIC_HEADROOM_BUDGET = 12 * 2**20
"""The plans' budget where the kernel may use no more than 16 MiB (v4's whole VMEM; any chip's default scoped limit).
Mosaic needs more than the plans count where it spills registers: compiled for v4 (``Program vmem requirement``,
read with a 1 MiB limit), simple_gla's fused backward at K=64 V=200 float32 needs 16.66 MiB for 14.26 MiB planned
(4.7 MiB of spill slots), at K=V=256 bf16 16.44 for 13.76, kda's 16.38 for 14.76; the rest of the kernels need
less than planned. A quarter of the 16 MiB is left for it (the worst excess, 2.7 MiB, or 1.19x, fits)."""


GENERATIONS: dict[str, TpuGeneration] = {
    g.name: g
    for g in (
        TpuGeneration(
            "v4", "v4:2x2x1", 1200e9, 275e12, tensorcores=2, vmem_bytes=16 * 2**20, mxu=128, mxus=4, clock_hz=1.05e9,
            scoped_vmem_bytes=16 * 2**20, vmem_budget_bytes=MOSAIC_HEADROOM_BUDGET, device_kinds=("TPU v4",),
            vliw_slots=_slots(vector_alu=2, loads=1, stores=1, xlu=2, matmul=4),
        ),
        TpuGeneration(
            "v5e", "v5e:1x1", 819e9, 197e12, tensorcores=1, vmem_bytes=128 * 2**20, mxu=128, mxus=4, clock_hz=1.5e9,
            scoped_vmem_bytes=16 * 2**20, vmem_budget_bytes=96 * 2**20, device_kinds=("TPU v5 lite", "TPU v5e"),
            vliw_slots=_slots(vector_alu=4, loads=3, stores=1, xlu=3, matmul=4),
        ),
        TpuGeneration(
            "v5p", "v5p:2x2x1", 2765e9, 459e12, tensorcores=2, vmem_bytes=64 * 2**20, mxu=128, mxus=4, clock_hz=1.75e9,
            scoped_vmem_bytes=16 * 2**20, vmem_budget_bytes=48 * 2**20, device_kinds=("TPU v5", "TPU v5p"),
            vliw_slots=_slots(vector_alu=4, loads=3, stores=1, xlu=3, matmul=4),
        ),
        TpuGeneration(
            "v6e", "v6e:1x1", 1638e9, 918e12, tensorcores=1, vmem_bytes=128 * 2**20, mxu=256, mxus=2, clock_hz=1.75e9,
            scoped_vmem_bytes=32 * 2**20, vmem_budget_bytes=96 * 2**20, device_kinds=("TPU v6 lite", "TPU v6e"),
            vliw_slots=_slots(vector_alu=4, loads=3, stores=2, xlu=2, matmul=2),
        ),
    )
}


UNKNOWN_CHIP_VMEM_BUDGET = 16 * 2**20
"""What the Pallas kernels plan for when the chip is not known (Pallas' interpreter; a program traced on a host
without a TPU for one it does not name): every generation's default scoped limit, so no ``vmem_limit_bytes`` is
needed. Traced on a TPU, the chip is always known; on a v4 the plans then leave Mosaic its headroom
(``MOSAIC_HEADROOM_BUDGET``), which only v4 was measured to need."""


def vmem_budget(chip: str | None) -> int:
    """The VMEM a kernel may plan for on ``chip`` (a key of ``GENERATIONS``), or on any chip when None."""
    return UNKNOWN_CHIP_VMEM_BUDGET if chip is None else GENERATIONS[chip].vmem_budget_bytes


def generation_of(device_kind: str) -> str | None:
    """The generation (a key of ``GENERATIONS``) of a device of this ``device_kind``; None for another device."""
    return next((g.name for g in GENERATIONS.values() if device_kind in g.device_kinds), None)
