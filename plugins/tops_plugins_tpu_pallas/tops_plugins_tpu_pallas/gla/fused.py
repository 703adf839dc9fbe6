"""``tpu_pallas.fused`` and, over packed sequences, ``tpu_pallas.varlen`` for gla: kda's fused machinery
(``kda/fused.py``, ``kda/varlen.py``, ``kda/backward.py``) with this op's chunk math (``gla.chunkwise``: kda's per-key
decays and query pairs, no delta rule).

The forward is one ``pallas_call`` on the fused grid ``(batch, head, value block, time step)``, the float32 state in
VMEM along the sequential time axis; ``g`` ``[B, T, H, K]`` is read in place, laid out as ``k``. Packed, every key's
decay is reset on a sequence's first row and the sequence's states move by DMA where it starts and ends
(``kda.sequences``). The backward is kda's: the state leaving every segment but the last, packed too (none where one
segment is the whole sequence), then each segment's chunks' states walked from the one entering it and each chunk's
VJP in reverse with ``dS`` in VMEM (``kda.backward``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

from tops_core import GLAGrads

from tops_plugins_tpu_pallas.gla.chunkwise import GLA
from tops_plugins_tpu_pallas.grid import geometry_of, pool_states
from tops_plugins_tpu_pallas.kda import backward as kda_backward, fused as kda_fused, varlen as kda_varlen
from tops_plugins_tpu_pallas.layout import Geometry
from tops_plugins_tpu_pallas.plan import LaunchPlan

__all__ = ["GlaFusedConfig", "backward", "backward_plans", "forward", "geometry_of", "packed_forward", "plans"]


@dataclasses.dataclass(frozen=True)
class GlaFusedConfig(kda_fused.KdaFusedConfig):
    """kda's config with 16 chunks per grid step in the backward on every chip but v6e, lowered for a TPU (kda's backward walks
    8 but on v5e and v6e, where Mosaic's spills at 16 outgrow v5p's VMEM; gla's chunk holds no ``Akk`` and no inverse,
    and compiles at 16 on every generation, float32 ``K = V = 256`` too). More chunks give the scheduler more
    independent work: at the bench's default shape (B=2 T=4096 H=8 K=V=128 bf16, modelled), the checkpoints walk
    143433 -> 128393 cycles on v6e and 181020 -> 152220 on v5e, the gradients kernel 686944 -> 647264 and 812014 ->
    813422. On v6e, at its chunks of 128 (``KdaFusedConfig.TPU_CHUNK_SIZE_BY_CHIP``), 32: the checkpoints walk 78602 ->
    67016 cycles, the gradients kernel 653175 -> 629844 against 16."""

    TPU_BACKWARD_NUM_STEPS: ClassVar[int] = 16
    TPU_BACKWARD_NUM_STEPS_BY_CHIP: ClassVar[Mapping[str, int]] = MappingProxyType({"v6e": 32})


def plans(geometry: Geometry, dtype, **inputs) -> tuple[LaunchPlan]:
    """The forward's (single) launch plan: ``kda.fused.plans``' with this op's chunk math."""
    return kda_fused.plans(geometry, dtype, recurrence=GLA, **inputs)


def backward_plans(geometry: Geometry, dtype, **inputs) -> tuple[LaunchPlan, ...]:
    """The backward's checkpoints and gradients plans (the latter alone without a walk): ``kda.backward.plans``' with this
    op's chunk math."""
    return kda_backward.plans(geometry, dtype, recurrence=GLA, **inputs)


def forward(q, k, v, g, *, scale, initial_state, output_final_state, cu_seqlens, config, ssm_state_indices=None):
    """The ``Forward`` protocol of ``tops_core.ops.gla`` (``cu_seqlens`` is rejected by the capabilities), a state pool
    served in place."""
    del cu_seqlens
    return pool_states(
        kda_fused.run, q, k, v, g, None, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm=False, config=config, ssm_state_indices=ssm_state_indices, recurrence=GLA,
    )


def packed_forward(q, k, v, g, *, scale, initial_state, output_final_state, cu_seqlens, config, ssm_state_indices=None):
    """The ``Forward`` protocol for packed input (``B == 1``, ``cu_seqlens`` given), a state pool served in place."""
    return pool_states(
        kda_varlen.run, q, k, v, g, None, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm=False, config=config, cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices, recurrence=GLA,
    )


def backward(q, k, v, g, do, *, scale, initial_state, dht, cu_seqlens, config) -> GLAGrads:
    """The ``Backward`` protocol of ``tops_core.ops.gla``, unpacked or packed."""
    grads = kda_backward.gradients(
        q, k, v, g, None, do, scale=scale, initial_state=initial_state, dht=dht, cu_seqlens=cu_seqlens,
        use_qk_l2norm=False, config=config, recurrence=GLA,
    )
    return GLAGrads(**{name: grads[name] for name in ("dq", "dk", "dv", "dg", "dinitial_state")})
