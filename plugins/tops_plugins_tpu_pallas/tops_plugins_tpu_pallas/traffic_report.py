"""Print the traffic and VMEM figures of the simple_gla kernels, forward and backward, and of kda's forward, for the benchmark shape.

    python -m tops_plugins_tpu_pallas.traffic_report
"""

from __future__ import annotations

import jax.numpy as jnp
from tops_core.tpu.generations import UNKNOWN_CHIP_VMEM_BUDGET

from tops_plugins_tpu_pallas import grid, kda, launch
from tops_plugins_tpu_pallas.simple_gla import backward_fused, backward_split, backward_varlen, chunk, fused, varlen
from tops_plugins_tpu_pallas.layout import Geometry
from tops_plugins_tpu_pallas.traffic import figures

B, T, H = 8, 4096, 16
HEAD_DIMS = (128, 100)  # the benchmark's, then one that needs the lane padding copy
PACKED_T, PACKED_NUM_SEQS = 8192, (1, 16, 256)  # tpu_pallas.varlen: one packed row


def _floor(head_dim: int) -> int:
    """Bytes per token and head that any implementation moves: read q, k, v and write o, bf16."""
    return 4 * head_dim * 2


def main() -> None:
    print(f"simple_gla forward, B={B} T={T} H={H} bfloat16 with g_gamma (no g, no initial/final state)")
    print("bytes per token and head; end to end = kernel + relayout copies around it")
    for head_dim in HEAD_DIMS:
        floor = _floor(head_dim)
        print(f"\nK=V={head_dim}: floor (read q, k, v, write o) {floor} B/token")
        print(f"{'implementation':<32}{'kernel':>9}{'relayout':>10}{'end to end':>12}{'vs floor':>10}{'peak VMEM':>14}")
        defaults = {"fused": fused.resolved(fused.FusedConfig(), head_dim, None), "chunk": chunk.ChunkConfig()}  # on an unknown chip
        for chunk_size in (64, 128):
            for name, module, config in (
                ("fused", fused, fused.FusedConfig(chunk_size=chunk_size)),
                ("chunk", chunk, chunk.ChunkConfig(chunk_size=chunk_size)),
            ):
                geometry = Geometry(B, T, H, head_dim, head_dim, config.chunk_size, config.num_steps)
                f = figures(module.plans(geometry, jnp.bfloat16), B * T * H)
                default = " (default)" if config == defaults[name] else ""
                label = f"tpu_pallas.{name} C={chunk_size}{default}"
                print(
                    f"{label:<32}{f.kernel_per_token:>9.1f}{f.relayout_per_token:>10.1f}{f.end_to_end_per_token:>12.1f}"
                    f"{f.end_to_end_per_token / floor:>9.3f}x{f.peak_vmem / 2**20:>10.2f} MiB"
                )
    _packed()
    _kda()
    print("\nrelayout: the lane padding copies of q, k, v and the slice of o when K or V is not a multiple of 128 (layout.py)")
    print(
        f"peak VMEM: double-buffered blocks and scratch in whole tiles, plus an estimate of the values the "
        f"kernel body holds (the largest launch); sized for an unknown chip's budget, {UNKNOWN_CHIP_VMEM_BUDGET / 2**20:.0f} MiB"
    )


def backward_report() -> None:
    """Both backward kernels at K = V = 128 beside the floor, at T = 4096 and 32768, for a few segment lengths."""
    floor, recomputation = 1792, 512  # read q, k, v, do, write dq, dk, dv; the states' forward walk reads k, v again
    print(f"\nsimple_gla backward, B={B} H={H} K=V=128 bfloat16 with g_gamma; floor {floor} B/token, {floor + recomputation} with the states recomputed")
    print(f"{'implementation':<66}{'T':>7}{'kernel':>9}{'vs floor':>10}{'vs floor+recomp.':>18}{'peak VMEM':>14}")
    for seq_len in (4096, 32768):
        for name, config, chip in (
            ("fused", fused.FusedConfig(), None), ("fused", fused.FusedConfig(), "v6e"), ("fused", fused.FusedConfig(chunk_size=64), None),
            ("fused", fused.FusedConfig(backward_num_steps=8), None), ("fused", fused.FusedConfig(chunk_size=64, backward_num_steps=4), None),
            ("chunk", chunk.ChunkConfig(), None), ("chunk", chunk.ChunkConfig(chunk_size=64), None),
        ):
            if name == "fused":
                geometry = backward_fused.geometry_of(B, seq_len, H, 128, 128, config)
                plans = backward_fused.fitted_plans(geometry, jnp.bfloat16, target=launch.Target.of(chip))
                segment = plans[-1].grid[-1]
                label = (
                    f"fused C={geometry.chunk_size} backward_num_steps={config.backward_num_steps} ({seq_len // segment}-token segments"
                    + (f" on {chip})" if chip else ")")
                )
            else:
                plans = backward_split.plans(backward_split.geometry_of(B, seq_len, H, 128, 128, config), jnp.bfloat16)
                label = f"chunk (split) C={config.chunk_size} num_steps={config.num_steps}"
            f = figures(plans, B * seq_len * H)
            print(
                f"{label:<66}{seq_len:>7}{f.kernel_per_token:>9.1f}{f.kernel_per_token / floor:>9.3f}x"
                f"{f.kernel_per_token / (floor + recomputation):>17.3f}x{f.peak_vmem / 2**20:>10.2f} MiB"
            )


