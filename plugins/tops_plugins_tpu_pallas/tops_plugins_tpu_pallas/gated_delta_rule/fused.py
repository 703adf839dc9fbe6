"""``tpu_pallas.fused`` and, over packed sequences, ``tpu_pallas.varlen`` for gated_delta_rule: kda's fused machinery
(``kda/fused.py``, ``kda/varlen.py``, ``kda/backward.py``) with this op's chunk math (``gated_delta_rule.chunkwise``).

The forward is one ``pallas_call`` on the fused grid ``(batch, value head, value block, time step)``, the float32 state
in VMEM along the sequential time axis, each step's chunks unrolled through ``kda.chunkwise.chunk_steps``. Value head
``j`` reads query/key head ``j // G`` in place (grouped value heads); ``beta`` ``[B, T, HV]`` is read as it is, every
head's column of a step's rows (``blocks.per_head``), the kernel taking its own, and ``g`` too at chunks of 64; at 128
and more ``g`` is read transposed to ``[B, HV, T]``, every head's row of a step's tokens (``blocks.gate_rows``), whose
chunks' log decays the kernel takes at once (``gated_delta_rule.chunkwise``). Packed, a sequence's first
row is a reset (``g = -inf`` there, which ``ChunkGates`` takes exactly) and its states move by DMA where it starts and
ends (``kda.sequences``, the gate given to every key). The backward is kda's: the state and inverse entering every chunk
(or, where one segment is the whole sequence, no walk: the gradients kernel walks the states), then each chunk's VJP
in reverse with ``dS`` in VMEM; ``dg`` and ``dbeta`` leave as a row per chunk. Under ``grad`` or ``vjp`` the forward hands
it every chunk's inverse, and its states where the backward would walk them (``residuals_to_hand_on``); called on its
own it recomputes them, so it may walk chunks of its own size (``backward_config``; then the forward hands on nothing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

import jax.numpy as jnp
from tops_core import GatedDeltaRuleGrads

from tops_plugins_tpu_pallas import grid, launch
from tops_plugins_tpu_pallas.gated_delta_rule.chunkwise import GATED_DELTA_RULE
from tops_plugins_tpu_pallas.grid import geometry_of, pool_states
from tops_plugins_tpu_pallas.kda import backward as kda_backward, fused as kda_fused, varlen as kda_varlen
from tops_plugins_tpu_pallas.layout import Geometry
from tops_plugins_tpu_pallas.plan import LaunchPlan

__all__ = [
    "GatedDeltaRuleFusedConfig", "backward", "backward_config", "backward_plans", "forward", "geometry_of", "packed_forward",
    "plans", "residuals_to_hand_on",
]


@dataclasses.dataclass(frozen=True)
class GatedDeltaRuleFusedConfig(kda_fused.KdaFusedConfig):
    """kda's config with this op's defaults: chunks of 128 on every chip (``CHUNK_SIZE``) and, lowered for a TPU, 16 of
    them per grid step, 32 on v6e, in the backward too, and 32 in v5e's backward (kda's backward walks 8).

    kda's chunk grows per token with ``C`` (its per-key levels); this op's pair products are one dense product whatever
    ``C``, so a longer chunk halves the links of the chain through the state per token for one more inverse level. A
    longer step gives the scheduler more independent chunks (their factors) to fill the chain's waits with. Modelled at
    the bench's default shape (B=2 T=4096 H=8 K=V=128 bf16), the forward kernel on v6e: 288 us at (64, 8), 248 at
    (128, 8), 245 at (64, 16), 208 at (128, 16), 214 at (128, 32); on v5e 379 us at (64, 8), 343 at (128, 16). The
    backward on v6e at 32 chunks per step against 16 (2026-12-07, cycles): checkpoints walk 311507 -> 301828, gradients
    kernel 833986 -> 812617; on v5e 377265 -> 377756 and 957622 -> 945177, so v5e keeps 16. Once the finite gates'
    arm had made the chunk's own work cheaper (``chunkwise.by_finiteness``), the forward on v6e at 32 against 16
    (2026-12-07, later, cycles): 304362 -> 294432 with finite gates, 334858 -> 325248 with any, packed (16 sequences,
    T=8192) 298867 -> 291955 and 329331 -> 321539; on v5e 386981 -> 384697, so v5e keeps 16. Once a sequence of one
    segment had no walk (``kda.backward.walks_every_chunk``), v5e's backward at 32 (T=4096: one segment, the gradients
    kernel alone) against 16 (two, the walk of every chunk over the first): finite gates 4.42x -> 4.18x the floor
    (144539 + 921411 cycles -> 907442), any gates 4.64x -> 4.36x (945874).
    """

    TPU_NUM_STEPS_BY_CHIP: ClassVar[Mapping[str, int]] = MappingProxyType({"v6e": 32})
    TPU_BACKWARD_NUM_STEPS: ClassVar[int] = 16
    TPU_BACKWARD_NUM_STEPS_BY_CHIP: ClassVar[Mapping[str, int]] = MappingProxyType({"v5e": 32, "v6e": 32})
    CHUNK_SIZE: ClassVar[int] = 128
    TPU_CHUNK_SIZE_BY_CHIP: ClassVar[Mapping[str, int]] = MappingProxyType({})


def plans(geometry: Geometry, dtype, **inputs) -> tuple[LaunchPlan]:
    """The forward's (single) launch plan: ``kda.fused.plans``' with this op's chunk math."""
    return kda_fused.plans(geometry, dtype, recurrence=GATED_DELTA_RULE, **inputs)


