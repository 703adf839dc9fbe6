"""``tpu_pallas.varlen``: the simple_gla forward over packed sequences (``B == 1``, ``cu_seqlens``), in one ``pallas_call``.

The fused kernel's grid, layout and launch (``fused.launch``) over the packed ``T``: ``(1, head,
value block, time step)``, the float32 state carried along the sequential time axis. Sequence boundaries may fall
anywhere, so a chunk holds one or more *segments* (the pieces of the sequences it overlaps). The
boundaries are scalars in SMEM (scalar prefetch), traced under ``jit``: one compile serves every
packing of the same ``T`` and ``N``. Besides ``cu_seqlens`` the kernel reads, per chunk, the first
and last sequence it overlaps (computed from ``cu_seqlens`` before the launch, two int32 per chunk).

Per chunk, with ``b_i`` the chunk-local cumulative log decay (``LogDecays``, the one place its
log-domain values are computed), and for each segment ``[a, e)`` of
sequence ``n`` (in order):

- the state entering the segment is the carried state if ``n`` started before the chunk, else
  ``initial_state[n]`` (copied from HBM by a DMA, only when given) or zeros;
- its rows get ``q_i S exp(b_i - b_{a-1})``;
- it leaves ``S exp(b_{e-1} - b_{a-1}) + sum_{j in [a, e)} exp(b_{e-1} - b_j) k_j^T v_j``: the
  carried state when it is the chunk's last segment, and ``final_state[n]`` (a DMA to HBM) when
  ``n`` ends inside the chunk.

The intra-chunk attention runs once for the whole chunk, masked causal *and* same-sequence. Only
differences of cumulative gates are exponentiated, masked before ``exp``. Empty sequences cover
no token, so no chunk visits them: their final state (``initial_state[n]`` or zeros) is set
around the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tops_plugins_tpu_pallas import blocks, fused
from tops_plugins_tpu_pallas.chunkwise import (
    _COLUMNS_BY_COLUMNS, _ROWS_BY_ROWS, Work, advance_state_work, chunk_body_vmem, chunk_output_work, chunks_of_the_grid,
    constant_gates, gate_computations, gates_work, matmul, mxu_operand_dtype, step_chunks,
)
from tops_plugins_tpu_pallas.fused import FusedConfig
from tops_plugins_tpu_pallas.launch import DmaSemaphores, InHbm, LaunchPlan, Relayout, Scalars, Scratch
from tops_plugins_tpu_pallas.layout import Geometry

_F32 = jnp.float32


class VarlenConfig(FusedConfig):
    """The fused kernel's fields and defaults: ``chunk_size`` (64 or 128), ``num_steps`` chunks per
    grid step at most (fewer when VMEM is short), ``full_values`` (one value block of all of ``V``),
    ``interpret`` (None: compile where lowered for a TPU, interpret elsewhere)."""


def _sequence_state(name: str, geometry: Geometry, num_seqs: int, dtype) -> InHbm:
    """``initial_state`` or ``final_state`` ``[N, H, K_pad, V_pad]``, moved one (sequence, head, value block) at a time by DMA."""
    g = geometry
    relayout = Relayout((num_seqs, g.heads, g.key_dim, g.value_dim), dtype) if g.pads_state else None
    return InHbm(name, (num_seqs, g.heads, g.padded_key_dim, g.padded_value_dim), dtype, relayout)


def plans(geometry: Geometry, dtype, num_seqs: int, *, gate_dtype=None, initial_state_dtype=None, output_final_state: bool = False) -> tuple[LaunchPlan]:
    """The (single) launch plan for one packed call of ``num_seqs`` sequences (``geometry.batch`` is 1)."""
    g = geometry
    inputs = [blocks.key_rows("q", g, dtype), blocks.key_rows("k", g, dtype), blocks.value_rows("v", g, dtype)]
    if gate_dtype is not None:
        inputs.append(blocks.gates(g, gate_dtype))
    state_block = (g.padded_key_dim, g.value_block)
    scratch = [blocks.running_state(g), Scratch("leaving", state_block, _F32), DmaSemaphores("copies", 2)]
    if initial_state_dtype is not None:
        inputs.append(_sequence_state("initial_state", g, num_seqs, initial_state_dtype))
        scratch.append(Scratch("loaded", state_block, initial_state_dtype))
    outputs = [blocks.value_rows("o", g, dtype)]
    if output_final_state:
        outputs.append(_sequence_state("final_state", g, num_seqs, _F32))
    # Every segment runs the from-state and state-update matmuls of a whole chunk, masked, and
    # exponentiates its own decays (2 C + 1). Segments: one per chunk plus one per sequence starting
    # inside a chunk, at most N - 1 (the packing is traced, so this bound is what XLA is told).
    C, K, Vb = g.chunk_size, g.padded_key_dim, g.value_block
    segment_exps = Work(transcendentals=2 * C + 1)
    extra_segment = Work(flops=2 * C * K * Vb) + advance_state_work(g) + segment_exps
    gated = gate_dtype is not None
    work = (chunk_output_work(g) + advance_state_work(g) + segment_exps) * chunks_of_the_grid(g)
    work = work + gates_work(g, gated) * gate_computations(g, gated) + extra_segment * (g.heads * g.value_tiles * (num_seqs - 1))
    return (LaunchPlan(
        name="simple_gla_varlen",
        grid=blocks.grid(g),
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        scalars=(
            blocks.decay(g), Scalars("cu_seqlens", (num_seqs + 1,), jnp.int32),
            Scalars("first_sequence", (g.num_chunks,), jnp.int32), Scalars("last_sequence", (g.num_chunks,), jnp.int32),
        ),
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        scratch=tuple(scratch),
        body_vmem=chunk_body_vmem(g),
        flops=work.flops,
        transcendentals=work.transcendentals,
    ),)


def fitted_plans(geometry: Geometry, dtype, num_seqs: int, **inputs) -> tuple[LaunchPlan]:
    """``plans`` at the geometry ``forward`` launches (fewer chunks per step when VMEM is short)."""
    return fused.fitted_plans(geometry, dtype, functools.partial(plans, num_seqs=num_seqs), **inputs)


def _at_row(column: jax.Array, rows: jax.Array, row: jax.Array) -> jax.Array:
    """``column[row]`` as ``(1, 1)`` by a masked sum (exact: one term), 0 when ``row`` is outside the chunk."""
    return jnp.sum(jnp.where(rows == row, column, 0.0), axis=0, keepdims=True)


def _kernel(*refs, plan: LaunchPlan, geometry: Geometry, scale: float):
    refs = plan.bind(refs)
    head, block, step = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    C, Vb = geometry.chunk_size, geometry.value_block
    cu = refs["cu_seqlens"]
    rows = lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    columns = lax.broadcasted_iota(jnp.int32, (C, C), 1)

    def sequence_state(name: str, n: jax.Array):
        return refs[name].at[n, head, :, pl.ds(pl.multiple_of(block * Vb, Vb), Vb)]

    def fresh_state(n: jax.Array, continuing: jax.Array) -> jax.Array:
        """``initial_state[n]`` (copied in only when sequence ``n`` starts in this chunk) or zeros."""
        if "initial_state" not in refs:
            return jnp.zeros(refs["state"].shape, _F32)

        @pl.when(jnp.logical_not(continuing))
        def _load():
            copy = pltpu.make_async_copy(sequence_state("initial_state", n), refs["loaded"], refs["copies"].at[0])
            copy.start()
            copy.wait()

        return refs["loaded"][...].astype(_F32)

    constant = constant_gates(refs, head, geometry)
    state = refs["state"][...]  # unset at step 0, where the first sequence starts and never reads it
    for chunk in step_chunks(geometry, step):
        number = step * geometry.chunks_per_step + chunk.index
        first = number * C  # the chunk's first token in the packed sequence
        log = chunk.log_decays(refs, head)
        gates = chunk.gates(refs, head, constant, log)
        q, k, v = chunk.read(refs["q"]), chunk.read(refs["k"]), chunk.read(refs["v"])
        operands = mxu_operand_dtype(q.dtype)

        def segment(n, carry, q=q, k=k, v=v, log=log, first=first, operands=operands):
            from_states, segment_start, carried = carry
            start, end = cu[n], cu[n + 1]
            a, e = jnp.clip(start - first, 0, C), jnp.clip(end - first, 0, C)
            continuing = start < first
            entering = jnp.where(continuing, carried, fresh_state(n, continuing))
            inside = (rows >= a) & (rows < e)
            before, last = _at_row(log.column, rows, a - 1), _at_row(log.column, rows, e - 1)
            decayed_queries = jnp.exp(jnp.where(inside, log.column - before, 0.0))
            from_states = from_states + jnp.where(inside, matmul(q, entering, operands) * decayed_queries, 0.0)
            weighted_keys = jnp.where(inside, k.astype(_F32) * jnp.exp(jnp.where(inside, last - log.column, 0.0)), 0.0)
            leaving = entering * jnp.exp(last - before) + matmul(weighted_keys, v, operands, _COLUMNS_BY_COLUMNS)

            if "final_state" in refs:

                @pl.when((end <= first + C) & (e > a))
                def _finish():
                    refs["leaving"][...] = leaving
                    copy = pltpu.make_async_copy(refs["leaving"], sequence_state("final_state", n), refs["copies"].at[1])
                    copy.start()
                    copy.wait()

            return from_states, jnp.where(rows >= a, a, segment_start), leaving

        # The last segment's leaving state is the chunk's last sequence's, carried into the next chunk.
        from_states, segment_start, state = lax.fori_loop(
            refs["first_sequence"][number], refs["last_sequence"][number] + 1, segment,
            (jnp.zeros((C, Vb), _F32), jnp.zeros((C, 1), jnp.int32), state),
        )
        same_sequence = (rows >= columns) & (columns >= segment_start)
        attention = jnp.where(same_sequence, matmul(q, k, operands, _ROWS_BY_ROWS) * gates.decays, 0.0)
        o = scale * (matmul(attention, v, operands) + from_states)
        refs["o"][chunk.rows, :] = o.astype(refs["o"].dtype)
    refs["state"][...] = state


def sequences_of_chunks(cu_seqlens: jax.Array, seq_len: int, chunk_size: int) -> tuple[jax.Array, jax.Array]:
    """The first and last sequence each chunk overlaps (int32 ``[chunks]`` each); empty sequences never are either."""
    starts = jnp.arange(0, seq_len, chunk_size, dtype=jnp.int32)
    last_tokens = jnp.minimum(starts + chunk_size, seq_len) - 1
    # The sequence holding token t is the last n with cu[n] <= t (an empty sequence at t is followed by the one holding t).
    holding = lambda t: jnp.searchsorted(cu_seqlens, t, side="right").astype(jnp.int32) - 1  # noqa: E731
    return holding(starts), holding(last_tokens)


def forward(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, config: VarlenConfig):
    """The ``Forward`` protocol of ``tops_core.ops.simple_gla`` for packed input (``B == 1``, ``cu_seqlens`` given)."""
    num_seqs = cu_seqlens.shape[0] - 1
    first_sequence, last_sequence = sequences_of_chunks(cu_seqlens, q.shape[1], config.chunk_size)
    o, final_state = fused.launch(
        _kernel, functools.partial(plans, num_seqs=num_seqs), q, k, v, g=g, g_gamma=g_gamma, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, config=config,
        scalars=dict(cu_seqlens=cu_seqlens, first_sequence=first_sequence, last_sequence=last_sequence),
    )
    if output_final_state:
        # The kernel writes the final state of every sequence that covers a token; an empty one ends where it starts.
        empty = (cu_seqlens[1:] == cu_seqlens[:-1])[:, None, None, None]
        final_state = jnp.where(empty, 0.0 if initial_state is None else initial_state.astype(_F32), final_state)
    return o, final_state