def _kda() -> None:
    """kda's fused forward at K = V = 128: bf16 q, k, v and float32 g, beta; its floor also reads g and beta."""
    head_dim = 128
    floor = 3 * head_dim * 2 + head_dim * 4 + 4 + head_dim * 2
    print(f"\nkda forward, B={B} T={T} H={H} K=V={head_dim}, bfloat16 q, k, v, float32 g and beta, use_qk_l2norm")
    print(f"floor (read q, k, v, g, beta, write o) {floor} B/token")
    print(f"{'implementation':<48}{'kernel':>9}{'relayout':>10}{'end to end':>12}{'vs floor':>10}{'peak VMEM':>14}{'GFLOP':>8}")
    # The chunk left None is the chip's (grid.chunk_size_of): v6e's, and every other chip's.
    defaults = {chip or "other chips": grid.chunk_size_of(kda.fused.KdaFusedConfig(), chip) for chip in ("v6e", None)}
    for chunk_size in (64, 128):
        config = kda.fused.KdaFusedConfig(chunk_size=chunk_size)
        plans = kda.fused.fitted_plans(kda.fused.geometry_of(B, T, H, head_dim, head_dim, config), jnp.bfloat16, use_qk_l2norm=True)
        f = figures(plans, B * T * H)
        chips = [chip for chip, size in defaults.items() if size == chunk_size]
        label = f"tpu_pallas.fused C={chunk_size}" + (f" (default on {', '.join(chips)})" if chips else "")
        print(
            f"{label:<48}{f.kernel_per_token:>9.1f}{f.relayout_per_token:>10.1f}{f.end_to_end_per_token:>12.1f}"
            f"{f.end_to_end_per_token / floor:>9.3f}x{f.peak_vmem / 2**20:>10.2f} MiB{sum(p.flops for p in plans) / 1e9:>8.0f}"
        )


def _packed() -> None:
    config = varlen.VarlenConfig()  # the default config of fused and varlen: chunks of 128, all of V per block
    print(f"\npacked: B=1 T={PACKED_T} H={H} K=V=128 bfloat16, g_gamma, default config (C=128); N sequences in cu_seqlens (bytes per token and head)")
    _packed_table(
        "", grid.geometry_of(1, PACKED_T, H, 128, 128, config), fused.fitted_plans, varlen.fitted_plans,
        "+ states: with initial_state and the final state, N float32 states each way (the caller's data)",
    )
    _packed_table(
        " backward", backward_fused.geometry_of(1, PACKED_T, H, 128, 128, config), backward_fused.fitted_plans, backward_varlen.fitted_plans,
        "+ states: initial_state read up to 3 times (checkpoints, and the gradients kernel twice), dht read, dinitial_state written",
    )


def _packed_table(direction: str, geometry: Geometry, fused_plans, varlen_plans, states_note: str) -> None:
    """varlen's plans at N = 1, 16, 256 beside fused's for one unpacked sequence of the same T, in one direction."""
    tokens = PACKED_T * H
    alone = figures(fused_plans(geometry, jnp.bfloat16), tokens)
    print(f"\n{'implementation':<40}{'kernel':>9}{'vs fused':>12}{'+ states':>10}{'peak VMEM':>14}")
    print(f"{f'tpu_pallas.fused{direction} (unpacked)':<40}{alone.kernel_per_token:>9.2f}{1:>11.6f}x{'':>10}{alone.peak_vmem / 2**20:>10.2f} MiB")
    for num_seqs in PACKED_NUM_SEQS:
        packed = figures(varlen_plans(geometry, jnp.bfloat16, num_seqs), tokens)
        stateful = figures(varlen_plans(geometry, jnp.bfloat16, num_seqs, initial_state_dtype=jnp.float32, output_final_state=True), tokens)
        label = f"tpu_pallas.varlen{direction} N={num_seqs}"
        print(
            f"{label:<40}{packed.kernel_per_token:>9.2f}{packed.kernel_per_token / alone.kernel_per_token:>11.6f}x"
            f"{stateful.kernel_per_token:>10.1f}{stateful.peak_vmem / 2**20:>10.2f} MiB"
        )
    print(states_note)


if __name__ == "__main__":
    main()
    backward_report()
