"""What the side-by-side benchmark modules share."""

import pytest

from tops_core import bench, op
from tops_core.conformance.cases import Case
from tops_core.ops.base import platform_of
from tops_core.policy import current_policy

PLATFORM = platform_of([])


@pytest.fixture
def programs_or_skip():
    """``get(case, name)``: the jitted programs of implementation ``name`` on ``case`` (see
    ``tops_core.bench.programs``), or a skip when it does not support the case on this machine, or
    when it is the float64 reference and the case is too large for its host sweep."""

    def get(case: Case, name: str):
        impl = next(impl for impl in op(case.op).implementations() if impl.name == name)
        reasons = impl.reasons(case.spec(PLATFORM, current_policy(case.op).interpret), "forward")
        if reasons:
            pytest.skip("; ".join(reasons))
        if name == bench.REFERENCE and bench.elements(case) > bench.REFERENCE_MAX_ELEMENTS:
            pytest.skip("the float64 reference sweeps token by token on the host; too slow here")
        return bench.programs(case, name)

    return get
