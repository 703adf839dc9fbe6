"""The traffic and VMEM model: hand-counted plans, and the benchmark figures derived by hand."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
import tops_core
from tops_core.tpu.generations import UNKNOWN_CHIP_VMEM_BUDGET

from tops_plugins_tpu_pallas import grid, kda, traffic
from tops_plugins_tpu_pallas.simple_gla import backward_fused, backward_split, backward_varlen, chunk, fused, varlen
from tops_plugins_tpu_pallas.plan import Blocked, DmaSemaphores, InHbm, LaunchPlan, Relayout, Scalars, Scratch
from tops_plugins_tpu_pallas.layout import Geometry


def _tiny_plan(relayout=None) -> LaunchPlan:
    return LaunchPlan(
        name="tiny",
        grid=(2, 3),
        dimension_semantics=("parallel", "arbitrary"),
        scalars=(Scalars("s", (3,), jnp.int32),),
        inputs=(
            Blocked("x", (2, 24, 128), jnp.float32, (None, 8, 128), lambda i, j, *_: (i, j, 0), relayout),
            Blocked("w", (8, 128), jnp.float32, (8, 128), lambda i, j, *_: (0, 0)),
            Blocked("z", (16, 128), jnp.bfloat16, (8, 128), lambda i, j, *_: (j % 2, 0)),
        ),
        outputs=(Blocked("y", (2, 8, 128), jnp.float32, (None, 8, 128), lambda i, j, *_: (i, 0, 0)),),
        scratch=(Scratch("acc", (3, 100), jnp.float32),),
    )


def test_counts_a_fetch_each_time_a_block_index_changes():
    read, written = traffic.kernel_traffic(_tiny_plan())
    x = 6 * 8 * 128 * 4  # a new block at each of the 6 grid steps
    w = 1 * 8 * 128 * 4  # one block index throughout: fetched once
    # z visits blocks 0, 1, 0 | 0, 1, 0: the step from (0, 2) to (1, 0) keeps block 0, so 5 fetches
    z = 5 * 8 * 128 * 2
    scalars = 3 * 4
    assert read == x + w + z + scalars
    assert written == 2 * 8 * 128 * 4  # y changes block once, and the last block is written at the end


def test_vmem_double_buffers_blocks_in_whole_tiles():
    # x, w, y: (8, 128) float32, one tile each; z: 8 bf16 rows fill half a 16-row tile;
    # the scratch (3, 100) float32 rounds up to one (8, 128) tile and is not double-buffered.
    tile = 8 * 128 * 4
    assert traffic.vmem_bytes(_tiny_plan()) == 2 * (tile + tile + 16 * 128 * 2 + tile) + tile
    # What the kernel body holds is added as the plan declares it.
    assert traffic.vmem_bytes(dataclasses.replace(_tiny_plan(), body_vmem=1000)) == traffic.vmem_bytes(_tiny_plan()) + 1000


def test_relayout_copies_are_counted_once_per_array():
    plan = _tiny_plan(Relayout((2, 20, 100), jnp.bfloat16))
    read, written = traffic.relayout_traffic([plan, plan])
    assert (read, written) == (2 * 20 * 100 * 2, 2 * 24 * 128 * 4)


def test_a_ragged_last_block_moves_only_its_rows_inside_the_array():
    # 20 rows in blocks of 8: blocks 0 and 1 are whole, block 2 holds rows 16..19 and 4 past the end.
    plan = LaunchPlan(
        name="ragged", grid=(3,), dimension_semantics=("arbitrary",), scalars=(),
        inputs=(Blocked("x", (20, 128), jnp.float32, (8, 128), lambda t, *_: (t, 0)),),
        outputs=(Blocked("y", (20, 256), jnp.bfloat16, (8, 128), lambda t, *_: (t, 1)),),
    )
    assert traffic.kernel_traffic(plan) == (20 * 128 * 4, 20 * 128 * 2)


BENCHMARK = (8, 4096, 16, 128, 128)  # B, T, H, K, V
TOKENS = 8 * 4096 * 16


def test_fused_moves_the_floor_end_to_end_at_the_benchmark_shape():
    geometry = Geometry(*BENCHMARK, 64, 4)
    f = traffic.figures(fused.plans(geometry, jnp.bfloat16), TOKENS)
    # q, k, v read and o written once, 128 bf16 lanes each, plus the 16 float32 decays once; the
    # kernel reads the caller's arrays in place, so nothing moves outside it.
    assert f.kernel_bytes == TOKENS * 4 * 128 * 2 + 16 * 4
    assert f.relayout_bytes == 0
    assert f.end_to_end_per_token <= 1.05 * 1024
    assert f.peak_vmem <= UNKNOWN_CHIP_VMEM_BUDGET


def test_chunk_figures_at_the_benchmark_shape():
    geometry = Geometry(*BENCHMARK, 128, 4)
    f = traffic.figures(chunk.plans(geometry, jnp.bfloat16), TOKENS)
    state_per_token = 128 * 128 * 4 / 128  # one float32 state per chunk of 128 tokens
    stage1 = 2 * 128 * 2 + state_per_token  # read k, v; write chunk states
    stage2 = 3 * 128 * 2 + state_per_token + 128 * 2  # read q, k, v, chunk states; write o
    assert f.kernel_per_token == pytest.approx(stage1 + stage2, abs=0.01)
    assert f.relayout_bytes == 0
    assert f.peak_vmem <= UNKNOWN_CHIP_VMEM_BUDGET


BACKWARD_FLOOR = 4 * 128 * 2 + 3 * 128 * 2  # read q, k, v, do and write dq, dk, dv: 1792 B/token
RECOMPUTED_STATES = 2 * 128 * 2  # the forward walk that recomputes the states reads k and v again


@pytest.mark.parametrize("seq_len", [4096, 32768])
@pytest.mark.parametrize(("chunk_size", "backward_num_steps"), [(128, None), (64, None), (64, 4)])
def test_fused_backward_figures_at_the_benchmark_shape(seq_len, chunk_size, backward_num_steps):
    B, _, H, K, V = BENCHMARK
    tokens = B * seq_len * H
    config = fused.FusedConfig(chunk_size=chunk_size, backward_num_steps=backward_num_steps)
    plans = backward_fused.fitted_plans(backward_fused.geometry_of(B, seq_len, H, K, V, config), jnp.bfloat16)
    f = traffic.figures(plans, tokens)
    segments = plans[-1].grid[-1]  # per sequence: as many as the VMEM budget allows
    if backward_num_steps is not None:
        assert segments == seq_len // (chunk_size * backward_num_steps)
    # The walk reads k and v of every segment but the last, and writes the state leaving each, which the gradients
    # kernel reads once: one float32 state per segment but the last.
    recomputed = RECOMPUTED_STATES * (segments - 1) / segments
    checkpoint = 128 * 128 * 4 * (segments - 1) / seq_len
    decay_gradient = 4  # float32 per token, summed into dg_gamma outside
    assert f.kernel_bytes == tokens * (BACKWARD_FLOOR + recomputed + 2 * checkpoint + decay_gradient) + 2 * 16 * 4
    assert f.relayout_bytes == 0
    assert f.peak_vmem <= UNKNOWN_CHIP_VMEM_BUDGET
    if backward_num_steps is None:  # the default segment (SEGMENT_TOKENS, or what fits): within 10% of the floor with recomputation
        assert f.kernel_per_token <= 1.1 * (BACKWARD_FLOOR + RECOMPUTED_STATES)


def test_fused_backward_of_one_segment_has_no_walk():
    # T = 2048, the default segment: the gradients kernel alone moves the floor and the decay gradient, and reads the
    # initial states it starts from itself (and writes their gradient); nothing recomputes a state but the kernel.
    B, T, H, K, V = 8, 2048, 16, 128, 128
    geometry = backward_fused.geometry_of(B, T, H, K, V, fused.FusedConfig())
    (plan,) = backward_fused.fitted_plans(geometry, jnp.bfloat16, initial_state_dtype=jnp.float32)
    states = 2 * B * H * K * V * 4
    assert traffic.figures((plan,), B * T * H).kernel_bytes == B * T * H * (BACKWARD_FLOOR + 4) + states + H * 4


def test_fused_backward_segments_shrink_to_fit_vmem():
    # K = V = 512: 8 chunks of 128 per segment would need more than the budget; fewer chunks fit.
    config = fused.FusedConfig()
    geometry = backward_fused.geometry_of(1, 4096, 1, 512, 512, config)
    assert max(traffic.vmem_bytes(plan) for plan in backward_fused.plans(geometry, jnp.bfloat16)) > UNKNOWN_CHIP_VMEM_BUDGET
    checkpoints, gradients = backward_fused.fitted_plans(geometry, jnp.bfloat16)
    assert max(traffic.vmem_bytes(checkpoints), traffic.vmem_bytes(gradients)) <= UNKNOWN_CHIP_VMEM_BUDGET
    assert gradients.grid[-1] > geometry.time_steps


def test_split_backward_figures_at_the_benchmark_shape():
    geometry = Geometry(*BENCHMARK, 128, 4)
    f = traffic.figures(backward_split.plans(geometry, jnp.bfloat16), TOKENS)
    state = 128 * 128 * 4 / 128  # one float32 state (or state gradient) per chunk of 128 tokens
    states = RECOMPUTED_STATES + state  # read k, v; write the states
    pass1 = 3 * 128 * 2 + 128 * 2 + state  # read q, k, do; write dv and dS
    pass2 = 4 * 128 * 2 + 2 * state + 2 * 128 * 2 + 4  # read q, k, v, do, states, dS; write dq, dk, the decay gradient
    assert f.kernel_per_token == pytest.approx(states + pass1 + pass2, abs=0.01)
    assert f.peak_vmem <= UNKNOWN_CHIP_VMEM_BUDGET


def test_lane_padding_copies_are_counted_end_to_end():
    # K = V = 100 bf16: q, k, v are read at 100 lanes and written at 128, o read at 128 and written
    # at 100; the kernel then moves the padded 128 lanes.
    geometry = Geometry(8, 4096, 16, 100, 100, 64, 4)
    f = traffic.figures(fused.plans(geometry, jnp.bfloat16), TOKENS)
    assert f.relayout_per_token == 4 * (100 + 128) * 2
    assert f.kernel_bytes == TOKENS * 4 * 128 * 2 + 16 * 4
    assert f.end_to_end_bytes == f.kernel_bytes + f.relayout_bytes


def _cost_estimates(implementation: str, B, T, H, K, V, **inputs) -> list[dict[str, int]]:
    """The ``pl.CostEstimate`` of every kernel, as it stands in the public op's program lowered for TPU (no TPU needed)."""
    tokens = jax.ShapeDtypeStruct((B, T, H, K), jnp.bfloat16)
    values = jax.ShapeDtypeStruct((B, T, H, V), jnp.bfloat16)

    def forward(q, k, v, g):
        return tops_core.op("simple_gla").forward(q, k, v, g=g, implementation=implementation)[0]

    gates = jax.ShapeDtypeStruct((B, T, H), jnp.float32) if inputs.get("g") else None
    text = jax.jit(forward).trace(tokens, tokens, values, gates).lower(lowering_platforms=("tpu",)).as_text()
    fields = re.findall(r"cost_estimate\\22: \{(.*?)\}", text)
    return [{name: int(value) for name, value in re.findall(r"\\22(\w+)\\22:(\d+)", f)} for f in fields]


