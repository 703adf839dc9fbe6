"""The cost model's figures (``tops_core.tpu.model``) for the forward and the backward of each Pallas kernel.

``tops bench``'s modelled section at the issue's sizes, B=8, H=16, K=V=128, bf16, ``g_gamma``, for
T = 4096 and 32768 on compile-only v5e and v6e devices: each kernel's forward, and the backward of
those that have their own, against their floors. Run from the repository root:

    python -m benchmarks.backward_tpu_model
"""

from __future__ import annotations

from tops_core import bench
from tops_core.tpu import compile_only, model as tpu_model

B, H, K, V = 8, 16, 128, 128


def main() -> None:
    with compile_only.DumpingCompiler() as compiler:
        for generation in ("v5e", "v6e"):
            for seq_len in (4096, 32768):
                case = bench.workload("simple_gla", (B, seq_len, H, K, V), "bfloat16", ["g_gamma"])
                print("\n" + tpu_model.format_model(tpu_model.model(case, generation, compiler=compiler)))


if __name__ == "__main__":
    main()
