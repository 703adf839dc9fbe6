"""``tpu_pallas.fused`` for kda: the whole KDA forward in one ``pallas_call``.

the fused grid, layout and launch every forward here shares (``grid.run``): grid ``(batch, head, value block,
time step)``, the first three "parallel", time "arbitrary" (sequential), each step walking
``chunks_per_step`` chunks unrolled (``step_chunks``) with the float32 state carried as a value
between them. The state lives in a VMEM scratch between steps; it is loaded from
``initial_state`` (or zeroed) at the first time step of *every* (batch, head, value block),
because parallel grid points run on either core in any order, and written to ``final_state`` at
the last. Everything else of a chunk (decays, pair products, the exact inverse) is computed inline
from the chunk's rows and never stored.

The grid's heads are the ``HV`` value heads; with grouped value heads (``HV = G * H``) value head
``j`` reads query/key head ``j // G`` through its index map, so q and k are never repeated in HBM.
KDA's own inputs, read in place:

- ``g`` ``[B, T, HV, K]`` as ``[B, T, HV * K]`` (a reshape), the head's ``K`` columns of a step's
  rows, like ``q`` and ``k`` (and lane-padded with zeros when they are: those keys' state rows
  stay zero, whatever their decay). With ``use_gate`` it is the raw gate in its own dtype, and the
  kernel computes the log decay from each block it reads (``tops_core.ops.kda.gate``), never
  storing it: ``A_log`` ``[HV]`` in SMEM (scalar prefetch, float32), ``dt_bias`` ``[HV * K]`` as
  ``[HV, 1, K]``, the head's row.
- ``beta`` ``[B, T, HV]`` as is: a full-width block ``(rows, HV)`` (the last block dimension equals
  the array's, so no padding in HBM); the kernel takes its head's column (and, with
  ``use_beta_sigmoid``, its ``beta_activation``).

Its backward (``kda/backward.py``) runs this kernel again for the state entering every chunk (``checkpoints`` in
place of ``o``), then the VJPs of a step's pieces (``activated_gate_and_strength``, the recurrence's ``factors`` and
``through_state``) in reverse. Under ``grad`` or ``vjp`` the forward writes those states, and each chunk's inverse, beside
``o`` (``residuals=True``, ``hands_on``), and its backward runs no walk.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from tops_core.ops.kda import Activations
from tops_core.packing import sequence_starts
from tops_core.tpu.generations import GENERATIONS

from tops_plugins_tpu_pallas import blocks, grid, launch
from tops_plugins_tpu_pallas.grid import (
    Chunk, Work, chunk_inverses, chunks_of_the_grid, finish_sequence, geometry_of, handed_on, pool_aliases, pool_states,
    sequence_states, start_sequence, state_buffers, state_checkpoints, state_rows, step_chunks,
)
from tops_plugins_tpu_pallas.config import CHUNK_SIZES, check_common_fields
from tops_plugins_tpu_pallas.kda.chunkwise import KDA, chunk_steps
from tops_plugins_tpu_pallas.plan import Blocked, LaunchPlan, Relayout, Scalars
from tops_plugins_tpu_pallas.layout import Geometry, heads_flattened
from tops_plugins_tpu_pallas.recurrence import Recurrence
from tops_plugins_tpu_pallas.kda.sequences import PackedChunk, sequence_work
from tops_plugins_tpu_pallas.simple_gla.varlen import boundaries, boundary_operands

__all__ = ["KdaFusedConfig", "fitted_plans", "forward", "geometry_of", "plans"]


@dataclasses.dataclass(frozen=True)
class KdaFusedConfig:
    """simple_gla's ``FusedConfig`` fields but its backward's, with a default chunk that suits KDA.

    ``chunk_size`` (64 or 128); None: ``TPU_CHUNK_SIZE_BY_CHIP`` for the chip the call is lowered for, else
    ``CHUNK_SIZE``, 64, as in the interpreter (``grid.chunk_size_of``). A KDA chunk's work grows faster than simple_gla's:
    per token, the run sums and the pair products of its ``log2 C`` halving levels cost ``O(C K log C)`` flops, so
    chunks of 128 do about twice the matmul work of chunks of 64 (README "kda"), for the same bytes. v6e's 256-wide MXU
    takes a product of contraction and width up to 256 in the pushes of one of 128, and the chain through the state has
    half the links, so there chunks of 128 issue fewer cycles: at the bench's default shape (B=2 T=4096 H=8 K=V=128 bf16,
    modelled 2026-12-07, the steps below), kda's forward kernel 472317 -> 420655, bounded (``use_gate, A_log,
    lower_bound``) 422612 -> 373296, its checkpoints walk 420009 -> 362402 and its gradients kernel 1242134 -> 1215853;
    gla's forward 218276 -> 210878, its checkpoints walk 128393 -> 67016 and its gradients kernel 647264 -> 629844 (its
    backward at 32 chunks per step there, ``GlaFusedConfig``). On v5e's 128-wide MXUs they issue more
    (kda's checkpoints walk 488272 -> 518283, its gradients kernel 1532741 -> 1603724; gla's forward 284193 -> 307041),
    so the other chips keep 64. ``num_steps``: chunks per grid step, at most (fewer when
    VMEM is short, ``launch.fit``); None: ``TPU_NUM_STEPS`` lowered for a TPU, 1 in the interpreter (``grid.steps_of``).
    Sixteen chunks give the scheduler more independent chunks' factors to fill the state chain's waits with: modelled at
    the bench's default shape, kda's forward kernel 329 -> 304 us on v6e and 508 -> 480 us on v5e against eight (four:
    370 and 531; 32: 296 and 485), gla's forward 189 -> 180 and 292 -> 283 us. The backward (``TPU_BACKWARD_NUM_STEPS``)
    keeps eight: at sixteen Mosaic spills past v5p's 64 MiB of VMEM (kda's gradients kernel, float32, K=64 V=200: 67.4
    MiB, 49.9 of them spill slots) for 1.15 -> 1.10 ms (v6e) and 1.74 -> 1.71 ms (v5e) at the bench's shape.
    ``TPU_NUM_STEPS_BY_CHIP``: the forward's chunks per step where a chip takes more than ``TPU_NUM_STEPS``: on v6e 32,
    re-measured 2026-12-07 at the bench's shape (kda's forward kernel 497309 -> 472317 cycles, bounded 450132 ->
    422612, gla's 222180 -> 218276; on v5e kda's 628536 -> 630328, so it keeps 16). ``TPU_BACKWARD_NUM_STEPS_BY_CHIP``
    likewise for the backward: 16 on v5e and v6e, whose 128 MiB of VMEM hold the spills (float32 K=64 V=200 and
    K=V=256 compile there); kda's checkpoints walk 493097 -> 420009 cycles on v6e and 538321 -> 488272 on v5e, its
    gradients kernel 1286743 -> 1242134 and 1564999 -> 1532741.
    ``full_values``: one grid point per (batch, head) holding all of ``V`` (the decays, pairs and inverse computed once,
    not per 128-lane value tile). ``wy_gradients`` (the delta rule's backward; gla has no solve to replace): the
    gradients kernel differentiates each chunk in flash-linear-attention's WY form (``kda.backward``); None: where the
    chip lowered for has a 256-wide MXU (``WY_GRADIENTS_MXU``), the solve elsewhere and in the interpreter.
    ``keep_residuals`` (the delta rule's): under ``grad`` the forward hands its backward each chunk's inverse (``2 C``
    bytes per token and value head in bf16) and, where the backward would walk them, the states entering the chunks
    (``4 K V / C`` bytes: 512 at ``K = V = 128``, chunks of 128), which a training step then keeps from the layer's
    forward to its backward beside the inputs (``grid.handed_on``); False keeps the inputs alone, and the backward
    recomputes them (its walk again; less memory held across the layers, as under ``jax.checkpoint``, which reruns the
    forward in the backward anyway). ``interpret``: as ``FusedConfig``'s.
    """

    TPU_NUM_STEPS: ClassVar[int] = 16
    TPU_NUM_STEPS_BY_CHIP: ClassVar[Mapping[str, int]] = MappingProxyType({"v6e": 32})
    TPU_BACKWARD_NUM_STEPS: ClassVar[int] = 8
    TPU_BACKWARD_NUM_STEPS_BY_CHIP: ClassVar[Mapping[str, int]] = MappingProxyType({"v5e": 16, "v6e": 16})
    CHUNK_SIZE: ClassVar[int] = 64
    TPU_CHUNK_SIZE_BY_CHIP: ClassVar[Mapping[str, int]] = MappingProxyType({"v6e": 128})

    chunk_size: int | None = None
    num_steps: int | None = None
    full_values: bool = True
    wy_gradients: bool | None = None
    keep_residuals: bool = True
    interpret: Any = None

    def __post_init__(self):
        check_common_fields(self, (None, *CHUNK_SIZES))
        if not isinstance(self.full_values, bool):
            raise TypeError(f"KdaFusedConfig.full_values must be a bool, got {self.full_values!r}")
        if self.wy_gradients is not None and not isinstance(self.wy_gradients, bool):
            raise TypeError(f"KdaFusedConfig.wy_gradients must be None or a bool, got {self.wy_gradients!r}")
        if not isinstance(self.keep_residuals, bool):
            raise TypeError(f"KdaFusedConfig.keep_residuals must be a bool, got {self.keep_residuals!r}")


WY_GRADIENTS_MXU = 256
"""The MXU width from which the gradients kernel takes the WY form by default (``wy_gradients_of``): its products
``D [beta k exp(b) | beta v]`` and their cotangents are 256 wide, one pass there and two on 128-wide MXUs. Modelled at
the bench's shape (2026-12-07), the gradients kernel's cycles with the solve -> in the WY form: gated_delta_rule v6e
731465 -> 679465 (any gates), 697865 -> 639097 (finite gates), v5e 844182 -> 874614, 811542 -> 828277; kda v6e
1216723 -> 1166389, v5e 1532159 -> 1572095."""


def wy_gradients_of(config: KdaFusedConfig, chip: str | None) -> bool:
    """Whether the gradients kernel takes the WY form: ``config.wy_gradients``, or where it is None, whether ``chip`` (the
    chip the call is lowered for; None where not known, as in the interpreter) has an MXU ``WY_GRADIENTS_MXU`` wide."""
    if config.wy_gradients is not None:
        return config.wy_gradients
    return chip is not None and GENERATIONS[chip].mxu >= WY_GRADIENTS_MXU


def activation_work(activations: Activations, geometry: Geometry) -> Work:
    """Per chunk and value block: two transcendentals per element activated (softplus: exp and log;
    sigmoid: exp and a reciprocal)."""
    gated = geometry.chunk_size * geometry.padded_key_dim if activations.use_gate else 0
    strengths = geometry.chunk_size if activations.use_beta_sigmoid else 0
    return Work(transcendentals=2 * (gated + strengths))


def _gate_bias(geometry: Geometry, dtype) -> Blocked:
    """``dt_bias`` ``[HV * K]`` as ``[HV, 1, K_pad]``: the grid head's row (fetched again only when the head changes)."""
    g = geometry

    def head_row(b, h, tile, t, *_):
        return (h, 0, 0)

    relayout = Relayout((g.heads * g.key_dim,), dtype) if g.pads_keys else None
    return Blocked("dt_bias", (g.heads, 1, g.padded_key_dim), dtype, (None, 1, g.padded_key_dim), head_row, relayout)


def plans(
    geometry: Geometry, dtype, *, gate_dtype=None, beta_dtype=None, initial_state_dtype=None,
    output_final_state: bool = False, use_qk_l2norm: bool = False, activations: Activations = Activations(),
    with_A_log: bool = False, dt_bias_dtype=None, num_seqs: int | None = None, pool_rows: int | None = None,
    recurrence: Recurrence = KDA, hands_on: tuple[str, ...] = (),
) -> tuple[LaunchPlan]:
    """The (single) launch plan of one call of ``recurrence``'s op; ``initial_state_dtype`` and ``dt_bias_dtype`` None when
    there is no such input, ``with_A_log`` whether ``A_log`` is given.

    ``g`` (per key, laid out as ``k``, or per head) and, with the delta rule, ``beta`` are always inputs; a dtype of None
    (a ``CallSpec``, which carries neither) plans them as float32, the larger. ``num_seqs``: a packed call (``kda/varlen.py``) of that many
    sequences, whose boundaries and first tokens the kernel reads from SMEM (``varlen.boundaries`` and
    ``packed_operands``' ``start_bits``: ``N + 1 + (2 + C / 32) * chunks`` int32); without states its blocks, work and
    VMEM are the unpacked kernel's at ``B = 1``, and its
    per-sequence states sit in HBM, moved through VMEM buffers, their work counted per sequence. With
    ``pool_rows``, packed or not, the states are rows of a pool of that many rows, moved so and updated in place
    (``grid.state_rows``). ``hands_on``: what it writes for its backward besides (``grid.handed_on``), the state entering
    every chunk (``"checkpoints"``) and every chunk's inverse (``"inverses"``), as the backward's walk writes them.
    """
    scalars = [Scalars("A_log", (geometry.heads,), jnp.float32)] if with_A_log else []
    if num_seqs is not None:
        scalars.extend(boundaries(geometry, num_seqs))
        scalars.append(Scalars("start_bits", (geometry.num_chunks * geometry.chunk_size // 32,), jnp.int32))
    sequences = num_seqs or geometry.batch
    if pool_rows is not None:
        scalars.append(state_rows(sequences))
    inputs = [
        blocks.key_rows("q", geometry, dtype), blocks.key_rows("k", geometry, dtype), blocks.value_rows("v", geometry, dtype),
        gate_block(geometry, gate_dtype or jnp.float32, recurrence),
    ]
    if recurrence.delta_rule:
        inputs.append(blocks.per_head("beta", geometry, beta_dtype or jnp.float32))
    if dt_bias_dtype is not None:
        inputs.append(_gate_bias(geometry, dt_bias_dtype))
    outputs = [blocks.value_rows("o", geometry, dtype)]
    outputs += [{"checkpoints": state_checkpoints, "inverses": functools.partial(chunk_inverses, dtype=dtype)}[name](geometry)
                for name in hands_on]
    scratch = None
    if num_seqs is None and pool_rows is None:
        if initial_state_dtype is not None:
            inputs.append(blocks.state("initial_state", geometry, initial_state_dtype))
        if output_final_state:
            outputs.append(blocks.state("final_state", geometry, jnp.float32))
    else:  # per sequence, in HBM: moved by DMA through VMEM buffers where a sequence starts or ends (kda.sequences)
        state_block = (geometry.padded_key_dim, geometry.value_block)
        scratch = [blocks.running_state(geometry)]
        # Unpacked pool rows: one sequence per grid point, its row loaded at once and stored once (no copy in flight).
        in_flight = num_seqs is not None
        if initial_state_dtype is not None:
            # Read once where its sequence starts and, when it also ends in that chunk, again for its final state.
            moves = 2 if output_final_state and num_seqs is not None else 1
            inputs.append(sequence_states("initial_state", geometry, sequences, initial_state_dtype, moves, pool_rows))
            scratch += state_buffers("initial_state", state_block, initial_state_dtype, keep_in_flight=in_flight)
        if output_final_state:
            outputs.append(sequence_states("final_state", geometry, sequences, jnp.float32, pool_rows=pool_rows))
            scratch += state_buffers("final_state", state_block, jnp.float32, keep_in_flight=in_flight)
    bound, packed = activations.decay_lower_bound, num_seqs is not None
    chunk = recurrence.chunk_work(geometry, use_qk_l2norm, bound, packed) + activation_work(activations, geometry)
    work = chunk * chunks_of_the_grid(geometry)
    if packed:
        states = sequence_work(geometry, initial_state_dtype is not None, output_final_state)
        work = work + states * (geometry.heads * geometry.value_tiles * num_seqs)
    name = f"{recurrence.op}_{'fused' if num_seqs is None else 'varlen'}"
    return (grid.grid_plan(
        name, geometry, scalars, inputs, outputs, work, recurrence.step_body_vmem(geometry, bound), scratch,
        aliases=pool_aliases(pool_rows, output_final_state),
    ),)


def fitted_plans(geometry: Geometry, dtype, *, target: launch.Target = launch.UNKNOWN, **inputs) -> tuple[LaunchPlan]:
    """``plans`` at the geometry ``forward`` launches (fewer chunks per step while ``target``'s VMEM is short)."""
    return grid.fitted_plans(plans, geometry, dtype, target=target, **inputs)


def gate_block(geometry: Geometry, dtype, recurrence: Recurrence) -> Blocked:
    """``g``'s block: a gate per key ``[B, T, HV, K]`` laid out as ``k`` (a row per value head), or one per head ``[B, T, HV]``
    transposed to ``[B, HV, T]`` (every head's row of a step's tokens, ``Recurrence.gates_along_lanes``) or as it is
    (every head's column of a step's rows)."""
    if recurrence.gate_per_key:
        return blocks.key_rows("g", geometry, dtype, per_value_head=True)
    if recurrence.gates_along_lanes(geometry.chunk_size):
        return blocks.gate_rows(geometry, dtype)
    return blocks.per_head("g", geometry, dtype)


def read_chunk(refs: dict, chunk: Chunk, head, recurrence: Recurrence) -> tuple[jax.Array, ...]:
    """The chunk's ``q`` (None where the kernel reads none: the backward's walk for the states alone), ``k``, ``v``,
    ``g`` (as given: raw with ``use_gate``; a gate per head as a float32 ``(C, 1)`` column, or ``(1, C)`` row where
    ``recurrence.gates_along_lanes``) and ``beta`` (float32 ``(C, 1)``, as given; None without the delta rule)."""
    q = chunk.read(refs["q"]) if "q" in refs else None
    k, v = (chunk.read(refs[name]) for name in ("k", "v"))
    if recurrence.gate_per_key:
        g = chunk.read(refs["g"])
    elif recurrence.gates_along_lanes(chunk.rows.size):
        g = chunk.head_row(refs["g"], head)
    else:
        g = chunk.head_column(refs["g"], head)
    return q, k, v, g, chunk.head_column(refs["beta"], head) if recurrence.delta_rule else None


def activated_gate_and_strength(chunk: Chunk, g, beta, A_log, dt_bias, activations: Activations) -> tuple[jax.Array, jax.Array]:
    """The chunk's log decays (float32 ``(C, K_pad)``) and write strengths from the gate and beta as the caller gave them.
    ``A_log``: a scalar or ``(1, 1)``; ``dt_bias``: ``(1, K_pad)``."""
    # Rows past the end of the sequence are read as zeros, but the activations of zero are not zero
    # (a decay, a write strength), and chunk_steps needs those rows to decay and write nothing.
    if activations.use_beta_sigmoid:
        beta = chunk.zero_past_end(activations.strength(beta))
    if activations.use_gate:
        g = chunk.zero_past_end(activations.decay(g, A_log, dt_bias))
    return g.astype(jnp.float32), beta


def kernel(*refs, plan: LaunchPlan, geometry: Geometry, scale: float, use_qk_l2norm: bool, activations: Activations,
           recurrence: Recurrence):
    """The fused kernel of ``recurrence``'s op; with ``cu_seqlens`` among the refs (``num_seqs`` planned) the packed one: every key's
    log decay on a sequence's first row is ``RESET_LOG_DECAY`` (exp of it 0: the state is reset before that token
    writes), which ``chunkwise`` takes exactly, and the per-sequence states enter and leave where each sequence
    starts and ends (``kda.sequences``). With ``activations.decay_lower_bound`` known, ``chunkwise``'s bounded path
    (``fine_block_size``)."""
    refs = plan.bind(refs)
    head, block, step = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    packed = "cu_seqlens" in refs
    # Packed, the carried state starts as zeros (decays of 0 times unset memory could be NaN); initial states enter per sequence.
    start_sequence(refs, step, from_initial_state=not packed)
    states = grid.SequenceStates(refs, head, block, geometry.value_block, refs["state"].shape, read_ahead=1) if packed else None
    if packed:
        states.begin(step == 0)

    A_log = refs["A_log"][head] if "A_log" in refs else None  # a scalar, broadcast by gate
    dt_bias = refs["dt_bias"][...] if "dt_bias" in refs else None
    chunks, inputs = step_chunks(geometry, step), []
    for chunk in chunks:
        q, k, v, g, beta = read_chunk(refs, chunk, head, recurrence)
        g, beta = activated_gate_and_strength(chunk, g, beta, A_log, dt_bias, activations)
        sequences = None
        if packed:
            number = step * geometry.chunks_per_step + chunk.index
            sequences = PackedChunk.of(refs, number, geometry, states, recurrence.gates_along_lanes(geometry.chunk_size))
        inputs.append((q, k, v, g, beta, sequences))
    outputs, entering, state, every_factors = chunk_steps(
        inputs, refs["state"][...], scale=scale, use_qk_l2norm=use_qk_l2norm, recurrence=recurrence,
        lower_bound=activations.decay_lower_bound,
    )
    for chunk, o, before, factors in zip(chunks, outputs, entering, every_factors):
        if "checkpoints" in refs:  # the backward's first walk (kda.backward): the state entering every chunk, no o
            refs["checkpoints"][chunk.index] = before
        if "inverses" in refs:  # and each chunk's inverse, which the gradients kernel then need not recompute
            refs["inverses"][chunk.index] = factors.inverse.astype(refs["inverses"].dtype)
        if "o" in refs:
            refs["o"][chunk.rows, :] = o.astype(refs["o"].dtype)
    refs["state"][...] = state
    if "segment_ends" in refs:  # or the state leaving every step but the last, where the gradients kernel walks the rest
        refs["segment_ends"][...] = state
    if packed:  # each sequence's final state left where it ended; the copies in flight waited for at the last step walked
        states.finish(step == geometry.time_steps - (2 if "segment_ends" in refs else 1))
    else:
        finish_sequence(refs, step, geometry)


def forward(
    q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
    use_gate=False, A_log=None, dt_bias=None, lower_bound=None, use_beta_sigmoid=False, allow_neg_eigval=False,
    config: KdaFusedConfig, ssm_state_indices=None, residuals: bool = False,
):
    """The ``Forward`` protocol of ``tops_core.ops.kda`` (``cu_seqlens`` is rejected by the capabilities).

    The op always passes every argument; the gate's and beta's default to off (g and beta as given) for direct callers.
    A state pool (``ssm_state_indices``) is served in place (``Implementation.serves_pools``). ``residuals``: also
    return what the backward would recompute (``Implementation.residuals``, ``residuals_to_hand_on``)."""
    del cu_seqlens
    return pool_states(
        run, q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm,
        activations=Activations.of(use_gate, lower_bound, use_beta_sigmoid, allow_neg_eigval, keep_promise=True),
        A_log=A_log, dt_bias=dt_bias, config=config, ssm_state_indices=ssm_state_indices,
        hands_on=residuals_to_hand_on(q, v, config, KDA, packed=False) if residuals else None,
    )


def residuals_to_hand_on(q, v, config, recurrence: Recurrence, packed: bool, backward_config=None) -> tuple[str, ...]:
    """What a forward asked for its residuals hands on (``grid.handed_on``, at the backward's geometry, ``backward_config``
    where that is not ``config``): nothing where ``config.keep_residuals`` is off, where the backward's chunks are not the
    forward's, nor where the forward's grid splits the values into blocks (``full_values`` off), whose grid points hold
    no whole state."""
    B, T, H, K = q.shape
    value_heads, V = v.shape[2:]
    forward = geometry_of(B, T, value_heads, K, V, config, value_heads // H)
    backward = geometry_of(B, T, value_heads, K, V, backward_config or config, value_heads // H, backward=True)
    if not config.keep_residuals or backward.chunk_size != forward.chunk_size or not forward.full_values:
        return ()
    return handed_on(recurrence, backward, packed)


def gate_operands(g, beta, A_log, dt_bias, geometry: Geometry, recurrence: Recurrence) -> dict:
    """The op's own operands beyond ``layout.kernel_operands``, by name: ``g`` laid out as ``k`` (per value head) when it
    is per key (``[B, T, HV, K]``); when per head (``[B, T, HV]``), transposed to ``[B, HV, T]`` where
    ``recurrence.gates_along_lanes``, else as given; ``beta``, ``A_log`` and ``dt_bias`` when given."""
    if recurrence.gate_per_key:
        operands = {"g": heads_flattened(g, geometry.padded_key_dim)}
    else:
        operands = {"g": jnp.swapaxes(g, 1, 2) if recurrence.gates_along_lanes(geometry.chunk_size) else g}
    if beta is not None:
        operands["beta"] = beta
    if A_log is not None:
        operands["A_log"] = A_log.astype(jnp.float32)  # SMEM holds 32-bit words; gate computes in float32 anyway
    if dt_bias is not None:
        value_heads, key_dim = g.shape[2:]
        operands["dt_bias"] = heads_flattened(dt_bias.reshape(value_heads, 1, 1, key_dim), geometry.padded_key_dim)  # [HV, 1, K_pad]
    return operands


def resolved(config: KdaFusedConfig, key_dim: int, chip: str | None) -> KdaFusedConfig:
    """``config`` with its chunk decided for ``chip`` (``grid.chunk_size_of``), as a call lowered for that chip runs it:
    what its capability check sizes. ``key_dim`` does not enter (the signature is that of simple_gla's ``resolved``)."""
    del key_dim
    return dataclasses.replace(config, chunk_size=grid.chunk_size_of(config, chip))


def packed_operands(cu_seqlens: jax.Array, seq_len: int, chunk_size: int) -> dict[str, jax.Array]:
    """A packed call's SMEM scalars: ``simple_gla.varlen.boundary_operands``, each chunk's sequences clipped to ``[0, N)``
    (a no-op for valid boundaries; invalid traced ones, for which the op's outputs are NaN, still read SMEM in bounds),
    and ``start_bits``: the tokens that are a sequence's first, a bit each, ``C / 32`` int32 words per chunk (bit ``r % 32``
    of word ``r // 32`` for the chunk's row ``r``; ``sequences.PackedChunk.of`` reads them).

    Made in the kernel, each chunk's resets took a loop over its sequences, and a loop is a wall the scheduler moves no
    work across (README "Packed sequences: tpu_pallas.varlen for kda")."""
    num_seqs = cu_seqlens.shape[0] - 1
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    operands = boundary_operands(cu_seqlens, seq_len, chunk_size)
    for name in ("first_sequence", "last_sequence"):
        operands[name] = jnp.clip(operands[name], 0, num_seqs - 1)
    padded = -(-seq_len // chunk_size) * chunk_size
    starts = jnp.pad(sequence_starts(cu_seqlens, seq_len), (0, padded - seq_len)).reshape(-1, 32).astype(jnp.uint32)
    words = jnp.sum(starts << jnp.arange(32, dtype=jnp.uint32), axis=1, dtype=jnp.uint32)  # distinct bits: the sum is their or
    operands["start_bits"] = lax.bitcast_convert_type(words, jnp.int32)
    return operands


def run(
    q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm, activations: Activations = Activations(),
    A_log=None, dt_bias=None, config, cu_seqlens=None, ssm_state_indices=None, recurrence: Recurrence = KDA,
    hands_on: tuple[str, ...] | None = None,
):
    """One launch of ``recurrence``'s kernel: unpacked, or (``cu_seqlens`` given, ``B == 1``) packed, ``kda/varlen.py``'s,
    its states perhaps rows of a pool (``ssm_state_indices``); ``beta`` None without the delta rule. ``hands_on``: a
    forward asked for its residuals (``grid.run``'s ``hands_on``; perhaps none): ``((o, final_state), residuals)``."""
    geometry = geometry_of(*q.shape, v.shape[-1], config)
    operands = gate_operands(g, beta, A_log, dt_bias, geometry, recurrence)
    num_seqs = None
    if cu_seqlens is not None:
        num_seqs = cu_seqlens.shape[0] - 1
        operands.update(packed_operands(cu_seqlens, q.shape[1], geometry.chunk_size))
    return grid.run(
        functools.partial(kernel, use_qk_l2norm=use_qk_l2norm, activations=activations, recurrence=recurrence),
        functools.partial(
            plans, beta_dtype=None if beta is None else beta.dtype, use_qk_l2norm=use_qk_l2norm, activations=activations,
            with_A_log=A_log is not None, dt_bias_dtype=None if dt_bias is None else dt_bias.dtype, num_seqs=num_seqs,
            recurrence=recurrence,
        ),
        q, k, v, g=g, g_gamma=None, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        config=config, operands=operands, ssm_state_indices=ssm_state_indices, hands_on=hands_on,
    )
