"""The main job, ``tops bench``, on tiny workloads with in-process implementations."""

import io

import pytest

import tops_plugins_ref
from tests import fakes
from tops_core import bench
from tops_core.cli import main


@pytest.fixture
def installed(registry):
    registry.register_plugin(tops_plugins_ref, "ref")
    fakes.register("portable", priority={"cpu": 100})
    fakes.register("kernel_only", backward=None, priority={"cpu": 50})
    return registry


def tiny(**overrides):
    shape = overrides.pop("shape", (1, 24, 2, 8, 8))
    return bench.workload("simple_gla", shape, "float32", overrides.pop("features", ["g_gamma"]))


def test_every_supporting_implementation_is_timed_and_checked(installed):
    report = bench.run(tiny(), budget=0.05, max_repeats=3)
    rows = {row.implementation: row for row in report.rows}
    assert set(rows) == {"ref.recurrent", "fake.portable", "fake.kernel_only"}
    assert report.reference_at_workload and report.check == report.workload
    portable = rows["fake.portable"]
    assert portable.selected == "fwd+bwd" and portable.forward.repeats >= 3
    assert portable.within_tolerance and portable.forward_error < 1e-5 and portable.gradient_error < 5e-5
    kernel = rows["fake.kernel_only"]
    assert kernel.backward_by == "fake.portable" and kernel.forward_backward is not None


def test_report_table_names_the_winner_speedups_and_errors(installed):
    text = bench.format_report(bench.run(tiny(), budget=0.05, max_repeats=3))
    lines = text.splitlines()
    assert lines[0] == "tops bench simple_gla: B=1 T=24 H=2 K=8 V=8 float32 on cpu, with g_gamma"
    portable = next(line for line in lines if line.startswith("fake.portable"))
    assert "fwd+bwd" in portable and " ok" in portable and "x / " in portable
    assert "(bwd fake.portable)" in next(line for line in lines if line.startswith("fake.kernel_only"))
    assert "measured at workload against the float64 reference" in text


def test_a_large_workload_checks_and_compares_at_a_smaller_shape(installed, monkeypatch):
    monkeypatch.setattr(bench, "REFERENCE_MAX_ELEMENTS", 1000)
    report = bench.run(tiny(shape=(2, 40, 3, 8, 8)), budget=0.05, max_repeats=3)
    assert not report.reference_at_workload
    assert (report.check.batch, report.check.seq_len, report.check.heads) == (1, 40, 3)
    reference = next(row for row in report.rows if row.implementation == "ref.recurrent")
    assert reference.forward is None and "not timed at the workload" in reference.note
    assert reference.check_forward is not None
    text = bench.format_report(report)
    assert "measured at B=1 T=40 H=3 K=8 V=8 against" in text


def test_varlen_workload(installed):
    fakes.register("packed", features=fakes.FEATURES | {"cu_seqlens"}, priority={"cpu": 200})
    case = tiny(shape=(2, 24, 2, 8, 8), features=["g_gamma", "cu_seqlens"])
    assert (case.batch, case.seq_len, case.seqlens) == (1, 48, (9, 15, 9, 15))
    report = bench.run(case, budget=0.05, max_repeats=3)
    rows = {row.implementation: row for row in report.rows}
    assert set(rows) == {"fake.packed", "ref.recurrent"} and rows["ref.recurrent"].within_tolerance
    # The fake declares cu_seqlens but scans straight across the boundaries: the check says so.
    assert not rows["fake.packed"].within_tolerance
    assert "FAIL" in bench.format_report(report)


def test_cli_bench(installed, capsys):
    assert main(["bench", "--shape", "1,16,2,8,8", "--impl", "fake.portable,ref.recurrent", "--budget", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "tops bench simple_gla: B=1 T=16 H=2 K=8 V=8 float32 on cpu, with g_gamma" in out
    assert "fake.kernel_only" not in out


@pytest.mark.parametrize("argv, message", [
    (["bench", "--shape", "1,2,3"], "--shape must be B,T,H,K,V"),
    (["bench", "--with", "alibi"], "unknown feature(s) ['alibi']"),
])
def test_cli_bench_rejects_bad_arguments(installed, argv, message):
    with pytest.raises((SystemExit, ValueError)) as raised:
        main(argv)
    assert message in str(raised.value)


def test_unknown_implementation_is_named(installed):
    with pytest.raises(ValueError, match=r"unknown implementation\(s\) \['fake.nope'\]"):
        bench.run(tiny(), names=["fake.nope"])


def test_progress_is_silent_off_a_terminal():
    stream = io.StringIO()
    progress = bench.Progress(3, stream)
    progress.step("one")
    progress.close()
    assert stream.getvalue() == ""


def test_progress_draws_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    progress = bench.Progress(2, stream)
    progress.step("compiling")
    assert "[" in stream.getvalue() and "0/2 compiling" in stream.getvalue()


def test_plot_writes_a_png(installed, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "times.png"
    bench.plot(tiny(), ["fake.portable"], str(path), budget=0.02)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