def test_fused_cost_estimate_counts_every_chunk_of_the_grid():
    # B=2, T=200 (2 chunks of 128 at the default config, the last ragged), H=3, K=V=128, with g:
    # 2*3*1*2 = 12 chunk bodies. Per chunk: the g cumsum (128 x 128) @ (128 x 128) (three bf16 parts of
    # g in three lanes), scores (128 x 128) @ (128 x 128), from the state (128 x 128) @ (128 x 128),
    # attention (128 x 128) @ (128 x 128), the state update (128 x 128) @ (128 x 128); exp of 128 x 128
    # decays, 128 output gates, 128 key decays and the chunk's decay (with g, every chunk has its own).
    (estimate,) = _cost_estimates("tpu_pallas.fused", 2, 200, 3, 128, 128, g=True)
    assert estimate["flops"] == 12 * 5 * 2 * 128**3
    assert estimate["transcendentals"] == 12 * (128 * 128 + 128 + 128 + 1)
    # Read q, k, v (bf16) and the 3 decays, write o; g's block holds every head and the 2 chunks are
    # one grid step, so its block index stays put from head to head: g is read once.
    tokens = 2 * 200
    assert estimate["bytes_accessed"] == tokens * 3 * 4 * 128 * 2 + tokens * 3 * 4 + 3 * 4


