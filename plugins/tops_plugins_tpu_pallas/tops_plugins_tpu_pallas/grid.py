"""The fused grid every forward of this plugin runs on, whatever the op: ``(batch, head, value block,
time step)``, the first three parallel, time sequential, the running state in VMEM scratch, each grid
step unrolling its chunks (``step_chunks``); the same grid walked in reverse by the backwards (state
checkpoints, ``dS`` in VMEM: ``reversed_in_time`` and below); ``Work``, the flops and exps a kernel declares;
and states moved by DMA one sequence at a time (``SequenceStates``: packed sequences, state pools, ``pool_states``).
Op-independent; ``simple_gla/`` and ``kda/`` hold what a chunk of each op computes."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from tops_core import target_chip
from tops_core.ops import pool

from tops_plugins_tpu_pallas import blocks, launch
from tops_plugins_tpu_pallas.layout import LANES, Geometry, caller_output, caller_state, kernel_operands
from tops_plugins_tpu_pallas.mxu import mxu_operand_dtype
from tops_plugins_tpu_pallas.plan import Blocked, DmaSemaphores, InHbm, LaunchPlan, Relayout, ScalarScratch, Scalars, Scratch

if TYPE_CHECKING:  # recurrence imports this module's users
    from tops_plugins_tpu_pallas.recurrence import Recurrence

_F32 = jnp.float32


def geometry_of(B: int, T: int, H: int, K: int, V: int, config, groups: int = 1, backward: bool = False) -> Geometry:
    """The grid's geometry for a call of ``H`` (value) heads, ``groups`` of them per query/key head;
    ``config``: any config with ``chunk_size`` (``chunk_size_of``), ``num_steps`` (``steps_of``) and ``full_values``."""
    return Geometry(B, T, H, K, V, chunk_size_of(config, target_chip()), steps_of(config, backward), config.full_values, groups)


def chunk_size_of(config, chip: str | None) -> int:
    """``config.chunk_size``, or where a config leaves it None, its ``TPU_CHUNK_SIZE_BY_CHIP`` for ``chip`` (the chip the
    call is lowered for; None where that is not known, as in Pallas' interpreter on a host without a TPU), else its
    ``CHUNK_SIZE``. Any chunk gives the same results to rounding; what it changes is how the products fill the MXU."""
    if config.chunk_size is not None:
        return config.chunk_size
    return config.TPU_CHUNK_SIZE_BY_CHIP.get(chip, config.CHUNK_SIZE)


def steps_of(config, backward: bool = False) -> int:
    """``config.num_steps``, or where a config leaves it None, its ``TPU_NUM_STEPS`` (or its ``TPU_NUM_STEPS_BY_CHIP``
    for the chip the call is lowered for; ``backward``: its ``TPU_BACKWARD_NUM_STEPS``, ``..._BY_CHIP``) where lowered for a
    TPU and 1 in Pallas' interpreter. Unrolled chunks save a TPU the per-step overhead; the interpreter they only give a
    larger program to compile (one kit case of kda's packed gradients: 19 s at 8 chunks per step, 8 s at 1). The results
    are the same bits either way, but kda's and gla's ``dg``, the same to float32 rounding
    (``test_num_steps_do_not_change_a_bit``). A call traced on a host without a TPU for a TPU it does not name
    (``target_chip`` None, ``interpret=None``) counts as interpreted: 1 chunk per step."""
    if config.num_steps is not None:
        return config.num_steps
    interpreted = config.interpret is not False if config.interpret is not None else (
        target_chip() is None and jax.default_backend() != "tpu"
    )
    if interpreted:
        return 1
    if backward:
        return config.TPU_BACKWARD_NUM_STEPS_BY_CHIP.get(target_chip(), config.TPU_BACKWARD_NUM_STEPS)
    return config.TPU_NUM_STEPS_BY_CHIP.get(target_chip(), config.TPU_NUM_STEPS)


def fitted_plans(build_plans, geometry: Geometry, dtype, *, target: launch.Target = launch.UNKNOWN, **inputs) -> tuple[LaunchPlan, ...]:
    """``build_plans`` at the geometry that fits ``target``'s VMEM: what ``run`` launches."""
    return launch.fit(build_plans, geometry, dtype, target, **inputs)[1]


def grid_plan(name: str, geometry: Geometry, scalars, inputs, outputs, work: Work, body_vmem: int, scratch=None, aliases=()) -> LaunchPlan:
    """A plan on the fused grid: (batch, head, value block) parallel, time sequential (forward or, as a backward's
    index maps say, reversed), the running state in VMEM scratch (``scratch``: the whole scratch, when a kernel
    needs other scratch than that); ``aliases`` as ``LaunchPlan``'s."""
    return LaunchPlan(
        name=name,
        grid=blocks.grid(geometry),
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        scalars=tuple(scalars),
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        scratch=(blocks.running_state(geometry),) if scratch is None else tuple(scratch),
        body_vmem=body_vmem,
        flops=work.flops,
        transcendentals=work.transcendentals,
        aliases=tuple(aliases),
    )


def run(kernel, build_plans, q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, config, operands=None,
        ssm_state_indices=None, hands_on: tuple[str, ...] | None = None):
    """One ``pallas_call`` over the fused grid, for this kernel and for any kernel on the same grid and layout.

    ``kernel(*refs, plan=, geometry=, scale=)`` runs the grid that ``build_plans`` (the signature of
    ``simple_gla.fused.plans``) describes, at the geometry that fits VMEM; ``operands`` are arrays beyond the
    layout's (``kernel_operands``), or in place of one of them of the same name (kda's ``g``, laid
    out as ``k``). ``config``: any config with ``chunk_size``, ``num_steps``,
    ``full_values`` and ``interpret`` (``FusedConfig``, ``VarlenConfig``, ``KdaFusedConfig``). Returns ``o`` and, when asked for, ``final_state`` as the
    caller lays them out. The grid runs over ``v``'s heads; with more of them than ``q``'s (grouped value
    heads, kda), each group reads its query/key head in place (``blocks.key_rows``). With ``ssm_state_indices``,
    ``initial_state`` is a pool whose rows the sequences read and write in place: the plans get ``pool_rows``, the
    kernel the indices as ``state_rows`` (``SequenceStates``), and the final state returned is the pool.
    ``hands_on``: a forward asked for its residuals, the kernel's outputs besides those (``build_plans`` gets them:
    ``"checkpoints"``, ``"inverses"``; perhaps none), returned after them chunk by chunk (``by_chunk``):
    ``((o, final_state), {name: array})``.
    """
    B, T, H, K = q.shape
    value_heads = v.shape[2]
    inputs = dict(
        gate_dtype=None if g is None else g.dtype,
        initial_state_dtype=None if initial_state is None else initial_state.dtype,
        output_final_state=output_final_state,
        **({"hands_on": hands_on} if hands_on else {}),
    )
    if ssm_state_indices is not None:
        inputs["pool_rows"] = initial_state.shape[0]
    geometry, (plan,), run_plan = launch.prepare(
        build_plans, geometry_of(B, T, value_heads, K, v.shape[-1], config, value_heads // H), q.dtype, config.interpret, **inputs,
    )
    arrays = {**kernel_operands(q, k, v, g, g_gamma, initial_state, geometry), **(operands or {})}
    if ssm_state_indices is not None:
        arrays["state_rows"] = ssm_state_indices
    results = run_plan(plan, kernel, arrays, scale=scale)
    final_state = caller_state(results["final_state"], geometry) if output_final_state else None
    outputs = caller_output(results["o"], geometry), final_state
    if hands_on is None:
        return outputs
    return outputs, {name: by_chunk(results[name], geometry) for name in hands_on}


def by_chunk(x: jax.Array, geometry: Geometry) -> jax.Array:
    """A per-chunk output ``[B, H, steps, chunks per step, ...]`` as ``[B, H, chunks, ...]`` (a reshape where the steps hold
    no chunk past the end): what a forward hands its backward, whose steps may hold other counts (``by_step``)."""
    B, H, steps, per_step, *rest = x.shape
    return x.reshape(B, H, steps * per_step, *rest)[:, :, : geometry.num_chunks]


def by_step(x: jax.Array, geometry: Geometry) -> jax.Array:
    """``by_chunk``'s ``[B, H, chunks, ...]`` laid out in ``geometry``'s steps, ``[B, H, steps, chunks per step, ...]``."""
    B, H, chunks, *rest = x.shape
    x = jnp.pad(x, [(0, 0), (0, 0), (0, geometry.grid_chunks - chunks)] + [(0, 0)] * len(rest))
    return x.reshape(B, H, geometry.time_steps, geometry.chunks_per_step, *rest)


@dataclasses.dataclass(frozen=True)
class Work:
    """Matmul flops (2 per multiply-add) and transcendentals (``exp``) of a piece of kernel code.

    Counted op by op from each op's chunk code, per value block, as the kernels run it: a ragged last
    chunk computes whole, as do the chunks of the last grid step past the end, and ``scores`` is
    recomputed for every value block. Elementwise arithmetic is left out: it is small beside the
    matmuls and runs on other units.
    """

    flops: int = 0
    transcendentals: int = 0

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.transcendentals + other.transcendentals)

    def __mul__(self, times: int) -> Work:
        return Work(self.flops * times, self.transcendentals * times)


def chunks_of_the_grid(geometry: Geometry) -> int:
    """How many times a grid runs the chunk body: every chunk of every (batch, head, value block)."""
    return geometry.batch * geometry.heads * geometry.value_tiles * geometry.grid_chunks


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One chunk of a grid step: where its rows sit in the step's blocks, and how many are real tokens."""

    index: int  # within the step
    rows: pl.Slice
    valid_rows: jax.Array | None  # None when the chunk is whole in every step (``Geometry.first_short_chunk``)

    def _row_is_real(self) -> jax.Array:
        return lax.broadcasted_iota(jnp.int32, (self.rows.size, 1), 0) < self.valid_rows

    def read(self, ref) -> jax.Array:
        """The chunk's rows of a token block, rows past the end of the sequence as exact zeros.

        Those rows of a ragged block hold unspecified values (NaN in the interpreters), and NaN * 0
        is NaN, so they are replaced with ``where`` before any arithmetic touches them.
        """
        return self.zero_past_end(ref[self.rows, :])

    def zero_past_end(self, x: jax.Array) -> jax.Array:
        """``x`` (a value with a row per token of the chunk) with its rows past the end of the sequence exact zeros."""
        if self.valid_rows is None:
            return x
        return jnp.where(self._row_is_real(), x, jnp.zeros((), x.dtype))

    def head_column(self, ref, head: jax.Array) -> jax.Array:
        """Head ``head``'s column of an all-heads block (``blocks.per_head``) as float32 ``(C, 1)``, rows past the end zero."""
        return self._head_of(ref[self.rows, :], head, head_axis=1)

    def head_row(self, ref, head: jax.Array) -> jax.Array:
        """Head ``head``'s row of an all-heads block laid out ``[H, tokens]`` (``blocks.gate_rows``) as float32 ``(1, C)``,
        tokens past the end zero."""
        return self._head_of(ref[:, self.rows], head, head_axis=0)

    def _head_of(self, every_head: jax.Array, head: jax.Array, head_axis: int) -> jax.Array:
        take = lax.broadcasted_iota(jnp.int32, every_head.shape, head_axis) == head
        if self.valid_rows is not None:
            tokens = list(every_head.shape)
            tokens[head_axis] = 1
            take = take & (lax.broadcasted_iota(jnp.int32, tuple(tokens), 1 - head_axis) < self.valid_rows)
        # One selected term per token, so the sum over heads is exact.
        return jnp.sum(jnp.where(take, every_head, jnp.zeros((), every_head.dtype)).astype(_F32), axis=head_axis, keepdims=True)


def step_chunks(geometry: Geometry, step: jax.Array) -> list[Chunk]:
    """The chunks of grid step ``step`` in order, for a kernel to unroll.

    Unrolled, the chunks of a step are one block of straight-line code, so the scheduler overlaps
    each chunk's attention (which does not depend on the state) with the previous chunk's state
    update instead of running one chunk's chain after the other. Every chunk runs the same
    operations whatever the step size, so no result depends on ``num_steps``. The chunks from
    ``first_short_chunk`` on may be the sequence's ragged last chunk or past its end (in the last step).
    """
    size, count, short = geometry.chunk_size, geometry.chunks_per_step, geometry.first_short_chunk
    return [
        Chunk(index, pl.ds(index * size, size), geometry.valid_rows(step * count + index) if index >= short else None)
        for index in range(count)
    ]


def start_sequence(refs: dict, step: jax.Array, from_initial_state: bool = True) -> None:
    """Load ``initial_state`` (or zeros; always zeros when not ``from_initial_state``) into the VMEM ``state`` at the
    first time step of each (batch, head, value tile); from a pool (``state_rows`` among the refs), the sequence's
    row by DMA (``SequenceStates``).

    Parallel grid points run on either core in any order, so the scratch never carries anything
    from one (batch, head, value tile) to the next.
    """
    if from_initial_state and "state_rows" in refs:
        states, sequence = _pooled(refs), pl.program_id(0)  # grid indices outside the branch: the interpreter wants them so

        @pl.when(step == 0)
        def _start():
            states.begin()
            refs["state"][...] = states.load("initial_state", sequence, True)

        return
    _start_carry(refs, step, "state", "initial_state" if from_initial_state else None)


def _pooled(refs: dict) -> SequenceStates:
    """This grid point's (sequence, head, value tile) of a pool's states."""
    return SequenceStates(refs, pl.program_id(1), pl.program_id(2), refs["state"].shape[1], refs["state"].shape)


def _start_carry(refs: dict, step, carry: str, source: str | None) -> None:
    """At step 0, set the float32 VMEM scratch ``refs[carry]`` to ``refs[source]``, or to zeros where ``source`` is
    None or not an operand of this kernel."""

    @pl.when(step == 0)
    def _start():
        scratch = refs[carry]
        if source in refs:
            scratch[...] = refs[source][...].astype(_F32)
        else:
            scratch[...] = jnp.zeros(scratch.shape, _F32)


def finish_sequence(refs: dict, step: jax.Array, geometry: Geometry) -> None:
    """Write the state to ``final_state`` (when requested) after the last time step: into the sequence's row of a pool
    by DMA where there is one."""
    if "final_state" not in refs:
        return
    if "state_rows" in refs:
        states, sequence = _pooled(refs), pl.program_id(0)

        @pl.when(step == geometry.time_steps - 1)
        def _finish():
            states.begin()
            states.store("final_state", sequence, refs["state"][...], True)
            states.finish()

        return

    @pl.when(step == geometry.time_steps - 1)
    def _finish():
        refs["final_state"][...] = refs["state"][...]


STATE_BUFFERS = 2
"""VMEM buffers per per-sequence state array that copies stay in flight through (``state_buffers``): one sequence's copy
moves while the kernel works with another's. One more buffer, the spare, takes the copies waited on where they start
(a load nothing read ahead); no copy is ever in flight through it."""

READ_ARRAYS = ("initial_state", "dht")
"""The per-sequence arrays a kernel reads (copied into VMEM); the others (``final_state``, ``dinitial_state``) it writes."""


def state_buffers(name: str, shape: tuple[int, int], dtype, keep_in_flight: bool = True) -> tuple[Scratch, DmaSemaphores, ScalarScratch]:
    """The scratch through which a kernel moves the regions of the per-sequence array ``name`` (``SequenceStates``):
    VMEM buffers of ``shape`` that copies stay in flight through (``STATE_BUFFERS``, and the spare for an array the
    kernel reads), a DMA semaphore each, and in SMEM the sequence whose copy is in flight through each of them (-1:
    none). Without ``keep_in_flight`` (a grid point that moves one sequence's region, loaded at its first step and
    stored after its last: an unpacked call's pool rows), a read array gets the spare alone and a written one a buffer."""
    in_flight = STATE_BUFFERS if keep_in_flight else int(name not in READ_ARRAYS)
    buffers = in_flight + (name in READ_ARRAYS)
    return (
        Scratch(f"{name}_buffers", (buffers, *shape), dtype), DmaSemaphores(f"{name}_copies", buffers),
        ScalarScratch(f"{name}_in_flight", (max(in_flight, 1),), jnp.int32),
    )


@dataclasses.dataclass(frozen=True)
class SequenceStates:
    """The per-sequence state arrays ``[N, H, K_pad, V_pad]`` a grid point (head, value block) moves by DMA, one region at a time.

    A kernel touches a region only at a sequence's start or end, never from a block index map:
    the boundaries are traced, and a region of every sequence per grid step would be most of the traffic.
    With ``state_rows`` among the refs (a pool call), the states are a pool and sequence ``n``'s region is
    in row ``state_rows[n]``; a negative row is a padding slot, which loads zeros and stores nothing.

    Copies overlap the kernel's work (``state_buffers``). A store starts its copy through buffer ``n % 2`` and is waited
    on only when that buffer is needed again. With ``read_ahead`` (the order a kernel loads its sequences' states in:
    1 ascending, a kernel that walks forward in time; -1 descending, a backward), a load starts copying the next
    sequence's region in that order through its buffer, unless it is empty, and that sequence's load waits for it
    there; any other load copies through the spare buffer and waits at once. The
    copies may stay in flight from one grid step to the next of the same (head, value block): a kernel calls ``begin``
    before its first load or store at the first time step and ``finish`` after its last at the last.
    """

    refs: dict
    head: jax.Array
    block: jax.Array
    value_block: int
    shape: tuple[int, int]  # (K_pad, value block)
    read_ahead: int = 0  # 1, -1: the order of the loads (ascending, descending sequences); 0: none

    def has(self, name: str) -> bool:
        """Whether the call has the state array ``name``."""
        return name in self.refs

    @property
    def pooled(self) -> bool:
        return "state_rows" in self.refs

    def begin(self, when: jax.Array | bool = True) -> None:
        """Mark every buffer free (``when``): SMEM scratch holds whatever the core's last grid point left."""

        @pl.when(when)
        def _begin():
            for name in self._moved():
                for slot in range(self._in_flight(name)):
                    self.refs[f"{name}_in_flight"][slot] = -1

    def finish(self, when: jax.Array | bool = True) -> None:
        """Wait for every copy still in flight (``when``): none outlives the grid points of its (head, value block)."""

        @pl.when(when)
        def _finish():
            for name in self._moved():
                for slot in range(self._in_flight(name)):
                    sequence = self.refs[f"{name}_in_flight"][slot]
                    self._wait(name, slot, sequence, sequence >= 0)

    def load(self, name: str, sequence: jax.Array, when: jax.Array, read_ahead: int | None = None) -> jax.Array:
        """``refs[name][sequence]`` as float32 (copied into VMEM only ``when``), or zeros where not ``when``, when the call
        has no ``name`` or when the sequence is a padding slot. ``read_ahead``: this load's, where not the kernel's
        (0 for a sequence loaded again, whose successor its first load read ahead)."""
        if not self.has(name):
            return jnp.zeros(self.shape, _F32)
        in_flight, row = self._in_flight(name), self._row(sequence)
        spare, slot = in_flight, sequence % max(in_flight, 1)
        copied = when & (row >= 0) if self.pooled else when
        arrived = jnp.asarray(False)  # no buffer a copy stays in flight through: every load through the spare
        if in_flight:
            arrived = copied & (self.refs[f"{name}_in_flight"][slot] == sequence)
            self._wait(name, slot, sequence, arrived)

        @pl.when(copied & ~arrived)
        def _copy_now():
            dma = self._dma(name, spare, sequence)
            dma.start()
            dma.wait()

        # Where not copied, read the spare buffer: no copy is in flight through it.
        buffer = self.refs[f"{name}_buffers"][jnp.where(arrived, slot, spare)]
        loaded = jnp.where(copied, buffer.astype(_F32), 0.0)
        read_ahead = self.read_ahead if read_ahead is None else read_ahead
        if read_ahead:
            self._read_ahead(name, sequence + read_ahead, copied)
        return loaded

    def store(self, name: str, sequence: jax.Array, value: jax.Array, when: jax.Array) -> None:
        """Start writing ``value`` to ``refs[name][sequence]``, only ``when`` (nothing when the call has no ``name`` or the
        sequence is a padding slot)."""
        if not self.has(name):
            return
        row, slot = self._row(sequence), sequence % self._in_flight(name)
        stored = when & (row >= 0) if self.pooled else when
        in_flight = self.refs[f"{name}_in_flight"]
        going = in_flight[slot]
        self._wait(name, slot, going, stored & (going >= 0))

        @pl.when(stored)
        def _store():
            buffers = self.refs[f"{name}_buffers"]
            buffers[slot] = value.astype(buffers.dtype)
            self._dma(name, slot, sequence).start()
            in_flight[slot] = sequence

    def _read_ahead(self, name: str, sequence: jax.Array, when: jax.Array) -> None:
        """Start copying ``sequence``'s region through its buffer (``when``), unless it is not a sequence of the call, empty
        (no load waits for it), a padding slot or already on its way."""
        cu_seqlens = self.refs["cu_seqlens"]
        count = cu_seqlens.shape[0] - 1
        in_range = (sequence >= 0) & (sequence < count)
        sequence = jnp.clip(sequence, 0, count - 1)  # SMEM reads stay in bounds; in_range says whether it counts
        slot = sequence % self._in_flight(name)
        in_flight = self.refs[f"{name}_in_flight"]
        coming = in_flight[slot]
        start = when & in_range & (cu_seqlens[sequence + 1] > cu_seqlens[sequence]) & (coming != sequence)
        start = start & (self._row(sequence) >= 0) if self.pooled else start
        self._wait(name, slot, coming, start & (coming >= 0))  # one no load took (loads in the order read ahead: none)

        @pl.when(start)
        def _start():
            self._dma(name, slot, sequence).start()
            in_flight[slot] = sequence

    def _wait(self, name: str, slot, sequence: jax.Array, when: jax.Array) -> None:
        """Wait (``when``) for the copy of ``sequence`` in flight through buffer ``slot``, and mark the buffer free."""

        @pl.when(when)
        def _wait():
            self._dma(name, slot, sequence).wait()
            self.refs[f"{name}_in_flight"][slot] = -1

    def _dma(self, name: str, slot, sequence: jax.Array):
        """The copy of ``sequence``'s region of ``name`` through buffer ``slot``: into VMEM for an array the kernel reads."""
        region, buffer = self._region(name, self._row(sequence)), self.refs[f"{name}_buffers"].at[slot]
        source, destination = (region, buffer) if name in READ_ARRAYS else (buffer, region)
        return pltpu.make_async_copy(source, destination, self.refs[f"{name}_copies"].at[slot])

    def _in_flight(self, name: str) -> int:
        """How many of ``name``'s buffers copies stay in flight through (``state_buffers``): all but a read array's spare."""
        return self.refs[f"{name}_buffers"].shape[0] - (name in READ_ARRAYS)

    def _moved(self) -> list[str]:
        """The state arrays this kernel moves through ``state_buffers``."""
        return [name.removesuffix("_in_flight") for name in self.refs if name.endswith("_in_flight")]

    def _row(self, sequence: jax.Array) -> jax.Array:
        return self.refs["state_rows"][sequence] if self.pooled else sequence

    def _region(self, name: str, row: jax.Array):
        Vb = self.value_block
        return self.refs[name].at[row, self.head, :, pl.ds(pl.multiple_of(self.block * Vb, Vb), Vb)]


def sequence_states(name: str, geometry: Geometry, num_seqs: int, dtype, moves: int = 1, pool_rows: int | None = None) -> InHbm:
    """A per-sequence state ``[N, H, K_pad, V_pad]`` (``initial_state``, ``final_state`` or their gradients), moved one
    (sequence, head, value block) at a time by DMA, each region at most ``moves`` times; with ``pool_rows``, a state
    pool ``[P, H, K, V]`` of which the sequences reach their rows (``state_rows``; never lane-padded)."""
    g = geometry
    if pool_rows is not None:
        return InHbm(name, (pool_rows, g.heads, g.key_dim, g.value_dim), dtype, moves=moves, rows=num_seqs)
    relayout = Relayout((num_seqs, g.heads, g.key_dim, g.value_dim), dtype) if g.pads_state else None
    return InHbm(name, (num_seqs, g.heads, g.padded_key_dim, g.padded_value_dim), dtype, relayout, moves)


def state_rows(num_seqs: int) -> Scalars:
    """A pool call's SMEM scalars: each sequence's row of the pool, negative for a padding slot (``grid.SequenceStates``)."""
    return Scalars("state_rows", (num_seqs,), jnp.int32)


def serves_pool_in_place(key_dim: int, value_dim: int) -> bool:
    """Whether a forward reads and writes a pool's rows in place: when its states need no lane padding (a padded
    copy of the pool would move more than the rows it holds; the rows are gathered instead, ``pool_states``)."""
    return key_dim % LANES == 0 and value_dim % LANES == 0


def pool_aliases(pool_rows: int | None, output_final_state: bool) -> tuple[tuple[str, str], ...]:
    """A pool call's final states are the pool itself, updated in place: ``initial_state`` aliases ``final_state``."""
    return (("initial_state", "final_state"),) if pool_rows is not None and output_final_state else ()


def pool_states(forward, *args, initial_state, output_final_state, ssm_state_indices, **kwargs):
    """``forward(*args, ...)`` of a kernel for a call that may name pool rows (``ssm_state_indices``): passed on
    when the kernel reads and writes them in place (``serves_pool_in_place``), else run on the gathered rows and
    written back (``tops_core.ops.pool``), as the core does for an implementation that does not serve pools."""
    K, V = initial_state.shape[2:] if initial_state is not None else (0, 0)
    if ssm_state_indices is None or serves_pool_in_place(K, V):
        return forward(*args, initial_state=initial_state, output_final_state=output_final_state,
                       ssm_state_indices=ssm_state_indices, **kwargs)
    o, final_states = forward(*args, initial_state=pool.rows(initial_state, ssm_state_indices),
                              output_final_state=output_final_state, ssm_state_indices=None, **kwargs)
    return o, None if final_states is None else pool.written(initial_state, ssm_state_indices, final_states)


# -- the reverse walk every backward on this grid takes ------------------------------------------------


def backward_geometry(geometry: Geometry) -> Geometry:
    """``geometry`` with one value block of the whole ``V_pad``: the grid ``(batch, head, 1, time step)``."""
    return dataclasses.replace(geometry, full_values=True)


def reversed_in_time(operand: Blocked, geometry: Geometry) -> Blocked:
    """The operand walked from the last time step to the first (an index map ``t -> steps - 1 - t``, no copy)."""
    last = geometry.time_steps - 1

    def index_map(b, h, tile, t, *scalars):
        return operand.index_map(b, h, tile, last - t, *scalars)

    return dataclasses.replace(operand, index_map=index_map)


def state_checkpoints(geometry: Geometry) -> Blocked:
    """The float32 forward state entering every chunk, ``[B, H, steps, chunks per step, K_pad, V_pad]``."""
    g = geometry
    per_step = g.chunks_per_step

    def step_states(b, h, tile, t, *_):
        return (b, h, t, 0, 0, 0)

    return Blocked(
        "checkpoints", (g.batch, g.heads, g.time_steps, per_step, g.padded_key_dim, g.padded_value_dim), _F32,
        (None, None, None, per_step, g.padded_key_dim, g.padded_value_dim), step_states,
    )


def chunk_inverses(geometry: Geometry, dtype) -> Blocked:
    """Each chunk's ``(I + diag(beta) Akk)^-1`` as the delta rule's forward kernel computes it, ``[B, HV, steps, chunks per
    step, C, C]``, in the dtype its products round it to (``mxu_operand_dtype``: bf16 for bf16 inputs, so nothing is lost):
    the gradients kernel reads it (``kda.chunkwise.inverses_of``'s ``known``) rather than recomputing it, ``2 C`` or
    ``4 C`` bytes per token."""
    g, C = geometry, geometry.chunk_size

    def step_inverses(b, h, tile, t, *_):
        return (b, h, t, 0, 0, 0)

    return Blocked(
        "inverses", (g.batch, g.heads, g.time_steps, g.chunks_per_step, C, C), mxu_operand_dtype(dtype),
        (None, None, None, g.chunks_per_step, C, C), step_inverses,
    )


def walks_every_chunk(recurrence: Recurrence, geometry: Geometry, packed: bool) -> bool:
    """Whether the backward's first walk writes the state entering every chunk (and with the delta rule its inverse), or
    else the state leaving every segment (grid step) but the last, the gradients kernel walking each segment's chunks
    for their states from it, as simple_gla's fused backward does: no walk at all where one segment is the sequence.

    Per chunk with the delta rule over more than one segment, or packed: the walk then hands on the inverses, which the
    gradients kernel would compute again where it walks the states itself. Modelled at the bench's shape (B=2 H=8
    K=V=128 bf16), the backward's kernels against the floor, walking every chunk -> walking the segments: gla any gates
    v6e 3.74x -> 3.23x, v5e (four segments) 3.12x -> 2.82x; gated_delta_rule v6e (one segment) 6.40x -> 5.71x, but v5e
    (two segments of 2048) 4.64x -> 5.08x; packed gla (16 sequences, T=8192, v6e) 3.85x -> 3.57x, its sequences'
    initial states entering the gradients kernel's walk as they enter its VJPs (``PackedChunk.entering``, once for
    both). Per chunk for kda always: its per-key inverse's levels in the gradients kernel outgrow VMEM (v6e, K = V = 256
    float32, T=1000: Mosaic asked for 132 MiB of 128), though at K = V = 128 one segment gained (T=2048 on v6e, 7.66x
    -> 6.69x)."""
    return recurrence.delta_rule and (recurrence.gate_per_key or packed or geometry.time_steps > 1)


def handed_on(recurrence: Recurrence, geometry: Geometry, packed: bool) -> tuple[str, ...]:
    """What the forward of a call at ``geometry`` (the backward's, ``backward=True``) hands its backward, by the names of
    the backward's inputs (``plans``' ``handed_on``): where the backward walks every chunk, the states entering them
    and their inverses, and it walks no chunk; where one segment is the sequence, the inverses, and the gradients
    kernel walks the states itself. Nothing without the delta rule, whose chunks have no inverse to spare.
    Modelled at the bench's shape (B=2 T=4096 H=8 K=V=128 bf16, v6e; 2026-12-08), the backward's kernels
    against the floor: gated_delta_rule 5.02x -> 4.17x, kda 7.37x -> 5.57x (plugin README, "The forward's residuals")."""
    if not recurrence.delta_rule:
        return ()
    return ("checkpoints", "inverses") if walks_every_chunk(recurrence, geometry, packed) else ("inverses",)


def segment_ends(geometry: Geometry) -> Blocked:
    """The float32 forward state leaving every time step but the last (the state entering each later one),
    ``[B, H, steps - 1, K_pad, V_pad]``: the fused backward's checkpoints (``simple_gla.backward_fused``)."""
    g = geometry

    def step_state(b, h, tile, t, *_):
        return (b, h, t, 0, 0)

    return Blocked(
        "segment_ends", (g.batch, g.heads, g.time_steps - 1, g.padded_key_dim, g.padded_value_dim), _F32,
        (None, None, None, g.padded_key_dim, g.padded_value_dim), step_state,
    )


def segments_but_the_last(geometry: Geometry) -> Geometry:
    """``geometry`` cut to its time steps but the last: what a walk writing ``segment_ends`` walks (the last step's keys and
    values reach no state a reverse walk reads). ``geometry`` has more than one step."""
    return dataclasses.replace(geometry, seq_len=(geometry.time_steps - 1) * geometry.rows_per_step, num_steps=geometry.chunks_per_step)


def entering_segment(geometry: Geometry) -> Blocked:
    """``segment_ends`` as a reverse walk reads them at segment ``s``: the state leaving segment ``s - 1``. The first
    segment starts from the initial state (or zeros) instead (``segment_entering_state``); it maps to the block the
    second one read, which is then not fetched again."""
    ends = segment_ends(geometry)

    def index_map(b, h, tile, segment, *scalars):
        return ends.index_map(b, h, tile, _previous(segment), *scalars)

    return dataclasses.replace(ends, index_map=index_map)


def _previous(index):
    """``max(index - 1, 0)`` of a grid index: NumPy's on the traffic model's points, else jax's."""
    return np.maximum(index - 1, 0) if isinstance(index, np.ndarray) else jnp.maximum(index - 1, 0)


def segment_entering_state(refs: dict, segment, shape: tuple[int, int], from_initial_state: bool = True) -> jax.Array:
    """The float32 state ``shape`` entering ``segment``: the initial state (or zeros; always zeros when not
    ``from_initial_state``, a packed call's, whose initial states enter per sequence) at the first, else the walk's
    ``segment_ends`` (``entering_segment``), where there is a walk."""
    given = from_initial_state and "initial_state" in refs
    start = refs["initial_state"][...].astype(_F32) if given else jnp.zeros(shape, _F32)
    if "segment_ends" not in refs:
        return start
    return jnp.where(segment == 0, start, refs["segment_ends"][...])


def state_gradient(geometry: Geometry) -> Scratch:
    """The float32 gradient of the state, carried along the reverse time axis in VMEM only."""
    return Scratch("dstate", (geometry.padded_key_dim, geometry.padded_value_dim), _F32)


def start_state_gradient(refs: dict, step, from_final_state: bool = True) -> None:
    """Set the VMEM ``dstate`` to ``dht`` (or zeros; always zeros when not ``from_final_state``) at the first reverse
    step of each (batch, head).

    Parallel grid points run on either core in any order, so nothing carries over from the previous (batch, head).
    """

    _start_carry(refs, step, "dstate", "dht" if from_final_state else None)


def finish_state_gradient(refs: dict, step, geometry: Geometry) -> None:
    """Write ``dstate`` to ``dinitial_state`` (when it is an output) after the last reverse step."""
    if "dinitial_state" not in refs:
        return

    @pl.when(step == geometry.time_steps - 1)
    def _finish():
        refs["dinitial_state"][...] = refs["dstate"][...].astype(refs["dinitial_state"].dtype)
