"""The ``tops`` command line."""

import re

import pytest

from tests import fakes
from tops_core.cli import main


@pytest.fixture
def kernels(registry):
    fakes.register("portable", priority={"cpu": 100, "tpu": 50})
    fakes.register("kernel", platforms={"tpu"}, interpretable=True, backward=None, priority={"tpu": 200},
                   dtypes={"bfloat16", "float32"}, features={"g", "g_gamma", "initial_state", "output_final_state"},
                   ndims={"g_gamma": {1}})
    return registry


def test_list_prints_a_support_matrix_and_details(kernels, capsys):
    assert main(["list", "simple_gla"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("simple_gla: 2 implementation(s)")
    header = next(line for line in out.splitlines() if line.strip().startswith("implementation"))
    assert header.split() == ["implementation", "cpu", "gpu", "tpu", "bf16", "f16", "f32", "f64", "cu_seqlens", "g",
                              "g_gamma", "initial_state", "output_final_state", "backward"]
    kernel_row = next(line for line in out.splitlines() if line.strip().startswith("fake.kernel"))
    assert kernel_row.split() == ["fake.kernel", "i", "i", "y", "y", "-", "y", "-", "-", "y", "y", "y", "y", "-"]
    assert "priority: cpu 100, tpu 50" in out and "g_gamma.ndim in {1}" in out
    assert "config: FakeConfig(chunk_size=64)" in out


def test_list_all_ops(kernels, capsys):
    main(["list"])
    out = capsys.readouterr().out
    assert "kda: 0 implementation(s)" in out and "simple_gla: 2 implementation(s)" in out


def test_explain_describes_a_call_and_prints_both_decisions(kernels, capsys):
    assert main(["explain", "simple_gla", "--shape", "2,4096,8,128,128", "--with", "g_gamma,output_final_state"]) == 0
    out = capsys.readouterr().out
    assert "simple_gla forward: B=2 T=4096 H=8 K=128 V=128 float32 on cpu; with g_gamma (ndim 1), output_final_state" in out
    assert re.search(r"x fake.kernel +rejected: runs on tpu, this call is on cpu \(interpret mode is off", out)
    assert out.count("selected: fake.portable") == 2


def test_explain_for_another_platform_and_interpret_mode(kernels, capsys):
    main(["explain", "simple_gla", "--with", "g_gamma", "--platform", "tpu"])
    out = capsys.readouterr().out
    forward, backward = out.split("simple_gla backward")
    assert "selected: fake.kernel" in forward and "selected: fake.portable" in backward
    assert "pairing: fake.kernel is forward-only; gradients come from fake.portable's backward" in backward
    main(["explain", "simple_gla", "--with", "g_gamma", "--interpret"])
    assert "selected: fake.kernel [interpreted]" in capsys.readouterr().out


def test_explain_reports_when_nothing_supports_the_call(kernels, capsys):
    assert main(["explain", "simple_gla", "--shape", "1,64,2,64,64", "--with", "cu_seqlens", "--num-seqs", "3"]) == 1
    out = capsys.readouterr().out
    assert "no implementation of simple_gla supports this forward call" in out
    assert "N=3" in out and "does not support cu_seqlens" in out


def test_explain_force_strict_deny_and_ndim(kernels, capsys):
    main(["explain", "simple_gla", "--with", "g_gamma", "--ndim", "g_gamma=0", "--platform", "tpu", "--deny", "fake.portable"])
    out = capsys.readouterr().out
    assert "g_gamma.ndim=0 not supported" in out and "denied by policy" in out
    main(["explain", "simple_gla", "--force", "fake.portable", "--platform", "tpu"])
    assert "decided by: forced by --force" in capsys.readouterr().out


def test_explain_splits_deny_patterns_at_commas_as_TOPS_DENY_does(kernels, capsys):
    assert main(["explain", "simple_gla", "--platform", "tpu", "--deny", "fake.kernel, fake.port*", "--deny", "fake.kernel"]) == 1
    out = capsys.readouterr().out
    assert "deny=fake.kernel, fake.port*;" in out and "x fake.portable" in out and "denied by policy" in out


@pytest.mark.parametrize("argv, message", [
    (["explain", "simple_gla", "--shape", "2,64"], "--shape must be B,T,H,K,V"),
    (["explain", "simple_gla", "--with", "alibi"], "unknown feature(s) ['alibi']"),
    (["explain", "simple_gla", "--with", "g", "--ndim", "g=1"], "--ndim takes NAME=RANK"),
    (["explain", "simple_gla", "--with", "cu_seqlens", "--shape", "2,64,2,16,16"], "cu_seqlens packs the sequences along T and requires B == 1"),
    (["explain", "simple_gla", "--num-seqs", "3"], "--num-seqs describes packed sequences: add cu_seqlens to --with"),
    (["explain", "simple_gla", "--force", "nope.impl"], "unknown implementation 'nope.impl' of simple_gla; registered: fake.kernel, fake.portable"),
    (["explain"], "name the op: OP or --op OP, one of gated_delta_rule, gla, kda, simple_gla"),
    (["explain", "simple_gla", "--op", "kda"], "two ops named: simple_gla and --op kda"),
    (["explain", "simple_gla", "--deny", "fake.portabel"],
     "--deny: deny pattern 'fake.portabel' matches no registered implementation; registered: fake.kernel, fake.portable"),
    (["explain", "simple_gla", "--deny", "fake.kernel,xla.*"], "--deny: deny pattern 'xla.*' matches no registered implementation"),
    (["explain", "kda", "--with", "use_gate"], "--with use_gate: use_gate requires A_log or lower_bound"),
    (["bench", "kda", "--with", "dt_bias,lower_bound"], "dt_bias requires use_gate"),
    (["explain", "kda", "--value-heads", "12"], "--value-heads must be a multiple of H = 8 above it, got 12"),
    (["explain", "simple_gla", "--value-heads", "8"], "--value-heads describes grouped value heads, which simple_gla does not have"),
])
def test_explain_rejects_malformed_descriptions_in_one_line(kernels, capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tops: error: ") and message in err and err.count("\n") == 1


def test_explain_and_bench_share_their_defaults(kernels, capsys):
    from tops_core.cli import build_parser

    parser = build_parser()
    explain, bench = parser.parse_args(["explain", "simple_gla"]), parser.parse_args(["bench"])
    for option in ("shape", "dtype", "with_features", "num_seqs"):
        assert getattr(explain, option) == getattr(bench, option)
    main(["explain", "simple_gla"])
    assert "float32 on cpu" in capsys.readouterr().out
    main(["explain", "simple_gla", "--platform", "tpu"])
    assert "bfloat16 on tpu" in capsys.readouterr().out
    main(["explain", "simple_gla", "--with", "cu_seqlens"])  # packed: the default's tokens in one row
    assert "B=1 T=8192 H=8 K=128 V=128 N=1" in capsys.readouterr().out


def test_the_op_is_named_as_an_argument_or_with_op(kernels, capsys):
    from tops_core.cli import build_parser

    main(["explain", "--op", "simple_gla"])
    assert capsys.readouterr().out.startswith("simple_gla forward: ")
    main(["explain", "simple_gla", "--op", "simple_gla"])
    assert capsys.readouterr().out.startswith("simple_gla forward: ")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--op", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as raised:
        main(["--version"])
    assert raised.value.code == 0
    assert re.match(r"tops-core [\d.]+; jax [\d.]+, jaxlib [\d.]+; Python ", capsys.readouterr().out)


def test_plugins_shows_versions_backend_and_devices(kernels, capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert re.match(r"tops-core .*; jax .*, jaxlib .*\nbackend: cpu; devices: cpu \(cpu:0\)", out)


def test_a_broken_pipe_ends_quietly(tmp_path):
    import subprocess
    import sys

    script = "import sys; from tops_core.cli import main; sys.exit(main(['list']))"
    result = subprocess.run(f"{sys.executable} -c \"{script}\" | head -1", shell=True, capture_output=True, text=True, timeout=120)
    assert result.stdout.startswith("gated_delta_rule:") and "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr


def test_plugins_lists_in_process_plugins(kernels, capsys):
    main(["plugins"])
    out = capsys.readouterr().out
    assert "fake" in out and "(in-process)" in out and "fake.kernel (simple_gla)" in out


def test_list_renders_docstrings_as_plain_one_line_text(registry, capsys):
    def needs_a_host(spec):
        """Reject a call without a host: ``jax.pure_callback`` needs one,
        so the call would fail inside the callback."""

    def by_length(spec):
        """``T`` decides: 10 below 4096 tokens."""
        return 10, "short"

    fakes.register("documented", predicate=needs_a_host, priority=by_length)
    main(["list", "simple_gla"])
    out = capsys.readouterr().out
    assert "    further limits: Reject a call without a host: `jax.pure_callback` needs one, so the call would fail inside the callback.\n" in out
    assert "    priority: depends on the call (`T` decides: 10 below 4096 tokens.)\n" in out
    assert "``" not in out


def test_a_forced_implementation_falling_back_warns_in_one_line(kernels, capsys):
    assert main(["explain", "simple_gla", "--force", "fake.kernel"]) == 0
    err = capsys.readouterr().err
    assert err == ("tops: warning: the forced fake.kernel does not support this call (runs on tpu, this call is on cpu "
                   "(interpret mode is off; TOPS_INTERPRET=1 runs it in Pallas' TPU interpreter)); fell back by priority\n")


@pytest.mark.parametrize("command", ["explain", "bench"])
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_num_seqs_must_be_a_positive_integer(kernels, capsys, command, value):
    with pytest.raises(SystemExit) as raised:
        main([command, "simple_gla", "--shape", "1,64,2,8,8", "--with", "cu_seqlens", "--num-seqs", value])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument --num-seqs: must be a positive integer, got {value!r}" in err and "Traceback" not in err


def test_grouped_value_heads_describe_a_call_with_twice_the_value_heads(kernels, capsys):
    assert main(["explain", "kda", "--with", "grouped_value_heads,use_gate,A_log", "--shape", "1,256,4,64,64"]) in (0, 1)
    out = capsys.readouterr().out
    assert "B=1 T=256 H=4 HV=8 K=64 V=64" in out and "with A_log, grouped_value_heads, use_gate" in out
    assert main(["explain", "kda", "--value-heads", "12", "--shape", "1,256,4,64,64"]) in (0, 1)
    assert "H=4 HV=12" in capsys.readouterr().out
