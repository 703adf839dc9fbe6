"""The main job, ``tops bench``, on tiny workloads with in-process implementations."""

import dataclasses
import io
import json
import re

import jax
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
    return bench.workload("simple_gla", shape, overrides.pop("dtype", "float32"), overrides.pop("features", ["g_gamma"]),
                          overrides.pop("num_seqs", None))


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


def test_counted_flops_per_op():
    # Per token and head at K = V = 8, chunk 64: simple_gla 4*64 + 2*64*16 = 2304;
    # kda 6*64 + 4*64*16 + 2*64*64/3 = 384 + 4096 + 2730.67.
    assert bench.forward_flops(tiny(shape=(2, 24, 3, 8, 8))) == 2 * 24 * 3 * 2304
    kda = bench.workload("kda", (2, 24, 3, 8, 8), "float32", [])
    assert bench.forward_flops(kda) == pytest.approx(2 * 24 * 3 * (384 + 4096 + 2 * 64 * 64 / 3))


def test_shares_of_the_flat_product_ceiling_timed_in_turns(installed):
    report = bench.run(tiny(), budget=0.05, max_repeats=3)
    flat, (tokens, state), flops = bench.flat_product(report.workload)
    assert tokens.shape == (1 * 24 * 2, 8) and state.shape == (8, 8) and flops == report.ceiling_flops == 2 * 48 * 8 * 8
    timed = [row for row in report.rows if row.implementation != "ref.recurrent"]
    assert len(report.ceiling) == sum(1 + row.differentiable for row in timed)  # one beside each timing at the workload
    reference = next(row for row in report.rows if row.implementation == "ref.recurrent")
    assert reference.forward and reference.forward_share is None  # another algorithm, on the host
    ceilings = iter(report.ceiling)
    counted = bench.forward_flops(report.workload)
    for row in timed:
        assert row.forward_share == pytest.approx(counted / flops * next(ceilings).median / row.forward.median)
        assert row.forward_backward_share == pytest.approx(3 * counted / flops * next(ceilings).median / row.forward_backward.median)
    portable = next(row for row in report.rows if row.implementation == "fake.portable")
    text = bench.format_report(report)
    shares = f"{portable.forward_share:.0%} / {portable.forward_backward_share:.0%}"
    assert shares in next(line for line in text.splitlines() if line.startswith("fake.portable"))
    assert "at the rate of one flat [B*T*H, K] @ [K, V] product timed in turns with each" in text


def test_calls_timed_in_turns_each_get_their_own_timing():
    import time

    def sleeper(seconds):
        return lambda: time.sleep(seconds)

    short, long = bench.time_turns([(sleeper(0.001), ()), (sleeper(0.02), ())], budget=0.1, max_repeats=4)
    assert short.repeats == long.repeats >= 3
    assert short.median < 0.01 < long.median


def test_a_large_workload_checks_and_compares_at_a_smaller_shape(installed, monkeypatch):
    monkeypatch.setattr(bench, "REFERENCE_MAX_ELEMENTS", 1000)
    report = bench.run(tiny(shape=(2, 40, 3, 8, 8)), budget=0.05, max_repeats=3)
    assert not report.reference_at_workload
    assert (report.check.batch, report.check.seq_len, report.check.heads) == (1, 40, 3)
    reference = next(row for row in report.rows if row.implementation == "ref.recurrent")
    assert reference.forward is None and "not timed at the workload" in reference.note
    assert reference.check_forward is not None
    assert reference.forward_share is None and reference.forward_backward_share is None
    text = bench.format_report(report)
    assert "measured at B=1 T=40 H=3 K=8 V=8 against" in text


def test_varlen_workload(installed):
    fakes.register("packed", features=fakes.FEATURES | {"cu_seqlens"}, priority={"cpu": 200})
    case = tiny(shape=(1, 48, 2, 8, 8), features=["g_gamma", "cu_seqlens"], num_seqs=4)
    assert (case.batch, case.seq_len, case.seqlens) == (1, 48, (8, 16, 8, 16))
    report = bench.run(case, budget=0.05, max_repeats=3)
    rows = {row.implementation: row for row in report.rows}
    assert set(rows) == {"fake.packed", "ref.recurrent"} and rows["ref.recurrent"].within_tolerance
    # The fake declares cu_seqlens but scans straight across the boundaries: the check says so.
    assert not rows["fake.packed"].within_tolerance
    assert "FAIL" in bench.format_report(report)


