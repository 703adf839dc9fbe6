"""The conformance suite. Collect it by importing it into a test module of yours
(``from tops_core.testing.suite import *``) or with ``pytest --pyargs tops_core.testing.suite``;
the ``tops_core.testing`` pytest plugin parametrizes it over every selected implementation."""

from tops_core.conformance.checks import check_rejected, run_case

__all__ = ["test_matches_the_reference", "test_rejected_by_the_matcher"]


def test_matches_the_reference(tops_conformance_case, tops_reference, tops_record):
    impl, case = tops_conformance_case
    measurements = run_case(impl, case, tops_reference)
    tops_record(impl, case, measurements)
    print(f"{impl.name} [{case.name}, {case.dtype}]: " + "; ".join(m.describe() for m in measurements))


def test_rejected_by_the_matcher(tops_rejection_case):
    impl, case = tops_rejection_case
    print(f"{impl.name} [{case.name}] rejected: {check_rejected(impl, case)}")
