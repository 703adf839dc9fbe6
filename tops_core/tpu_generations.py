"""What each TPU generation offers, in one place: the figures the modelled TPU numbers rest on.

Per chip as Google Cloud publishes them (a JAX device is one chip, both TensorCores of a v4 or
v5p chip together), except VMEM, which is per TensorCore. Sources:

- HBM bandwidth and peak bf16 compute: the Cloud TPU system architecture pages,
  cloud.google.com/tpu/docs/v4, /v5e, /v5p and /v6e ("Peak compute per chip (bf16)", "HBM
  bandwidth per chip" or "HBM2 capacity and bandwidth").
- Peak float32: the MXU multiplies bf16; a float32 matmul at ``Precision.HIGHEST`` (what the
  Pallas kernels use for float32 inputs) "performs float32 computations in 6 bfloat16" passes
  (the ``jax.lax.Precision`` docstring), so a sixth of the bf16 peak.
- VMEM per TensorCore and the MXU edge: JAX's Pallas TPU hardware reference
  (docs.jax.dev/en/latest/pallas/tpu/hardware.html); v6e's 256 x 256 MXUs are also on its Cloud page.
- The compile-only topology: the names ``jax.experimental.topologies.get_topology_desc`` accepts.
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

    @property
    def peak_float32_flops(self) -> float:
        return self.peak_bf16_flops / FLOAT32_PASSES

    def peak_flops(self, dtype: str) -> float:
        """Peak matmul rate for inputs of ``dtype``: bf16's for bfloat16, float32's (HIGHEST) otherwise."""
        return self.peak_bf16_flops if dtype == "bfloat16" else self.peak_float32_flops


GENERATIONS: dict[str, TpuGeneration] = {
    g.name: g
    for g in (
        TpuGeneration("v4", "v4:2x2x1", 1200e9, 275e12, tensorcores=2, vmem_bytes=16 * 2**20, mxu=128),
        TpuGeneration("v5e", "v5e:1x1", 819e9, 197e12, tensorcores=1, vmem_bytes=128 * 2**20, mxu=128),
        TpuGeneration("v5p", "v5p:2x2x1", 2765e9, 459e12, tensorcores=2, vmem_bytes=64 * 2**20, mxu=128),
        TpuGeneration("v6e", "v6e:1x1", 1638e9, 918e12, tensorcores=1, vmem_bytes=128 * 2**20, mxu=256),
    )
}
