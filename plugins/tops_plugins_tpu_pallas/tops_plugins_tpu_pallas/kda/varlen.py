"""``tpu_pallas.varlen`` for kda: the KDA forward over packed sequences (``B == 1``, ``cu_seqlens``), in one ``pallas_call``.

The fused kernel (``kda/fused.py``) itself, over the packed ``T`` as one sequence, with the state reset at
every sequence's first token: that row's log decay is ``RESET_LOG_DECAY`` for every key (``exp`` of it is
0, so ``S' = 0`` before the token's delta-rule write), which the chunk math already takes exactly
(``kda/chunkwise.py``, "Resets"). The row mask is built inside the kernel from scalars in SMEM (scalar
prefetch, traced: one compile for every packing of the same ``T`` and ``N``), computed before the launch
(``fused.packed_operands``): ``cu_seqlens``, per chunk the first and last sequence it overlaps
(``simple_gla.varlen.boundary_operands``), and a bit per token that starts a sequence (``start_bits``, read by
``sequences.PackedChunk.of``); no modified ``g`` is ever written to HBM. Boundaries may fall anywhere, on the chunk
grid or off it; empty sequences cover no token and one-token sequences are a reset on their row.

Per-sequence states (``initial_state`` and the final states ``[N, HV, K, V]``) stay in HBM, each moved by one DMA
where its sequence starts or ends (``kda/sequences.py``); an empty sequence's final state is its initial state,
set around the kernel. Its backward is fused's (``kda/backward.py``) over the same packed grid: ``dS`` starts from each
sequence's ``dht[n]`` where it ends and leaves as ``dinitial_state[n]`` where it starts.
"""

from __future__ import annotations

import functools

from tops_core.ops.kda import Activations

from tops_plugins_tpu_pallas import launch
from tops_plugins_tpu_pallas.kda import fused
from tops_plugins_tpu_pallas.kda.chunkwise import KDA
from tops_plugins_tpu_pallas.kda.fused import KdaFusedConfig, geometry_of
from tops_plugins_tpu_pallas.layout import Geometry
from tops_plugins_tpu_pallas.plan import LaunchPlan
from tops_plugins_tpu_pallas.grid import pool_states
from tops_plugins_tpu_pallas.simple_gla.varlen import with_empty_sequences

__all__ = ["KdaFusedConfig", "fitted_plans", "forward", "geometry_of", "plans"]


def plans(geometry: Geometry, dtype, num_seqs: int, **inputs) -> tuple[LaunchPlan]:
    """The (single) launch plan for one packed call of ``num_seqs`` sequences (``geometry.batch`` is 1): fused's, plus the boundaries."""
    return fused.plans(geometry, dtype, num_seqs=num_seqs, **inputs)


def fitted_plans(geometry: Geometry, dtype, num_seqs: int, *, target: launch.Target = launch.UNKNOWN, **inputs) -> tuple[LaunchPlan]:
    """``plans`` at the geometry ``forward`` launches (fewer chunks per step while ``target``'s VMEM is short)."""
    return launch.fit(functools.partial(plans, num_seqs=num_seqs), geometry, dtype, target, **inputs)[1]


def forward(
    q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
    use_gate=False, A_log=None, dt_bias=None, lower_bound=None, use_beta_sigmoid=False, allow_neg_eigval=False,
    config: KdaFusedConfig, ssm_state_indices=None, residuals: bool = False,
):
    """The ``Forward`` protocol of ``tops_core.ops.kda`` for packed input (``B == 1``, ``cu_seqlens`` given), a state pool
    served in place (``Implementation.serves_pools``); ``residuals`` as ``fused.forward``'s."""
    activations = Activations.of(use_gate, lower_bound, use_beta_sigmoid, allow_neg_eigval, keep_promise=True)
    return pool_states(
        run, q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm, activations=activations, A_log=A_log, dt_bias=dt_bias, config=config, cu_seqlens=cu_seqlens,
        ssm_state_indices=ssm_state_indices,
        hands_on=fused.residuals_to_hand_on(q, v, config, KDA, packed=True) if residuals else None,
    )


def run(q, k, v, g, beta, *, initial_state, output_final_state, cu_seqlens, ssm_state_indices, hands_on=None, **options):
    """``fused.run`` over packed sequences (any ``recurrence`` among ``options``), an empty sequence's final state its
    initial state; with ``hands_on`` (not None) ``fused.run``'s residuals after the outputs."""
    if cu_seqlens is None:
        raise ValueError("tpu_pallas.varlen takes packed calls only: cu_seqlens is required")
    if q.shape[0] != 1:
        raise ValueError(f"a packed call has B == 1, got q of shape {q.shape}")
    results = fused.run(
        q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        ssm_state_indices=ssm_state_indices, hands_on=hands_on, **options,
    )
    (o, final_state), residuals = results if hands_on is not None else (results, None)
    if final_state is not None and ssm_state_indices is None:  # a pool: an empty sequence's row is as it was
        final_state = with_empty_sequences(final_state, cu_seqlens, initial_state)
    return (o, final_state) if hands_on is None else ((o, final_state), residuals)
