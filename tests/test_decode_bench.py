"""``tops bench --decode``: a decode step on a state pool, each implementation beside the hand-written step."""

import json

import pytest

from tops_core import decode_bench
from tops_core.cli import main


def test_decode_steps_are_timed_beside_the_hand_written_step_and_checked(clean_env, capsys):
    assert main(["bench", "--decode", "--shape", "4,2,2,8,8", "--budget", "0.05", "--tpu", "none"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("decode step: simple_gla B=4 T=2 H=2 K=8 V=8 float32, a pool of 8 rows (donated); g; on cpu\n")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:]}
    assert set(rows) == {"hand-written", "xla.recurrent", "xla.chunk"}
    assert rows["hand-written"][4] == "1.00x"  # name, time, unit, spread, ratio
    assert all(float(row[-1]) < 1e-5 and float(row[-2]) < 1e-5 for row in rows.values())  # o and the pool, float32


def test_decode_json_has_every_figure(clean_env, capsys):
    argv = ["bench", "kda", "--decode", "--shape", "3,1,2,8,8", "--with", "use_qk_l2norm,grouped_value_heads,use_gate,A_log,dt_bias",
            "--pool", "5", "--budget", "0.05", "--tpu", "none", "--json"]
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["workload"].startswith("decode step: kda B=3 T=1 H=2 HV=4 K=8 V=8 float32, a pool of 5 rows (donated)")
    rows = {row["implementation"]: row for row in document["rows"]}
    assert set(rows) == {"hand-written", "xla.recurrent", "xla.chunk"} and document["modelled_tpu"] is None
    for row in rows.values():  # the hand-written step is the same math: it matches the reference too
        assert row["within_tolerance"] and row["errors"]["o"] < 1e-5 and row["errors"]["pool"] < 1e-5
        assert row["median_s"] > 0 and row["ratio_to_hand_written"] == pytest.approx(row["median_s"] / row["hand_written_median_s"])


@pytest.mark.parametrize("argv, message", [
    (["bench", "--pool", "8"], "--pool sizes the state pool of a decode step: use it with --decode"),
    (["bench", "--decode", "--with", "g,cu_seqlens"], "a decode step runs B requests of T tokens each; packed prefill"),
    (["bench", "--decode", "--shape", "4,1,2,8,8", "--pool", "3"], "the pool must hold a row for each of the B = 4 requests, got 3 rows"),
    (["bench", "--decode", "--num-seqs", "2"], "--num-seqs packs sequences for prefill"),
])
def test_decode_arguments_are_checked_in_one_line(clean_env, capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tops: error: ") and message in err and err.count("\n") == 1


def test_the_decode_step_is_modelled_on_a_compile_only_tpu(clean_env):
    B, H, K, V = 64, 8, 128, 128  # the decode step: compiled, not run, so full size costs nothing
    decode = decode_bench.workload("simple_gla", (B, 1, H, K, V), "float32", ["g"], None)
    try:
        model = decode_bench.model_on_tpu(decode, "v6e")
    except RuntimeError as error:
        if "CompileOnlyUnavailable" in str(error):
            pytest.skip(str(error).splitlines()[-1])
        raise
    floor = 2 * B * H * K * V * 4 + B * H * (2 * K + 2 * V) * 4 + B * H * 4  # rows in and out; q, k, v, o; g
    assert model["implementation"] == "tpu_pallas.recurrent" and model["floor_bytes"] == floor
    assert model["bytes_accessed"] >= floor and model["ratio_to_floor"] == model["bytes_accessed"] / floor
    assert model["ratio_to_floor"] <= 1.1, "the Pallas decode kernel moves each row once, in place"
