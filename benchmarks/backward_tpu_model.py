"""The cost model's figures (``tops_core.tpu_model``) for the forward and the forward+backward of each Pallas kernel.

``tops bench``'s modelled section compiles the forward only; this compiles ``jax.vjp`` through the
op too, for compile-only v5e and v6e devices, and models every Mosaic kernel of both programs the
same way (HBM, issue and MXU time, the largest binds). Run from the repository root:

    python -m benchmarks.backward_tpu_model

Kernel times only: the copies XLA puts around the op when ``q``, ``k``, ``v`` are the program's
parameters vanish in a layer (plugin README, "The layout around the kernels").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import tops_core
from tops_core import compile_only
from tops_core.tpu_generations import GENERATIONS
from tops_core.tpu_model import _kernel

B, H, K, V = 8, 16, 128, 128
FLOOR = {"forward": 4 * 128 * 2, "backward": 7 * 128 * 2}  # bytes per token and head: read q, k, v (, do), write o (dq, dk, dv)


def program(implementation: str, seq_len: int, backward: bool):
    """``DumpingCompiler``'s factory: the op with ``g_gamma`` forced to ``implementation``, forward or forward+backward."""
    tokens, values = jax.ShapeDtypeStruct((B, seq_len, H, K), jnp.bfloat16), jax.ShapeDtypeStruct((B, seq_len, H, V), jnp.bfloat16)
    decays = jax.ShapeDtypeStruct((H,), jnp.float32)

    def forward(q, k, v, g_gamma):
        return tops_core.op("simple_gla").forward(q, k, v, g_gamma=g_gamma, implementation=implementation)[0]

    if not backward:
        return forward, tokens, tokens, values, decays

    def training(q, k, v, g_gamma, do):
        o, vjp = jax.vjp(forward, q, k, v, g_gamma)
        return o, vjp(do)

    return training, tokens, tokens, values, decays, values


def main() -> None:
    with compile_only.DumpingCompiler() as compiler:
        for generation in ("v5e", "v6e"):
            tpu = GENERATIONS[generation]
            for seq_len in (4096, 32768):
                tokens = B * seq_len * H
                floors = {name: tokens * size / tpu.hbm_bytes_per_second for name, size in FLOOR.items()}
                print(f"\n{generation} B={B} T={seq_len} H={H} K=V=128 bf16 g_gamma: floor forward {floors['forward'] * 1e3:.3f} ms, backward {floors['backward'] * 1e3:.3f} ms")
                for implementation in ("tpu_pallas.fused", "tpu_pallas.chunk"):
                    seconds = {}
                    for backward in (False, True):
                        try:
                            dumped = compiler.compile(generation, "benchmarks.backward_tpu_model:program", implementation=implementation, seq_len=seq_len, backward=backward)
                        except RuntimeError as error:
                            print(f"  {implementation}: does not compile ({str(error).splitlines()[-1][:160]})")
                            break
                        share = dumped.cores / tpu.tensorcores
                        costs = dict(dumped.facts.kernel_costs)
                        kernels = [
                            _kernel(tpu, kernel, costs[kernel.name].bytes_accessed, tpu.hbm_bytes_per_second * share, tpu.peak_bf16_flops * share, dumped.cores)
                            for kernel in dumped.kernels
                        ]
                        seconds[backward] = sum(kernel.seconds for kernel in kernels)
                        if backward:
                            for kernel in kernels:
                                print(
                                    f"    {kernel.name:<50}{kernel.hbm_bytes / tokens:>6.0f} B/token  HBM {kernel.hbm_seconds * 1e3:.3f}  issue "
                                    f"{kernel.issue_seconds * 1e3:.3f}  MXU {kernel.mxu_seconds * 1e3:.3f} ms: {kernel.describe_limit()}"
                                )
                    else:
                        backward_seconds = seconds[True] - seconds[False]
                        print(
                            f"  {implementation}: forward {seconds[False] * 1e3:.3f} ms ({seconds[False] / floors['forward']:.2f}x), "
                            f"forward+backward {seconds[True] * 1e3:.3f} ms, backward {backward_seconds * 1e3:.3f} ms ({backward_seconds / floors['backward']:.2f}x)"
                        )


if __name__ == "__main__":
    main()