def backward_plans(geometry: Geometry, dtype, **inputs) -> tuple[LaunchPlan, ...]:
    """The backward's checkpoints and gradients plans (the latter alone without a walk): ``kda.backward.plans``' with this
    op's chunk math."""
    return kda_backward.plans(geometry, dtype, recurrence=GATED_DELTA_RULE, **inputs)


def forward(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, config,
            ssm_state_indices=None, residuals: bool = False):
    """The ``Forward`` protocol of ``tops_core.ops.gated_delta_rule`` (``cu_seqlens`` is rejected by the capabilities), a
    state pool served in place; ``residuals``: also return what the backward would recompute (``kda.fused.forward``'s)."""
    del cu_seqlens
    return pool_states(
        kda_fused.run, q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm, config=config, ssm_state_indices=ssm_state_indices, recurrence=GATED_DELTA_RULE,
        hands_on=residuals_to_hand_on(q, v, config, packed=False, with_initial_states=initial_state is not None) if residuals else None,
    )


def packed_forward(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, config,
                   ssm_state_indices=None, residuals: bool = False):
    """The ``Forward`` protocol for packed input (``B == 1``, ``cu_seqlens`` given), a state pool served in place."""
    return pool_states(
        kda_varlen.run, q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm, config=config, cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
        recurrence=GATED_DELTA_RULE,
        hands_on=residuals_to_hand_on(q, v, config, packed=True, with_initial_states=initial_state is not None) if residuals else None,
    )


def residuals_to_hand_on(q, v, config, packed: bool, with_initial_states: bool) -> tuple[str, ...]:
    """What the forward hands its backward, which runs at ``backward_config`` (``kda.fused.residuals_to_hand_on``)."""
    chip = launch.Target.lowered_for().chip
    at = backward_config(config, q.dtype, packed_with_initial_states=packed and with_initial_states, chip=chip)
    return kda_fused.residuals_to_hand_on(q, v, config, GATED_DELTA_RULE, packed, backward_config=at)


PACKED_BACKWARD_AT_CHUNK_64 = frozenset({"v5e", "v5p"})
"""Chips whose compiler (libtpu 0.0.52) stops on the packed gradients kernel at chunks of 128 in bfloat16 with initial
states: an internal check of its MXU pass (``RET_CHECK ... mxu_lmr_transform.cc ... XposeSequenceAssignment::kLmrWontHelp``),
on every shape tried. By bisection, any MXU product in the loop over a chunk's starting sequences (``kda.sequences``) is
enough at chunk 128, whatever its operands' dtype; float32, calls without ``initial_state``, and chunks of 64 compile."""


def backward_config(config: GatedDeltaRuleFusedConfig, dtype, *, packed_with_initial_states: bool, chip: str | None):
    """The config the backward runs at: ``config``, but chunks of 64 for a packed bfloat16 call with initial states on a
    chip of ``PACKED_BACKWARD_AT_CHUNK_64``, whose compiler rejects the gradients kernel at 128. The backward recomputes
    its states from the inputs, so its chunks need not be the forward's."""
    if chip in PACKED_BACKWARD_AT_CHUNK_64 and packed_with_initial_states and jnp.dtype(dtype) == jnp.bfloat16:
        return dataclasses.replace(config, chunk_size=min(grid.chunk_size_of(config, chip), 64))
    return config


def backward(q, k, v, g, beta, do, *, scale, initial_state, dht, cu_seqlens, use_qk_l2norm, config,
             residuals=None) -> GatedDeltaRuleGrads:
    """The ``Backward`` protocol of ``tops_core.ops.gated_delta_rule``, unpacked or packed, at ``backward_config``."""
    packed_with_initial_states = cu_seqlens is not None and initial_state is not None
    chip = launch.Target.lowered_for().chip
    config = backward_config(config, q.dtype, packed_with_initial_states=packed_with_initial_states, chip=chip)
    grads = kda_backward.gradients(
        q, k, v, g, beta, do, scale=scale, initial_state=initial_state, dht=dht, cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm, config=config, recurrence=GATED_DELTA_RULE, residuals=residuals,
    )
    return GatedDeltaRuleGrads(**{name: grads[name] for name in ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")})
