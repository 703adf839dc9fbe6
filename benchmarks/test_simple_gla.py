"""simple_gla implementations side by side: one pytest-benchmark group per workload and direction.

    pytest benchmarks/test_simple_gla.py --benchmark-only
    TOPS_INTERPRET=1 pytest benchmarks/test_simple_gla.py --benchmark-only   # also Pallas kernels, interpreted

Every registered implementation that supports a workload on this machine is timed jitted, after
a warm-up call; the float64 reference only where its stored states fit (small workloads).
"""

import pytest

from tops_core import bench, op
from tops_core.ops.base import platform_of

DTYPE = bench.default_dtype(platform_of([]))
WORKLOADS = {
    "B2-T4096-H8-K128-V128-g_gamma": bench.workload("simple_gla", (2, 4096, 8, 128, 128), DTYPE, ["g_gamma"]),
    "B1-T8192-H4-K64-V64-g-h0-final": bench.workload(
        "simple_gla", (1, 8192, 4, 64, 64), DTYPE, ["g", "initial_state", "output_final_state"]),
    "varlen-8seqs-T4096-H8-K128-V128-g_gamma": bench.workload(
        "simple_gla", (1, 4096, 8, 128, 128), DTYPE, ["g_gamma", "cu_seqlens"], num_seqs=8),
    "small-B1-T512-H4-K64-V64-g_gamma": bench.workload("simple_gla", (1, 512, 4, 64, 64), DTYPE, ["g_gamma"]),
}
IMPLEMENTATIONS = sorted(impl.name for impl in op("simple_gla").implementations())


@pytest.mark.parametrize("direction", ["forward", "forward+backward"])
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_simple_gla(side_by_side, workload, name, direction):
    side_by_side(WORKLOADS[workload], name, direction, group=f"{workload} {direction}")