def test_cli_bench(installed, capsys):
    argv = ["bench", "--shape", "1,16,2,8,8", "--impl", "fake.portable,ref.recurrent", "--budget", "0.05", "--tpu", "none"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("tops bench simple_gla: B=1 T=16 H=2 K=8 V=8 float32 on cpu, with g_gamma\n")
    assert "fake.kernel_only" not in out
    assert "Modelled on TPU" not in out


def _model_without_compiling(monkeypatch) -> list:
    """Replace the modelled section by a stub that records what it was asked (the section itself compiles
    for a compile-only TPU, which test_pallas_compile runs in a process of its own)."""
    from tops_core.tpu import model as tpu_model
    from tops_core.tpu.generations import GENERATIONS

    asked = []

    def model(case, generation, names):
        asked.append((case.dtype, generation, names))
        return tpu_model.TpuModel(case, GENERATIONS[generation], (), (), unavailable="not compiled in this test")

    monkeypatch.setattr(tpu_model, "model", model)
    return asked


def test_cli_bench_adds_the_modelled_tpu_section_off_tpu(installed, capsys, monkeypatch):
    # Only that the CLI asks for the section, for the generation given, in bf16 by default.
    asked = _model_without_compiling(monkeypatch)
    assert main(["bench", "--shape", "1,16,2,8,8", "--impl", "fake.portable", "--budget", "0.05", "--tpu", "v5e"]) == 0
    out = capsys.readouterr().out
    assert asked == [("bfloat16", "v5e", ["fake.portable"])]
    assert "Modelled on TPU v5e (a model, nothing ran; compiled for a compile-only device): simple_gla B=1 T=16 H=2 K=8 V=8 bfloat16" in out


def test_cli_bench_models_a_bounded_kda_call_with_and_without_its_bound(installed, capsys, monkeypatch):
    # lower_bound lets kernels take a faster path: the modelled section shows the call and the same call without it.
    asked = []
    _model_without_compiling(monkeypatch)
    from tops_core.tpu import model as tpu_model

    stub = tpu_model.model
    monkeypatch.setattr(tpu_model, "model", lambda case, generation, names: asked.append(case.features) or stub(case, generation, names))
    argv = ["bench", "kda", "--shape", "1,16,1,8,8", "--with", "use_gate,lower_bound", "--impl", "ref.recurrent", "--budget", "0.05",
            "--tpu", "v6e", "--json"]
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert asked == [{"use_gate", "lower_bound"}, {"use_gate", "A_log"}]
    assert document["modelled_tpu"]["workload"]["features"] == ["lower_bound", "use_gate"]
    assert document["modelled_tpu_without_lower_bound"]["workload"]["features"] == ["A_log", "use_gate"]
    assert main(argv[:-1]) == 0
    assert "The same call without lower_bound (the kernels' exact path, for comparison)" in capsys.readouterr().out


def test_cli_bench_json_is_one_document_with_every_figure(installed, capsys, monkeypatch):
    _model_without_compiling(monkeypatch)
    assert main(["bench", "--shape", "1,16,2,8,8", "--impl", "fake.portable,ref.recurrent", "--budget", "0.05", "--tpu", "v5e", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)  # nothing but the document on stdout
    assert document["workload"]["batch"] == 1 and document["workload"]["features"] == ["g_gamma"]
    rows = {row["implementation"]: row for row in document["rows"]}
    assert set(rows) == {"fake.portable", "ref.recurrent"}
    assert rows["fake.portable"]["forward"]["median"] > 0 and rows["fake.portable"]["within_tolerance"] is True
    assert rows["fake.portable"]["forward_error"] >= 0
    assert rows["fake.portable"]["forward_share"] > 0 and "forward_share" in rows["ref.recurrent"]
    assert len(document["ceiling"]["timings"]) == 2 and document["ceiling"]["flops"] == 2 * 16 * 2 * 8 * 8
    assert document["failures"] == [] and document["not_measured"] == []
    assert document["accuracy_checked"] is True and document["accuracy_not_checked"] is None
    assert document["modelled_tpu"]["generation"] == "v5e"
    assert document["modelled_tpu"]["unavailable"] == "not compiled in this test"


def test_cli_bench_exits_nonzero_when_a_row_fails(installed, capsys):
    fakes.register("packed", features=fakes.FEATURES | {"cu_seqlens"}, priority={"cpu": 200})
    argv = ["bench", "--shape", "1,24,2,8,8", "--with", "g_gamma,cu_seqlens", "--num-seqs", "3", "--budget", "0.05", "--tpu", "none"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "N=3" in captured.out and "FAIL: fake.packed outside the tolerance for float32" in captured.err


def test_cli_bench_float64_runs_in_float64_without_x64_enabled_by_the_user(installed, capsys):
    import jax

    import tops_plugins_xla

    installed.register_plugin(tops_plugins_xla, "xla")
    assert not jax.config.jax_enable_x64
    assert main(["bench", "--shape", "1,16,2,8,8", "--dtype", "float64", "--impl", "xla.chunk", "--budget", "0.05", "--tpu", "none"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("xla.chunk"))
    assert "float64 on cpu" in out and row.endswith(" ok")
    forward_error, gradient_error = float(row.split()[-4]), float(row.split()[-2])
    assert forward_error < 1e-13 and gradient_error < 1e-13, "computed in float64, not float32"
    assert not jax.config.jax_enable_x64


@pytest.mark.parametrize("argv, message", [
    (["bench", "--shape", "1,2,3"], "--shape must be B,T,H,K,V"),
    (["bench", "--with", "alibi"], "unknown feature(s) ['alibi']"),
    (["bench", "--num-seqs", "3"], "--num-seqs describes packed sequences: add cu_seqlens to --with"),
    (["bench", "--with", "cu_seqlens", "--shape", "2,64,2,8,8"], "cu_seqlens packs the sequences along T and requires B == 1, got B = 2"),
    (["bench", "--impl", "nope"], "unknown implementation(s) ['nope'] of simple_gla"),
    (["bench", "--plot", "/nonexistent/x.png"], "--plot /nonexistent/x.png: the directory /nonexistent does not exist"),
])
def test_cli_bench_rejects_bad_arguments_in_one_line_before_any_work(installed, capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("tops: error: ") and message in captured.err
    assert captured.err.count("\n") == 1


def test_cli_bench_names_why_a_kernel_cannot_run_here_and_what_to_do(installed, capsys):
    fakes.register("tpu_kernel", platforms={"tpu"}, interpretable=True, backward=None, priority={"tpu": 200})
    assert main(["bench", "--impl", "fake.tpu_kernel", "--tpu", "none"]) == 2
    assert capsys.readouterr().err == (
        "tops: error: fake.tpu_kernel cannot run this workload here: runs on tpu, this call is on cpu "
        "(interpret mode is off; TOPS_INTERPRET=1 runs it in Pallas' TPU interpreter); "
        "--tpu GEN (v4, v5e, v5p, v6e) models it on a compile-only TPU instead\n")


def test_cli_bench_models_a_tpu_kernel_alone_off_tpu(installed, capsys, monkeypatch):
    fakes.register("tpu_kernel", platforms={"tpu"}, interpretable=True, backward=None, priority={"tpu": 200})
    asked = _model_without_compiling(monkeypatch)
    assert main(["bench", "--shape", "1,16,2,8,8", "--impl", "fake.tpu_kernel", "--budget", "0.05", "--tpu", "v5e"]) == 0
    captured = capsys.readouterr()
    assert asked == [("bfloat16", "v5e", ["fake.tpu_kernel"])]
    lines = captured.out.splitlines()
    assert lines[0] == "tops bench simple_gla: B=1 T=16 H=2 K=8 V=8 float32 on cpu, with g_gamma"
    assert lines[2] == ("fake.tpu_kernel: not measured here, runs on tpu, this call is on cpu (interpret mode is off; "
                        "TOPS_INTERPRET=1 runs it in Pallas' TPU interpreter); modelled on TPU v5e below.")
    assert "selected" not in captured.out and "ref.recurrent" not in captured.out  # no measured table, no reference run
    assert lines[4].startswith("Modelled on TPU v5e")
    assert captured.err == ""  # nothing ran: no progress
    assert main(["bench", "--shape", "1,16,2,8,8", "--impl", "fake.tpu_kernel", "--tpu", "v5e", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["rows"] == [] and document["ceiling"] is None and document["check"] is None
    assert document["accuracy_checked"] is False and document["accuracy_not_checked"] == "nothing ran on this machine"
    assert document["not_measured"][0]["implementation"] == "fake.tpu_kernel" and document["modelled_tpu"]["generation"] == "v5e"
    assert main(["bench", "--impl", "fake.tpu_kernel", "--tpu", "v5e", "--plot", "times.png"]) == 2
    assert "--plot draws times measured here, and none of --impl fake.tpu_kernel runs here" in capsys.readouterr().err


def test_cli_bench_measures_what_runs_here_and_models_the_rest(installed, capsys, monkeypatch):
    fakes.register("tpu_kernel", platforms={"tpu"}, interpretable=True, backward=None, priority={"tpu": 200})
    asked = _model_without_compiling(monkeypatch)
    argv = ["bench", "--shape", "1,16,2,8,8", "--impl", "fake.portable,fake.tpu_kernel", "--budget", "0.05", "--tpu", "v5e", "--json"]
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert asked == [("bfloat16", "v5e", ["fake.portable", "fake.tpu_kernel"])]
    assert [row["implementation"] for row in document["rows"]] == ["fake.portable"]
    assert document["rows"][0]["within_tolerance"] is True
    assert [entry["implementation"] for entry in document["not_measured"]] == ["fake.tpu_kernel"]
    assert "runs on tpu, this call is on cpu" in document["not_measured"][0]["why"]


def test_cli_bench_without_the_reference_says_nothing_was_checked(registry, capsys, monkeypatch):
    fakes.register("portable", priority={"cpu": 100})
    argv = ["bench", "--shape", "1,16,2,8,8", "--budget", "0.05", "--tpu", "none"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    row = next(line for line in captured.out.splitlines() if line.startswith("fake.portable"))
    assert row.endswith("not checked")
    assert "against the float64 reference" not in captured.out
    assert ("Accuracy not checked: the float64 reference (ref.recurrent) is not registered; "
            "it comes with the reference plugin (pip install -e plugins/tops_plugins_ref).") in captured.out
    assert "tops: warning: accuracy not checked: the float64 reference (ref.recurrent) is not registered" in captured.err
    assert main([*argv, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["reference_at_workload"] is False and document["accuracy_checked"] is False
    assert document["accuracy_not_checked"].startswith("the float64 reference (ref.recurrent) is not registered")
    assert document["failures"] == [] and document["rows"][0]["within_tolerance"] is None


def test_a_workload_too_large_for_this_machine_is_refused_in_one_line_before_any_work(installed, capsys, monkeypatch):
    monkeypatch.setattr(bench, "host_memory_available", lambda: 2**30)
    assert main(["bench", "--shape", "64,65536,64,256,256", "--tpu", "none"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert re.match(r"tops: error: B=64 T=65536 H=64 K=256 V=256 float32 needs about [\d.]+ TiB of memory .*, more than the 1 GiB available",
                    captured.err)


def test_the_memory_estimate_counts_the_run_arrays_and_the_float64_test_data():
    B, T, H, K, V = 2, 200, 3, 16, 8
    tokens, f32, f64 = B * T * H, 4, 8
    arrays = tokens * f32 * (
        2 * (2 * K + V)  # q, k, v and their gradients
        + 2 * V  # o and do
        + K + V  # the flat product's tokens and its result
    ) + K * V * f32  # the flat product's state
    chunk_states = B * H * 4 * K * V * f32  # ceil(200 / 64) = 4 chunks per sequence and head
    test_data = tokens * f64 * (2 * K + 2 * V)  # q, k, v and do drawn in float64
    assert bench.memory_needed(tiny(shape=(B, T, H, K, V), features=[])) == bench.MemoryNeed(arrays + chunk_states, test_data)
    # The initial state and the final state's cotangent, each with its gradient, and each drawn in float64 too.
    with_states = bench.memory_needed(tiny(shape=(B, T, H, K, V), features=["initial_state", "output_final_state"]))
    states = 2 * B * H * K * V
    assert with_states == bench.MemoryNeed(arrays + chunk_states + 2 * states * f32, test_data + states * f64)


def test_memory_is_checked_where_the_arrays_would_be(monkeypatch):
    case = tiny(shape=(2, 200, 3, 16, 8))
    need = bench.memory_needed(case)
    monkeypatch.setattr(bench, "host_memory_available", lambda: need.arrays + need.test_data)
    monkeypatch.setattr(bench, "device_memory_available", lambda: need.arrays)
    bench.check_memory(case, "cpu")  # exactly enough
    bench.check_memory(case, "gpu")
    monkeypatch.setattr(bench, "host_memory_available", lambda: need.arrays + need.test_data - 1)
    with pytest.raises(ValueError, match=r"needs about [\d.]+ [KM]iB of memory \(.*\), more than the [\d.]+ [KM]iB available"):
        bench.check_memory(case, "cpu")
    bench.check_memory(case, "gpu")  # the arrays are in the GPU's memory, the host only draws the test data
    monkeypatch.setattr(bench, "device_memory_available", lambda: need.arrays - 1)
    with pytest.raises(ValueError, match=r"of gpu memory"):
        bench.check_memory(case, "gpu")
    monkeypatch.setattr(bench, "host_memory_available", lambda: None)  # unknown: nothing to refuse on
    bench.check_memory(case, "cpu")


def test_the_plot_is_checked_for_memory_at_its_longest_sequence(installed, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    case = tiny(shape=(1, 4096, 2, 64, 64))
    at_twice = dataclasses.replace(case, seq_len=8192)
    def total(case):
        need = bench.memory_needed(case)
        return need.arrays + need.test_data

    monkeypatch.setattr(bench, "host_memory_available", lambda: (total(case) + total(at_twice)) // 2)
    argv = ["bench", "--shape", "1,4096,2,64,64", "--tpu", "none", "--impl", "fake.portable"]
    assert main([*argv, "--plot", "/tmp/never-written.png"]) == 2
    assert "T=8192" in capsys.readouterr().err


def test_unknown_implementation_is_named(installed):
    with pytest.raises(ValueError, match=r"unknown implementation\(s\) \['fake.nope'\]"):
        bench.run(tiny(), names=["fake.nope"])


def test_progress_prints_a_line_per_step_off_a_terminal():
    stream = io.StringIO()
    progress = bench.Progress(2, stream)
    progress.step("one")
    progress.step("two")
    progress.close()
    assert stream.getvalue() == "[1/2] one\n[2/2] two\n"


def test_the_progress_total_counts_every_step(installed, capsys):
    bench.run(tiny(), budget=0.02, max_repeats=3)
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith(f"[{i}/{len(lines)}] ") for i, line in enumerate(lines, 1))


def test_progress_draws_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    progress = bench.Progress(2, stream)
    progress.step("compiling")
    assert "[" in stream.getvalue() and "0/2 compiling" in stream.getvalue()


def test_plot_writes_a_png_with_ticks_at_its_points(installed, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    plt = bench.pyplot()
    figures = []
    monkeypatch.setattr(plt, "subplots", lambda *a, subplots=plt.subplots, **k: figures.append(subplots(*a, **k)) or figures[-1])
    path = tmp_path / "times.png"
    bench.plot(tiny(), ["fake.portable"], str(path), budget=0.02)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _, axes = figures[0]
    for axis in axes:
        points = sorted(axis.get_lines()[0].get_xdata())
        assert list(axis.get_xticks()) == points == [24, 48, 64]


def test_a_modelled_section_with_nothing_to_model_is_one_line():
    from tops_core.tpu import model as tpu_model
    from tops_core.tpu.generations import GENERATIONS

    case = tiny(dtype="bfloat16")
    nothing = tpu_model.TpuModel(case, GENERATIONS["v4"], (), (("xla.chunk", tpu_model.NO_TPU_KERNEL),))
    assert tpu_model.format_model(nothing) == ("Modelled on TPU v4: nothing to model for simple_gla B=1 T=24 H=2 K=8 V=8 bfloat16: "
                                               "xla.chunk has no TPU kernel (no Mosaic kernel in its compiled program).")
    no_candidate = tpu_model.TpuModel(case, GENERATIONS["v4"], (), ())
    assert tpu_model.format_model(no_candidate).count("\n") == 0
    assert "no implementation supports it natively on TPU" in tpu_model.format_model(no_candidate)


def kernel_issuing(cycles: int, busiest: tuple[str, int], traced_loop_cycles: int = 0, **issued):
    from tops_core.tpu import llo
    from tops_core.tpu import model as tpu_model

    return tpu_model.KernelModel(
        name="k.1", grid_steps=1, hbm_bytes=0, cycles=cycles, counts=llo.UnitCounts(), issued=llo.Issued(**issued),
        hbm_seconds=0.0, issue_seconds=1.0, mxu_seconds=0.0, busiest_unit=busiest[0], busiest_unit_cycles=busiest[1],
        traced_loop_cycles=traced_loop_cycles,
    )


def test_a_limit_on_loads_or_stores_says_how_much_of_it_is_register_spills():
    spilling = dict(stores=200, spill_stores=150, loads=90, spill_loads=90)
    assert kernel_issuing(1000, ("store", 200), **spilling).describe_limit() == (
        "issue: dependency chains (5.0x the store slots' need; 75% of them register spills)")
    assert kernel_issuing(250, ("store", 200), **spilling).describe_limit() == "issue: store slots (75% of them register spills)"
    assert kernel_issuing(250, ("load", 200), **spilling).describe_limit() == "issue: load slots (100% of them register spills)"
    # Spills are named only for the unit that binds, and only when there are any.
    assert kernel_issuing(1000, ("vector ALU", 200), **spilling).describe_limit() == "issue: dependency chains (5.0x the vector ALU slots' need)"
    assert kernel_issuing(250, ("store", 200), stores=200).describe_limit() == "issue: store slots"


def test_a_limit_on_issue_says_how_much_of_it_is_in_loops_of_traced_trips():
    # Such a loop (a packed kernel's over the sequences with a boundary in a chunk) is counted once, whatever it runs.
    traced = "46% of the cycles in loops of traced trips, each counted once"
    assert kernel_issuing(1000, ("vector ALU", 200), traced_loop_cycles=460).describe_limit() == (
        f"issue: dependency chains (5.0x the vector ALU slots' need; {traced})")
    assert kernel_issuing(250, ("store", 200), traced_loop_cycles=115, stores=200, spill_stores=150).describe_limit() == (
        f"issue: store slots (75% of them register spills; {traced})")


@pytest.mark.parametrize("budget", ["0", "-1", "nan", "inf", "soon"])
def test_cli_bench_budget_must_be_a_positive_number_of_seconds(installed, capsys, budget):
    with pytest.raises(SystemExit) as raised:
        main(["bench", "--shape", "1,16,2,8,8", "--budget", budget, "--tpu", "none"])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument --budget: must be a positive, finite number of seconds, got {budget!r}" in err


def test_the_tpu_model_matches_implementations_on_the_chip_it_models():
    # A capability may turn on the chip: kda's float32 backward at K = V = 512 fits v5e's VMEM but not v4's 16 MiB, so the
    # model must not ask the Pallas backward for it on a v4 (it once asked a backward the chip's capability rejected,
    # found no Pallas kernel in the program and failed).
    pytest.importorskip("tops_plugins_tpu_pallas")
    from tops_core.registry import default_registry
    from tops_core.tpu import model as tpu_model

    case = bench.workload("kda", (1, 1024, 2, 512, 512), "float32", ["use_qk_l2norm"])
    fused = next(impl for impl in default_registry().all_implementations() if impl.op == "kda" and impl.name == "tpu_pallas.fused")
    assert tpu_model.tpu_spec(case, "v4").chip == "v4"
    assert fused.reasons(tpu_model.tpu_spec(case, "v4"), "backward")
    assert not fused.reasons(tpu_model.tpu_spec(case, "v5e"), "backward")



@pytest.mark.parametrize("features, num_seqs, final_state", [
    (["g", "cu_seqlens", "initial_state", "output_final_state"], 3, (3, 2, 8, 8)),
    (["g", "output_final_state"], None, (2, 2, 8, 8)),
    (["g", "cu_seqlens", "initial_state"], 3, None),
])
def test_the_modelled_backward_takes_the_final_states_cotangent_where_the_workload_outputs_it(features, num_seqs, final_state):
    # Under grad the final state's cotangent reaches the backward, zeros where nothing uses it; a packed backward adds dht
    # where each sequence ends, so leaving it out would model less than a training step runs.
    from tops_core.tpu import model as tpu_model

    B = 1 if num_seqs else 2
    case = bench.workload("simple_gla", (B, 24, 2, 8, 8), "float32", features, num_seqs)
    _, arrays, do, *dht = tpu_model.program(bench.case_json(case), "xla.chunk", "backward")
    assert do.shape == (B, 24, 2, 8)
    assert [x.shape for x in dht] == ([final_state] if final_state else [])
    assert all(str(x.dtype) == "float32" for x in dht)


def test_the_modelled_training_step_hands_the_backward_what_the_forward_wrote():
    # kda's Pallas forward hands its backward every chunk's state and inverse (Implementation.residuals): the model's
    # backward takes them as parameters, and its training forward writes them, so neither is counted twice or left out.
    pytest.importorskip("libtpu", reason="compiling for TPU without one needs libtpu (the test extra installs it)")
    from tops_core.tpu import compile_only
    from tops_core.tpu import model as tpu_model

    case = bench.workload("kda", (1, 256, 2, 128, 128), "bfloat16", ["use_qk_l2norm"])
    training, arrays = tpu_model.program(bench.case_json(case), "tpu_pallas.fused", "training", chip="v6e")
    with jax.default_device(compile_only.device("v6e")):  # as compile_only.lower_for traces it
        _, written = jax.eval_shape(training, arrays)
    _, pullback, do = tpu_model.program(bench.case_json(case), "tpu_pallas.fused", "backward", chip="v6e")
    inputs = sorted(x.shape for x in jax.tree.leaves(arrays))
    handed_on = sorted(x.shape for x in jax.tree.leaves(pullback))
    assert handed_on == sorted(x.shape for x in written)
    for shape in inputs:
        handed_on.remove(shape)
    assert handed_on == [(1, 2, 2, 128, 128), (1, 2, 2, 128, 128)]  # chunks of 128 on v6e: two states, two inverses


def test_a_training_step_in_a_layer_takes_the_forward_kernels_that_write_what_they_hand_on():
    from tops_core.tpu import model as tpu_model

    def kernel(seconds):
        return dataclasses.replace(kernel_issuing(1, ("vector ALU", 1)), issue_seconds=seconds)

    layer, backward = tpu_model.Setting(0, 0, 0.5, 3.0), tpu_model.Setting(1, 0, 0.25, 4.25)
    inference = tpu_model.Modelled("x", (kernel(2.0),), layer, layer, 0, 0, (kernel(4.0),), backward)
    assert inference.forward_backward_in_a_layer == 3.0 + 4.0
    training = dataclasses.replace(inference, training_kernels=(kernel(2.5),))
    assert training.forward_backward_in_a_layer == 3.0 + 0.5 + 4.0