def test_chunk_cost_estimates_split_the_work_between_its_two_kernels():
    # K=V=256: two value tiles, every block holds the whole K; T=256 is two chunks of 128.
    states, outputs = _cost_estimates("tpu_pallas.chunk", 1, 256, 2, 256, 256)
    bodies = 1 * 2 * 2 * 2  # B * H * value tiles * chunks
    assert states["flops"] == bodies * 2 * 256 * 128 * 128  # the state update, (256 x 128) @ (128 x 128)
    assert outputs["flops"] == bodies * (2 * 128 * 256 * 128 + 2 * 128 * 256 * 128 + 2 * 128 * 128 * 128)
    # A constant decay's gates are computed once per grid step (B * H * value tiles = 4 steps of both
    # chunks): 128 query and 128 key decays and the chunk's decay, and for the outputs' attention
    # the 128 x 128 decays, which the states kernel leaves out.
    assert states["transcendentals"] == 4 * (128 + 128 + 1)
    assert outputs["transcendentals"] == 4 * (128 * 128 + 128 + 128 + 1)


def test_arrays_the_kernel_copies_itself_count_once_and_take_no_vmem_blocks():
    plan = dataclasses.replace(
        _tiny_plan(),
        inputs=(*_tiny_plan().inputs, InHbm("h0", (5, 8, 128), jnp.float32)),
        outputs=(*_tiny_plan().outputs, InHbm("ht", (5, 8, 128), jnp.float32)),
        scratch=(*_tiny_plan().scratch, DmaSemaphores("copies", 2)),
    )
    blocked_read, blocked_written = traffic.kernel_traffic(_tiny_plan())
    assert traffic.kernel_traffic(plan) == (blocked_read + 5 * 8 * 128 * 4, blocked_written + 5 * 8 * 128 * 4)
    assert traffic.vmem_bytes(plan) == traffic.vmem_bytes(_tiny_plan())


