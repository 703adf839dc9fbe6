"""``tpu_pallas.fused``: the whole simple_gla forward in one ``pallas_call``.

Grid ``(batch, head, value tile, time step)``; the first three are "parallel", time is
"arbitrary" (sequential). The float32 state lives in a VMEM scratch along the time axis and never
goes to HBM; it is (re)initialised at the first time step of every (batch, head, value tile) and
written to ``final_state`` at the last. Each grid step walks ``chunks_per_step`` consecutive
chunks (at most ``num_steps``: ``Geometry.chunks_per_step``) to cut per-step overhead; every
chunk does the same operations whatever the step size, so results are bitwise identical for
every ``num_steps``. The intra-chunk attention is recomputed inline, never stored.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from tops_core.tpu.generations import GENERATIONS

from tops_plugins_tpu_pallas import blocks, grid, launch
from tops_plugins_tpu_pallas.grid import (
    chunks_of_the_grid, finish_sequence, pool_aliases, pool_states, sequence_states, start_sequence, state_buffers, state_rows,
    step_chunks,
)
from tops_plugins_tpu_pallas.mxu import SPLIT_BFLOAT16, mxu_operand_dtype
from tops_plugins_tpu_pallas.simple_gla.chunkwise import (
    advance_state, advance_state_work, attend, chunk_body_vmem, chunk_output_work, constant_gates,
    decayed_scores, gate_computations, gates_work, intra_chunk_output, output_from_state, step_gates,
)
from tops_plugins_tpu_pallas.config import CHUNK_SIZES as COMMON_CHUNK_SIZES, check_common_fields
from tops_plugins_tpu_pallas.plan import LaunchPlan
from tops_plugins_tpu_pallas.layout import LANES, Geometry


FLOAT32_PRECISIONS = ("highest", "high")
CHUNK_SIZES = (*COMMON_CHUNK_SIZES, 256)


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """``chunk_size``: tokens per chunk (64, 128 or 256); None: as ``chunk_size_for`` decides for the call (256 on
    v6e's 256-wide MXU when ``K <= 128``, else 128), and 128 for the backward (``backward_fused``) whatever
    the chip. ``num_steps``: chunks per grid step, at most: fewer when
    the step's blocks would not fit the VMEM budget (``launch.fit``). ``backward_num_steps``:
    chunks per segment of the backward (``backward_fused``), at most, fewer when VMEM is short; None: as
    many as make ``backward_fused.SEGMENT_TOKENS`` (4096) tokens (``backward_varlen.SEGMENT_TOKENS``, 2048, for a packed call with states). ``full_values``: one grid point
    per (batch, head) holding all of ``V`` (``q`` and ``k`` read once, the MXU's full width on ``V``), else
    one per 128-lane value tile. ``attention_first``: trace every chunk's attention of a grid step ahead of
    the chain through the state (True), or each chunk's attention beside its link of the chain, the
    next chunk's scores one link early (False); None: as ``attention_first`` decides for the call. Both compute the same operations, bit for
    bit; only the static schedule differs. ``float32_precision`` (float32 inputs): ``"highest"``, six
    bf16 MXU passes per product (float32 accuracy), or ``"high"``, three (each float32 operand as two
    bf16 parts, all products but low x low): about half the MXU time, within the float32 tolerance
    but with less room (README "Numerics"). ``interpret``: None (compile where lowered for a TPU, interpret
    elsewhere), True (fast interpreter), a ``pltpu.InterpretParams`` (faithful interpreter) or False
    (always compile).

    The defaults are what the cost model (README "Modelled on TPU") found fastest on v5e and v6e: a
    grid step carries a fixed cost of a few hundred cycles, and a longer step gives the scheduler more
    independent work to fill the state chain's gaps with, so steps of 4096 rows (32 chunks) beat 1024
    and 2048; chunks of 128 halve the MXU rows a token streams for the state (the 64-row chunk's
    products waste most of v6e's 256-wide MXU).
    """

    ACCEPTED_CHUNK_SIZES: ClassVar[tuple] = (None, *CHUNK_SIZES)  # what ``chunk_size`` accepts (``VarlenConfig`` fewer)

    chunk_size: int | None = None
    num_steps: int = 32
    full_values: bool = True
    backward_num_steps: int | None = None
    attention_first: bool | None = None
    float32_precision: str = "highest"
    interpret: Any = None

    def __post_init__(self):
        check_common_fields(self, self.ACCEPTED_CHUNK_SIZES)
        if self.attention_first is not None and not isinstance(self.attention_first, bool):
            raise TypeError(f"FusedConfig.attention_first must be None or a bool, got {self.attention_first!r}")
        if self.float32_precision not in FLOAT32_PRECISIONS:
            raise ValueError(f"FusedConfig.float32_precision must be one of {FLOAT32_PRECISIONS}, got {self.float32_precision!r}")
        steps = self.backward_num_steps
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
            raise ValueError(f"FusedConfig.backward_num_steps must be None or an int >= 1, got {steps!r}")
        if not isinstance(self.full_values, bool):
            raise TypeError(f"FusedConfig.full_values must be a bool, got {self.full_values!r}")


def fitted_plans(geometry: Geometry, dtype, *, target: launch.Target = launch.UNKNOWN, **inputs) -> tuple[LaunchPlan]:
    """``plans`` at the geometry that fits ``target``'s VMEM: what ``forward`` launches."""
    return grid.fitted_plans(plans, geometry, dtype, target=target, **inputs)


def plans(
    geometry: Geometry, dtype, *, gate_dtype=None, initial_state_dtype=None, output_final_state: bool = False, pool_rows: int | None = None,
) -> tuple[LaunchPlan]:
    """The (single) launch plan for one call; ``gate_dtype``/``initial_state_dtype`` None when that input is absent;
    ``pool_rows``: the states are rows of a pool of that many rows (``grid.state_rows``), updated in place."""
    inputs = [blocks.key_rows("q", geometry, dtype), blocks.key_rows("k", geometry, dtype), blocks.value_rows("v", geometry, dtype)]
    if gate_dtype is not None:
        along_lanes = gates_along_lanes(True, geometry.chunk_size)
        inputs.append((blocks.gate_rows if along_lanes else blocks.gates)(geometry, gate_dtype))
    scalars, scratch = [blocks.decay(geometry)], None

    def state(name: str, state_dtype):
        if pool_rows is None:
            return blocks.state(name, geometry, state_dtype)
        return sequence_states(name, geometry, geometry.batch, state_dtype, pool_rows=pool_rows)

    if pool_rows is not None:  # each sequence's row moved by DMA at its first and last step (grid.start_sequence)
        scalars.append(state_rows(geometry.batch))
        block = (geometry.padded_key_dim, geometry.value_block)
        # One sequence per grid point: its row loaded at once and stored once, with no copy in flight between sequences.
        scratch = [blocks.running_state(geometry), *state_buffers("initial_state", block, initial_state_dtype, keep_in_flight=False)]
        scratch += state_buffers("final_state", block, jnp.float32, keep_in_flight=False) if output_final_state else []
    if initial_state_dtype is not None:
        inputs.append(state("initial_state", initial_state_dtype))
    outputs = [blocks.value_rows("o", geometry, dtype)]
    if output_final_state:
        outputs.append(state("final_state", jnp.float32))
    gated = gate_dtype is not None
    work = (chunk_output_work(geometry) + advance_state_work(geometry)) * chunks_of_the_grid(geometry) + gates_work(geometry, gated) * gate_computations(geometry, gated)
    return (grid.grid_plan(
        "simple_gla_fused", geometry, scalars, inputs, outputs, work, chunk_body_vmem(geometry), scratch,
        aliases=pool_aliases(pool_rows, output_final_state),
    ),)


def chunk_size_for(config: FusedConfig, key_dim: int, chip: str | None) -> int:
    """The forward's chunk: ``config.chunk_size``, or when None, what the compiled schedule found fastest.

    Cycles one TensorCore issues for a grid step of 4096 rows (32 chunks of 128 or 16 of 256), K=V=128,
    chunk 128 -> 256: on v6e's 256-wide MXU bf16 ``g_gamma`` 5462 -> 3532 (under the step's HBM time,
    about 4480), ``g`` 9623 -> 8089, float32 at ``"high"`` 10337 -> 9530; the chunk's products fill
    the MXU's width. On the 128-wide MXUs (v4, v5e, v5p) chunk 256 doubles the intra-chunk work
    without a wider MXU to take it (modelled v5e, in a layer: ``g`` 1.07x -> 1.42x its HBM floor,
    float32 1.60x -> 2.40x). At K >= 256 (v6e) chunk 128 issues fewer cycles (5567 against 7480).
    """
    if config.chunk_size is not None:
        return config.chunk_size
    return 256 if wide_mxu(chip) and key_dim <= LANES else 128


def wide_mxu(chip: str | None) -> bool:
    """Whether ``chip`` (None: not known) has 256-wide MXUs (v6e), the fact both schedule rules (and the backward's
    ``gradients.stacked_operands``) turn on."""
    return chip is not None and GENERATIONS[chip].mxu >= 256


def resolved(config: FusedConfig, key_dim: int, chip: str | None) -> FusedConfig:
    """``config`` with the forward's ``chunk_size`` decided (``chunk_size_for``): what the forward and its capability check size."""
    return dataclasses.replace(config, chunk_size=chunk_size_for(config, key_dim, chip))


def attention_first(config: FusedConfig, dtype, key_dim: int, chip: str | None) -> bool:
    """Whether the kernel traces a step's attention ahead of its state chain (``FusedConfig.attention_first``).

    None decides by the compiled schedule (cycles one TensorCore issues for a grid step of 32
    chunks of 128, K=V=128 unless said, ahead -> beside, with the next chunk's scores one link
    early): ahead only on a 256-wide MXU (v6e) for bf16 with K >= 256 at chunk 128, where beside doubles the
    step (g_gamma 5567 -> 10781, g 10589 -> 15121). At chunk 256 beside wins on v6e for every
    case measured: bf16 ``g_gamma`` 5257 -> 3532, ``g`` 8755 -> 8089, K=V=256 7848 -> 7480,
    float32 23176 -> 20113. Beside everywhere else: bf16 g on v6e 9605 ->
    9623 (a tie) and on v5e 9646 -> 9552; float32 g 26709 -> 24349 (v6e) and 29275 -> 28372 (v5e);
    float32 at ``"high"`` g_gamma on v6e 14769 -> 10337. (Before the next scores went early,
    ahead was also the rule with ``g``.)
    """
    if config.attention_first is not None:
        return config.attention_first
    return wide_mxu(chip) and jnp.dtype(dtype) == jnp.bfloat16 and key_dim >= 256 and chunk_size_for(config, key_dim, chip) <= 128


def explain(config: FusedConfig, dtype, key_dim: int, chip: str | None) -> str:
    """One line on the forward's chunk and attention schedule for a call, and the rules behind the fields left None."""
    line = f"chunk_size={chunk_size_for(config, key_dim, chip)}"
    if config.chunk_size is None:
        line += f" (None: 256 on a 256-wide MXU when K <= 128, else 128; {chip or 'chip not known'})"
    line += f", attention {'ahead of' if attention_first(config, dtype, key_dim, chip) else 'beside'} the state chain"
    return line + (" (attention_first None: by chip, dtype, K and chunk)" if config.attention_first is None else "")


def operands_of(config: FusedConfig, dtype):
    """What the forward's MXU products take their operands as (``mxu.matmul``): ``mxu_operand_dtype``,
    or for float32 inputs at ``float32_precision="high"`` two bf16 parts each."""
    if jnp.dtype(dtype) == jnp.float32 and config.float32_precision == "high":
        return SPLIT_BFLOAT16
    return mxu_operand_dtype(dtype)


def gates_along_lanes(gated: bool, chunk_size: int) -> bool:
    """Whether the kernel reads ``g`` laid out ``[B, H, T]`` and computes each chunk's gates along lanes
    (``ChunkGates.along_lanes``), and transposes each chunk's keys once, for its scores and its state update
    alike, so their decays are the decay matrix's last row (``chunkwise.advance_state``), not a ``(C, 1)`` exp.

    A ``(C, 1)`` column takes one vector register per 8 rows for every operation on it. Cycles one
    TensorCore issues for a 4096-row grid step, bf16 K=V=128 with ``g``, 16 heads, columns ->
    transposed keys -> gates along lanes: v6e (chunk 256) 7375 -> 6710 -> 5139, v5e (chunk 128)
    7192 -> 7323 -> 6354. In a layer the ``[B, H, T]`` operand also spares the relayout copy XLA
    made of the ``[B, T, H]`` one (64 B per token and head): modelled v6e 1.42x -> 1.04x its HBM
    floor, v5e 1.07x -> 1.00x. Chunk 64 keeps columns (a block's tokens must fill 128 lanes), and
    ``g_gamma`` alone has no per-token gates.
    """
    return gated and chunk_size >= LANES


def gates_as_rows(g, chunk_size: int) -> dict:
    """``{"g": g}`` transposed to ``[B, H, T]`` where the kernels take their gates along lanes (``gates_along_lanes``), in
    place of the layout's ``(rows, H)`` operand; else nothing."""
    if not gates_along_lanes(g is not None, chunk_size):
        return {}
    return {"g": jnp.swapaxes(g, 1, 2)}


def resets_dtype(chip: str | None):
    """What the fused forward holds each chunk's reset counts in for its decay masks (``ChunkGates.along_lanes``): bfloat16
    on a 256-wide MXU's chip (v6e), float32 elsewhere.

    With ``g`` the masks compare each row's count with each column's, and broadcasting the rows' counts
    along lanes is most of what exact ``-inf`` gates cost; in bfloat16 a register holds 16 rows, so half
    as many broadcasts. Cycles one TensorCore issues for a 4096-row grid step (bf16 K=V=128 with ``g``,
    16 heads), float32 -> bfloat16: v6e (chunk 256) 6244 -> 5621; v5e (chunk 128) 7201 -> 7245 and at
    chunk 256 9360 -> 9816, v5p 4064 -> 4058; on v4 the step would no longer fit its 16 MiB of VMEM.
    """
    return jnp.bfloat16 if wide_mxu(chip) else jnp.float32


def _kernel(*refs, plan: LaunchPlan, geometry: Geometry, scale: float, attention_first: bool, operands, resets_dtype):
    refs = plan.bind(refs)
    head, step = pl.program_id(1), pl.program_id(3)
    start_sequence(refs, step)
    along_lanes = gates_along_lanes("g" in refs, geometry.chunk_size)
    chunks = step_chunks(geometry, step)
    every_gates = step_gates(chunks, refs, head, constant_gates(refs, head, geometry), along_lanes=along_lanes, resets_dtype=resets_dtype)
    state_chain(refs, chunks, every_gates, scale=scale, attention_first=attention_first, operands=operands, along_lanes=along_lanes)
    finish_sequence(refs, step, geometry)


def state_chain(
    refs: dict, chunks: list, every_gates: list, *, scale: float, attention_first: bool, operands, along_lanes: bool,
    output_terms: Callable[[int], jax.Array | None] | None = None,
    state_terms: Callable[[int, jax.Array], jax.Array | None] | None = None,
) -> None:
    """A grid step's chunks through the state in ``refs["state"]``, in order: each chunk's output written to ``refs["o"]``
    and the state advanced past it. A packed kernel adds what its resets left out (``varlen``): ``output_terms(index)``
    to the chunk's output, ``state_terms(index, entering)`` to the state leaving it (``entering``: the state entering
    the chunk); either may give None, nothing to add."""
    prepared = []
    for chunk in chunks:
        q, k, v = chunk.read(refs["q"]), chunk.read(refs["k"]), chunk.read(refs["v"])
        k = k.T if along_lanes else k  # keys transposed: their decays are the decay matrix's last row
        if attention_first:
            every_gates[chunk.index] = every_gates[chunk.index].with_decays()
        prepared.append((chunk, q, k, v, intra_chunk_output(q, k, v, every_gates[chunk.index], operands, along_lanes) if attention_first else None))
    # The attention does not depend on the state. Traced ahead of the chain through the state, the
    # scheduler fills the chain's gaps with it; else beside each link, with the next chunk's scores
    # one link early, so the MXU computes them while this link's products drain.
    def scores_of(index):
        if index == len(prepared):
            return None
        _, q, k, _, _ = prepared[index]
        every_gates[index] = every_gates[index].with_decays()
        return decayed_scores(q, k, every_gates[index], operands, along_lanes)

    state = refs["state"][...]
    scores = None if attention_first else scores_of(0)
    for index, (chunk, q, k, v, intra) in enumerate(prepared):
        gates = every_gates[index]
        if intra is None:
            current, scores = scores, scores_of(index + 1)
            intra = attend(current, v, operands)
        o = output_from_state(intra, q, state, gates, scale, operands)
        added = output_terms(index) if output_terms is not None else None
        refs["o"][chunk.rows, :] = (o if added is None else o + added).astype(refs["o"].dtype)
        entering, state = state, advance_state(state, k, v, gates, operands, along_lanes)
        added = state_terms(index, entering) if state_terms is not None else None
        state = state if added is None else state + added
    refs["state"][...] = state


def forward(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, config: FusedConfig, ssm_state_indices=None):
    """The ``Forward`` protocol of ``tops_core.ops.simple_gla`` (``cu_seqlens`` is rejected by the capabilities), a state
    pool (``ssm_state_indices``) served in place (``Implementation.serves_pools``)."""
    del cu_seqlens
    return pool_states(_forward, q, k, v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, config=config, ssm_state_indices=ssm_state_indices)


def _forward(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, config: FusedConfig, ssm_state_indices):
    chip = launch.Target.lowered_for().chip
    config = resolved(config, q.shape[-1], chip)
    first = attention_first(config, q.dtype, q.shape[-1], chip)
    kernel = functools.partial(_kernel, attention_first=first, operands=operands_of(config, q.dtype), resets_dtype=resets_dtype(chip))
    return grid.run(
        kernel, plans, q, k, v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, config=config, operands=gates_as_rows(g, config.chunk_size),
        ssm_state_indices=ssm_state_indices,
    )
