"""What the side-by-side benchmark modules share."""

import jax
import pytest

from tops_core import bench, op
from tops_core.conformance.cases import Case
from tops_core.ops.base import platform_of
from tops_core.policy import current_policy

PLATFORM = platform_of([])


@pytest.fixture
def side_by_side(benchmark):
    """``run(case, name, direction, group)``: time implementation ``name`` on ``case`` jitted, in
    ``direction`` (``"forward"`` or ``"forward+backward"``), after a warm-up call, in the
    pytest-benchmark group ``group``. Skips when it does not support the case on this machine, or
    when it is the float64 reference and the case is too large for its host sweep."""

    def run(case: Case, name: str, direction: str, group: str):
        impl = next(impl for impl in op(case.op).implementations() if impl.name == name)
        reasons = impl.reasons(case.spec(PLATFORM, current_policy(case.op).interpret), "forward")
        if reasons:
            pytest.skip("; ".join(reasons))
        if name == bench.REFERENCE and bench.elements(case) > bench.REFERENCE_MAX_ELEMENTS:
            pytest.skip("the float64 reference sweeps token by token on the host; too slow here")
        forward, forward_backward, forward_args, forward_backward_args = bench.programs(case, name)
        program, args = (forward, forward_args) if direction == "forward" else (forward_backward, forward_backward_args)
        benchmark.group = group
        jax.block_until_ready(program(*args))
        benchmark(lambda: jax.block_until_ready(program(*args)))

    return run