@pytest.mark.parametrize("num_seqs", [1, 16, 256])
def test_varlen_with_states_moves_what_fused_moves_on_reset_gates_whatever_the_number_of_sequences(num_seqs):
    # B = 1, T = 8192 packed, H = 16, K = V = 128, bf16: fused's kernel on the float32 reset gates (q, k, v, g read and o
    # written once), plus the scalars in SMEM (the decays, N + 1 boundaries and two sequence numbers per chunk), each
    # head's row of the sequences' first gates, and the states: the caller's data, N of them each way, as fused moves
    # for B = N rows. (Without states a packed call is fused's call on the reset gates, whose plans are fused's.)
    T, H = 8192, 16
    geometry = grid.geometry_of(1, T, H, 128, 128, varlen.VarlenConfig())
    states = dict(initial_state_dtype=jnp.float32, output_final_state=True)
    packed = traffic.figures(varlen.fitted_plans(geometry, jnp.bfloat16, num_seqs, **states), T * H)
    alone = traffic.figures(fused.fitted_plans(geometry, jnp.bfloat16, gate_dtype=jnp.float32), T * H)
    scalars = (num_seqs + 1) * 4 + 2 * (T // 128) * 4
    assert packed.kernel_bytes == alone.kernel_bytes + scalars + H * num_seqs * 4 + 2 * num_seqs * H * 128 * 128 * 4
    assert packed.peak_vmem <= UNKNOWN_CHIP_VMEM_BUDGET


@pytest.mark.parametrize("num_seqs", [1, 16, 256])
def test_varlen_backward_moves_what_the_fused_backward_moves_and_every_chunks_state_whatever_the_number_of_sequences(num_seqs):
    # B = 1, T = 8192 packed, H = 16, K = V = 128, bf16, g_gamma, the default config (its segments): the packed
    # backward's kernels move the fused backward's blocks, the SMEM boundaries (N + 1 of them and two sequence numbers
    # per chunk, each kernel), the state entering every chunk rather than every segment (written by the checkpoints
    # walk, read by the gradients kernel: no state recomputed), and the reset gates along lanes that both kernels read
    # (every head's row of a step, fetched by each head).
    T, H, K, V = 8192, 16, 128, 128
    config = varlen.VarlenConfig()
    geometry = backward_fused.geometry_of(1, T, H, K, V, config)
    plans, fused_plans = backward_varlen.fitted_plans(geometry, jnp.bfloat16, num_seqs), backward_fused.fitted_plans(geometry, jnp.bfloat16)
    packed, alone = traffic.figures(plans, T * H), traffic.figures(fused_plans, T * H)
    # The fused backward checkpoints every segment but the first (its own, which may hold more chunks than the packed
    # one's), and its walk skips the last segment's keys and values, which the packed walk reads.
    chunks, segments = T // config.chunk_size, fused_plans[-1].grid[3]
    scalars = 2 * ((num_seqs + 1) * 4 + 2 * chunks * 4)
    every_chunk = 2 * (chunks - (segments - 1)) * H * K * V * 4
    last_segment = H * (T // segments) * (K + V) * 2
    assert packed.kernel_bytes == alone.kernel_bytes + scalars + every_chunk + last_segment + 2 * H * T * H * 4
    assert packed.peak_vmem <= UNKNOWN_CHIP_VMEM_BUDGET
    # With states: initial_state read by the checkpoints walk and the gradients kernel (once each, where its sequence
    # starts), dht read and dinitial_state written once, float32, N of each; both kernels' first gate of every sequence.
    stateful = traffic.figures(
        backward_varlen.fitted_plans(geometry, jnp.bfloat16, num_seqs, initial_state_dtype=jnp.float32, output_final_state=True), T * H,
    )
    assert stateful.kernel_bytes - packed.kernel_bytes == (1 + 1 + 1 + 1) * num_seqs * H * K * V * 4 + 2 * H * num_seqs * 4


@pytest.mark.parametrize("chunk_size", [64, 128])
def test_kda_fused_is_within_five_percent_of_the_floor_at_the_benchmark_shape(chunk_size):
    # bf16 q, k, v and float32 g, beta: the floor reads q, k, v, g, beta and writes o once,
    # 3 * 128 * 2 + 128 * 4 + 4 + 128 * 2 = 1540 B per token and head. The kernel reads every
    # operand once, but beta's full-width (rows, H) block once per head: 4 * H bytes, not 4.
    config = kda.fused.KdaFusedConfig(chunk_size=chunk_size, num_steps=kda.fused.KdaFusedConfig.TPU_NUM_STEPS)  # lowered for a TPU
    (plan,) = kda.fused.fitted_plans(kda.fused.geometry_of(*BENCHMARK, config), jnp.bfloat16, use_qk_l2norm=True)
    # All of V per block; 16 chunks of 64 per step, but 8 of 128 in an unknown chip's 16 MiB.
    chunks_per_step = {64: 16, 128: 8}[chunk_size]
    assert plan.grid == (8, 16, 1, 4096 // (chunks_per_step * chunk_size))
    f = traffic.figures([plan], TOKENS)
    floor = 3 * 128 * 2 + 128 * 4 + 4 + 128 * 2
    assert f.kernel_bytes == TOKENS * (floor - 4 + 4 * 16)
    assert f.relayout_bytes == 0
    assert f.end_to_end_per_token <= 1.05 * floor
    assert f.peak_vmem <= UNKNOWN_CHIP_VMEM_BUDGET
