"""kda implementations side by side: one pytest-benchmark group per workload and direction.

    pytest benchmarks/test_kda.py --benchmark-only

Every registered implementation that supports a workload on this machine is timed jitted, after
a warm-up call; the float64 reference only on small workloads (it sweeps token by token on the host).
"""

import pytest

from tops_core import bench, op
from tops_core.ops.base import platform_of

DTYPE = bench.default_dtype(platform_of([]))
WORKLOADS = {
    "B2-T4096-H8-K128-V128-l2norm": bench.workload("kda", (2, 4096, 8, 128, 128), DTYPE, ["use_qk_l2norm"]),
    "B1-T8192-H4-K64-V64-l2norm-h0-final": bench.workload(
        "kda", (1, 8192, 4, 64, 64), DTYPE, ["use_qk_l2norm", "initial_state", "output_final_state"]),
    "varlen-8seqs-T4096-H8-K128-V128-l2norm": bench.workload(
        "kda", (1, 4096, 8, 128, 128), DTYPE, ["use_qk_l2norm", "cu_seqlens"], num_seqs=8),
    "small-B1-T512-H4-K64-V64-l2norm": bench.workload("kda", (1, 512, 4, 64, 64), DTYPE, ["use_qk_l2norm"]),
}
IMPLEMENTATIONS = sorted(impl.name for impl in op("kda").implementations())


@pytest.mark.parametrize("direction", ["forward", "forward+backward"])
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_kda(side_by_side, workload, name, direction):
    side_by_side(WORKLOADS[workload], name, direction, group=f"{workload} {direction}")
