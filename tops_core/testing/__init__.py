"""The conformance kit: a pytest plugin that checks implementations against the float64 reference.

Load it with ``-p tops_core.testing`` (installing tops-core also registers it through the
``pytest11`` entry point) and collect the suite, either from a test module of your own::

    from tops_core.testing.suite import *  # noqa: F401,F403

or directly with ``pytest --pyargs tops_core.testing.suite``. Options: ``--tops-impl PATTERN``
(repeatable shell patterns over qualified names, e.g. ``'mykernels.*'``; default: every
registered implementation; ini: ``tops_impls``) and ``--tops-reference NAME``.

For every selected implementation the suite runs the case grid its capabilities declare
(``tops_core.conformance.cases``), forward and every declared gradient, against the reference with
the tolerances of docs/ops.md, and checks that each case outside the declarations is rejected by the
matcher. The reference answers each case once per process, whichever implementations ask. The worst measured
errors are summarised at the end of the run.
"""

from __future__ import annotations

import fnmatch

import pytest

from tops_core.conformance.cases import grid
from tops_core.conformance.checks import REFERENCE, runnable_here

_RESULTS_PROPERTY = "tops_conformance_measurements"
_SKIPPED_PROPERTY = "tops_conformance_not_runnable"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tops", "tops conformance kit")
    group.addoption("--tops-impl", action="append", default=[], metavar="PATTERN",
                    help="check only implementations matching these shell patterns (default: all registered)")
    group.addoption("--tops-reference", default=REFERENCE, metavar="NAME",
                    help="the implementation results are compared with (default: %(default)s)")
    parser.addini("tops_impls", type="args", default=[], help="default --tops-impl patterns")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: the conformance kit's wider breadth (more head dims, aligned and one-token T)")
    config.pluginmanager.register(_Summary(), "tops-conformance-summary")


class _Summary:
    """The end-of-run summary, gathered from the test reports: with pytest-xdist the cases run in
    worker processes and only their reports (with the ``user_properties`` the kit adds) reach the
    process that prints the summary."""

    def __init__(self):
        self.results: list[tuple] = []  # (op, implementation, dtype, case, ((output, error, tolerance), ...))
        self.skipped: dict[tuple[str, str], str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for name, value in report.user_properties:
            if name == _SKIPPED_PROPERTY and report.when == "setup":
                op_name, impl, reason = value
                self.skipped[(op_name, impl)] = reason
            elif name == _RESULTS_PROPERTY and report.when == "call":
                self.results.append(value)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.skipped:
            terminalreporter.section("tops conformance: accuracy not checked on this machine")
            for (op_name, impl), reason in sorted(self.skipped.items()):
                terminalreporter.write_line(f"{op_name} {impl}: {reason}")
        worst: dict[tuple, tuple] = {}
        for op_name, impl, dtype, case_name, measurements in self.results:
            for output, error, tolerance in measurements:
                key = (op_name, impl, dtype, output)
                if key not in worst or error > worst[key][0]:
                    worst[key] = (error, tolerance, case_name)
        if not worst:
            return
        terminalreporter.section("tops conformance: worst relative RMS error against the reference")
        terminalreporter.write_line(f"{'op':<18}{'implementation':<22}{'dtype':<10}{'output':<16}{'error':>10}{'tolerance':>11}  case")
        for (op_name, impl, dtype, output), (error, tolerance, case_name) in sorted(worst.items()):
            terminalreporter.write_line(f"{op_name:<18}{impl:<22}{dtype:<10}{output:<16}{error:>10.2e}{tolerance:>11.0e}  {case_name}")


def selected_implementations(config: pytest.Config) -> list:
    """The registered implementations the patterns select; selecting none is a usage error."""
    from tops_core.registry import default_registry

    patterns = config.getoption("tops_impl") or config.getini("tops_impls") or ["*"]
    registered = default_registry().all_implementations()
    selected = [impl for impl in registered if any(fnmatch.fnmatchcase(impl.name, p) for p in patterns)]
    if not selected:
        names = ", ".join(sorted({impl.name for impl in registered})) or "none (see `tops plugins`)"
        raise pytest.UsageError(f"tops conformance kit: --tops-impl {' '.join(patterns)} matches no registered implementation; registered: {names}")
    return selected


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    wanted = {"tops_conformance_case": "supported", "tops_rejection_case": "unsupported"}
    for fixture, kind in wanted.items():
        if fixture not in metafunc.fixturenames:
            continue
        params, ids = [], []
        for impl in selected_implementations(metafunc.config):
            reason = runnable_here(impl)
            if reason is not None and kind == "supported":
                params.append(pytest.param((impl, None), marks=pytest.mark.skip(reason=reason)))
                ids.append(f"{impl.op}:{impl.name}")
                continue
            # The reference against itself checks only its contract (its accuracy is tested against
            # independent formulas in its own plugin): its base case by default, the rest with -m slow.
            itself = kind == "supported" and impl.name == metafunc.config.getoption("tops_reference")
            for case in getattr(grid(impl), kind):
                slow = case.slow or (itself and case.name != "base")
                params.append(pytest.param((impl, case), marks=pytest.mark.slow) if slow else (impl, case))
                ids.append(f"{impl.op}:{impl.name}:{case.name}")
        metafunc.parametrize(fixture, params, ids=ids)


@pytest.fixture
def tops_reference(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("tops_reference")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tag the cases of an implementation that cannot run here, for the summary's list of them."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        impl, case = callspec.params.get("tops_conformance_case", (None, True)) if callspec else (None, True)
        if case is None:  # pytest_generate_tests skipped it with runnable_here's reason
            reason = item.get_closest_marker("skip").kwargs["reason"]
            item.user_properties.append((_SKIPPED_PROPERTY, (impl.op, impl.name, reason)))


@pytest.fixture
def tops_record(request: pytest.FixtureRequest):
    """Record measurements of the running case for the end-of-run summary."""
    def record(impl, case, measurements):
        outputs = tuple((m.name, float(m.error), float(m.tolerance)) for m in measurements)
        request.node.user_properties.append((_RESULTS_PROPERTY, (impl.op, impl.name, case.dtype, case.name, outputs)))
    return record
