"""Split calls equal one device's: batch, heads and the sequence over 2, 4 and 8 devices, forward and every gradient.

A worker process (``sharded_worker.py``) has 8 CPU devices (this process already initialised JAX
with one). Each case runs the public op on one device and split over a mesh, through
``jax.vjp`` with the conformance kit's data and cotangents, and compares every result with
docs/ops.md's tolerances: splits by ``tops_core.parallel.shard``, by sharded inputs under plain
``jit`` (``custom_partitioning``), and by inputs typed over explicit mesh axes. Packed sequences
cross device boundaries, start exactly on them, or are empty. The compiled programs' collectives
show what crosses devices: ``dg_gamma`` alone for batch and heads, states (never tokens) for the
sequence, the same whatever ``T``. The same calls compile for a 4-chip TPU (compile-only, libtpu),
the Pallas kernel running on every chip's block.

``-m slow`` runs the float64 sweep: every packing and gate combination of simple_gla over 2, 4 and 8 devices (the
other ops' sequences: three packings, with and without states), against one device to 1e-10 / 1e-9 and against the
float64 reference.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

import tops_core
from tops_core.tpu import compile_only

ALL = ["g", "g_gamma", "initial_state", "output_final_state"]
BASE = dict(dtype="float32", features=ALL, H=4, K=16, V=16)

CASES = [
    dict(BASE, name="batch-heads-8-auto", mode="auto", mesh=[2, 4], split={"batch": 0, "heads": 1}, B=4, T=64),
    dict(BASE, name="batch-heads-shard", mode="shard", mesh=[2, 2, 2], split={"batch": 0, "heads": 2}, B=4, T=64, backward=True),
    dict(BASE, name="sequence-2-packed", mode="shard", mesh=[2], split={"sequence": 0}, T=64, seqlens=[5, 0, 20, 8, 0, 31]),
    # 16 tokens per device: sequences start and end exactly on device boundaries, and are empty there.
    dict(BASE, name="sequence-4-packed-on-boundaries", mode="shard", mesh=[4], split={"sequence": 0}, T=64,
         seqlens=[16, 16, 0, 16, 1, 15, 0]),
    dict(BASE, name="sequence-8-packed-auto", mode="auto", mesh=[8], split={"sequence": 0}, T=64, seqlens=[3, 60, 1]),
    dict(BASE, name="sequence-8-rows-strong-scalar-gamma", mode="shard", mesh=[8], split={"sequence": 0}, B=2, T=64,
         strong_decay=True, scalar_gamma=True),
    dict(BASE, name="batch-sequence-heads-types", mode="types", mesh=[2, 2, 2], split={"batch": 0, "sequence": 1, "heads": 2}, B=2, T=64),
    dict(BASE, name="sequence-over-two-axes-bf16", mode="shard", mesh=[2, 2], split={"sequence": [0, 1]}, B=2, T=128,
         dtype="bfloat16", features=["g_gamma", "output_final_state"]),
    dict(BASE, op="kda", name="kda-batch-heads-shard", mode="shard", mesh=[2, 4], split={"batch": 0, "heads": 1}, B=2, T=32,
         features=["initial_state", "output_final_state", "use_qk_l2norm"], backward=True),
    dict(BASE, op="kda", name="kda-batch-heads-auto", mode="auto", mesh=[2, 4], split={"batch": 0, "heads": 1}, B=2, T=32,
         features=["initial_state", "output_final_state"]),
    dict(BASE, op="kda", name="kda-heads-packed", mode="shard", mesh=[4], split={"heads": 0}, T=40, seqlens=[7, 0, 33],
         features=["initial_state", "output_final_state"]),
    # Grouped value heads split with their query/key heads; the gate's parameters split per value head, their
    # gradients summed over the batch's devices (through jax.vjp; the explicit backward is the same staging).
    dict(BASE, op="kda", name="kda-grouped-gated-batch-heads", mode="shard", mesh=[2, 2], split={"batch": 0, "heads": 1}, B=2, T=32,
         H=2, HV=6, features=["initial_state", "output_final_state", "use_gate", "A_log", "dt_bias", "lower_bound",
                              "use_beta_sigmoid", "grouped_value_heads"]),
    # The ops added through declarations alone: their dims say how each array splits.
    dict(BASE, op="gla", name="gla-batch-heads-shard", mode="shard", mesh=[2, 2], split={"batch": 0, "heads": 1}, B=2, T=32,
         features=["initial_state", "output_final_state"], backward=True),
    # gla's state decays per key: its sequence splits as simple_gla's, each device's map carrying a decay per key.
    dict(BASE, op="gla", name="gla-sequence-4-packed", mode="shard", mesh=[4], split={"sequence": 0}, T=64,
         seqlens=[16, 5, 0, 30, 13], features=["initial_state", "output_final_state"]),
    # The delta rule's sequence: each device's map carries a K x K matrix (tops_core/ops/delta_sequence.py).
    dict(BASE, op="gated_delta_rule", name="gated_delta_rule-sequence-4-packed-grouped", mode="shard", mesh=[4],
         split={"sequence": 0}, T=64, seqlens=[16, 5, 0, 30, 13], H=2, HV=4,
         features=["initial_state", "output_final_state", "use_qk_l2norm", "grouped_value_heads"]),
    dict(BASE, op="kda", name="kda-sequence-4-rows-gated", mode="shard", mesh=[4], split={"sequence": 0}, B=2, T=64, H=2,
         features=["initial_state", "output_final_state", "use_qk_l2norm", "use_gate", "A_log", "dt_bias", "lower_bound",
                   "use_beta_sigmoid"]),
    dict(BASE, op="gated_delta_rule", name="gated_delta_rule-grouped-heads-packed", mode="shard", mesh=[2], split={"heads": 0},
         T=40, seqlens=[7, 0, 33], H=2, HV=4, features=["initial_state", "output_final_state", "use_qk_l2norm", "grouped_value_heads"]),
]

KDA_GROUPED = next(case for case in CASES if case["name"] == "kda-grouped-gated-batch-heads")

# Unsharded inputs split over explicit mesh axes (jax.make_mesh's default): shard_map refuses an
# input whose type does not match its in_specs there, so the op reshards them to the split. The
# reshard is the core's, whatever the kernel: kda's runs the reference, which compiles in no time.
UNSHARDED_OVER_EXPLICIT_AXES = [
    dict(BASE, name="sequence-4-explicit-unplaced", mode="shard", explicit=True, unplaced=True, mesh=[4], split={"sequence": 0},
         B=2, T=64, backward=True),
    dict(BASE, op="kda", name="kda-batch-heads-explicit-unplaced", mode="shard", explicit=True, unplaced=True, mesh=[2, 4],
         split={"batch": 0, "heads": 1}, B=2, T=32, features=["initial_state", "output_final_state"], backward=True, force="ref.recurrent"),
]


def _expected_results(case: dict) -> set[str]:
    features = set(case["features"])
    features |= set(tops_core.op(case.get("op", "simple_gla")).gate_inputs(frozenset(features)))  # kda's g and beta are always given
    results = {"o", "dq", "dk", "dv"} | {"d" + name for name in ("g", "g_gamma", "beta", "initial_state", "A_log", "dt_bias") if name in features}
    return results | ({"final_state"} if "output_final_state" in features else set())


class Worker:
    """The process with 8 CPU devices (``sharded_worker.py``): one JSON request per line in, one JSON answer per line out."""

    def __init__(self, *arguments: str):
        script = str(Path(__file__).with_name("sharded_worker.py"))
        # Over the caller's flags (the root conftest's compile settings), not instead of them; the CPU backend's own
        # apart (``sharded_worker.start_the_cpu_backend``), since the worker loads libtpu too.
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
        self.process = compile_only.LineWorker([script, *arguments], {"XLA_FLAGS": flags, "CPU_BACKEND_XLA_FLAGS": flags})
        self.answers: dict[str, dict] = {}

    def ask(self, kind: str, case: dict, *, failing: bool = False) -> dict:
        request = json.dumps({kind: case}, sort_keys=True)
        if request not in self.answers:  # tests asking the same question share the (slow) answer
            line = self.process.ask(request)
            if line is None:
                pytest.fail(f"the worker stopped:\n{self.process.stderr_tail()}")
            self.answers[request] = json.loads(line)
        answer = self.answers[request]
        if ("error" in answer) != failing:
            pytest.fail(f"{kind} {case['name']}: " + answer.get("error", f"succeeded, expected an error: {answer}"))
        return answer

    def close(self):
        self.process.close()


@pytest.fixture(scope="module")
def worker():
    started = Worker()
    yield started
    started.close()


def assert_within_tolerance(case: dict, answer: dict) -> None:
    failures = [f"{name}: {error:.2e} > {answer['tolerances'][name]:.0e}" for name, error in answer["errors"].items() if not error <= answer["tolerances"][name]]
    assert not failures, f"{case['name']}: " + "; ".join(failures)


# Splits beyond kda's grouped and gated one and simple_gla's (the ops added through declarations split by their dims as
# kda's do), and packed sequence splits beyond the one over 4 devices, forward and backward, with sequences on the
# devices' boundaries (sequence-2-packed's exchange still compiles by default, in the test of what crosses devices).
# kda's sequence (23 s) shares delta_sequence with gated_delta_rule's, and gla's (10 s) diagonal_sequence with
# simple_gla's, which run by default (gla's per-key decays in the float64 sweep too).
SLOW = {
    "kda-batch-heads-shard", "kda-batch-heads-auto", "kda-heads-packed", "gla-batch-heads-shard", "gated_delta_rule-grouped-heads-packed",
    "sequence-8-packed-auto", "sequence-2-packed", "kda-sequence-4-rows-gated", "gla-sequence-4-packed",
    # 10 s: the default run keeps a packed sequence split (simple_gla's) and grouped heads split (kda's).
    "gated_delta_rule-sequence-4-packed-grouped",
}


@pytest.mark.parametrize(
    "case", [pytest.param(case, marks=pytest.mark.slow) if case["name"] in SLOW else case for case in CASES + UNSHARDED_OVER_EXPLICIT_AXES],
    ids=lambda case: case["name"],
)
def test_a_split_call_equals_one_device_forward_and_every_gradient(worker, case):
    answer = worker.ask("compare", case)
    results = _expected_results(case)
    if case.get("backward"):
        results |= {"backward " + name for name in results if name.startswith("d")}
    assert set(answer["errors"]) == results
    assert_within_tolerance(case, answer)
    # o comes back split as its inputs were
    expected = [None] * 4
    for dimension, axes in case["split"].items():
        expected[{"batch": 0, "sequence": 1, "heads": 2}[dimension]] = [f"axis{i}" for i in axes] if isinstance(axes, list) else f"axis{axes}"
    assert answer["o_spec"] == expected


def test_batch_and_heads_exchange_only_the_sum_of_dg_gamma(worker):
    case = CASES[1]
    collectives = worker.ask("compare", case)["collectives"]
    heads_per_device = case["H"] // case["mesh"][case["split"]["heads"]]
    assert collectives == [["all-reduce", f"f32[{heads_per_device}]", 4 * heads_per_device]]


# The packed case with -m slow (its exchange: 8 s); the rows case here and the TPU one below run by default.
@pytest.mark.parametrize("case", [pytest.param(CASES[2], marks=pytest.mark.slow), CASES[5]], ids=lambda case: case["name"])
def test_the_sequence_exchanges_states_whose_size_does_not_depend_on_T(worker, case):
    devices = math.prod(case["mesh"])
    longer = dict(case, T=4 * case["T"], seqlens=[4 * n for n in case["seqlens"]] if case.get("seqlens") else None)
    short, long = worker.ask("collectives", case)["collectives"], worker.ask("collectives", longer)["collectives"]
    assert sorted(short) == sorted(long)  # nothing that crosses devices grows with T
    rows = 1 if case.get("seqlens") else case["B"]
    sequences = len(case["seqlens"]) if case.get("seqlens") else case["B"]
    state, decays = 4 * rows * case["H"] * case["K"] * case["V"], 4 * rows * case["H"]
    permutes = [size for opcode, _, size in short if opcode == "collective-permute"]
    assert set(permutes) <= {state, decays}
    # one scan forward, one back (and the forward's again unless XLA shares it): a shift and ceil(log2(P - 1)) rounds each
    state_permutes = permutes.count(state)
    assert 2 * (1 + math.ceil(math.log2(devices - 1))) <= state_permutes <= 3 * (1 + math.ceil(math.log2(devices - 1)))
    # the rest: sums of the outputs without a time axis (final states, dinitial_state, dg_gamma), all of them O(N H K V)
    others = [(opcode, size) for opcode, _, size in short if opcode != "collective-permute"]
    assert {opcode for opcode, _ in others} == {"all-reduce"}
    assert sum(size for _, size in others) <= 4 * case["H"] * (2 * sequences * case["K"] * case["V"] + 1)


def test_a_sequence_that_does_not_divide_evenly_is_refused_with_the_reason(worker):
    uneven = dict(CASES[2], name="uneven", T=66, seqlens=[5, 0, 20, 8, 0, 33], mesh=[4], unplaced=True)
    error = worker.ask("compare", uneven, failing=True)["error"]
    assert "cannot split the sequence over mesh axis 'axis0': T=66 is not divisible by its 4 devices" in error


def test_a_call_inside_set_mesh_with_unsharded_inputs_runs_whole(worker):
    # The partitioner then hands custom_partitioning's callback an empty mesh, which has no platform.
    case = dict(BASE, name="set-mesh-unplaced", mode="auto", set_mesh=True, explicit=True, unplaced=True, mesh=[4], split={"batch": 0},
                B=4, T=32)
    answer = worker.ask("compare", case)
    assert_within_tolerance(case, answer)
    assert answer["o_spec"] == [None] * 4


def test_an_implementation_on_the_host_runs_whole_under_sharded_inputs(worker):
    # JAX crashes running a host callback (the float64 reference, forced here) inside
    # custom_partitioning on several devices: such a call is left whole, gathered, and right.
    case = dict(KDA_GROUPED, name="kda-auto-host", mode="auto", force="ref.recurrent")
    answer = worker.ask("compare", case)
    assert_within_tolerance(case, answer)
    assert answer["o_spec"] == [None] * 4
    assert "all-gather" in {opcode for opcode, _, _ in answer["collectives"]}


# -- compiled for a 4-chip TPU ------------------------------------------------------------------

TPU = dict(dtype="bfloat16", features=["g_gamma", "output_final_state"], generation="v5p", B=4, T=256, H=4, K=128, V=128)


@pytest.fixture
def libtpu():
    pytest.importorskip("libtpu", reason="compiling for TPU without one needs libtpu (the test extra installs it)")


def test_tpu_batch_and_heads_run_the_pallas_kernel_on_every_chip(worker, libtpu):
    answer = worker.ask("tpu", dict(TPU, name="tpu-batch-heads", mode="shard", mesh=[2, 2], split={"batch": 0, "heads": 1}))
    assert answer["kernels"] == 1 + 1  # the fused forward and its backward's gradients kernel (one segment: no walk)
    assert answer["implementations"] == ["tpu_pallas.fused.backward", "tpu_pallas.fused.forward"]
    assert answer["collectives"] == [["all-reduce", "f32[2]", 8]]  # dg_gamma of the chip's 2 heads


# The other ops with -m slow (13 to 22 s each): gla's chips exchange a decay per key, f32[B, H, K], beside each state;
# the delta rule's a K x K matrix. By default one T (the permutes are state-sized, and the CPU test above compares
# two T); with -m slow a second, longer T exchanges the same collectives.
@pytest.mark.parametrize("op", ["simple_gla", *(pytest.param(op, marks=pytest.mark.slow) for op in ("gla", "kda", "gated_delta_rule"))])
@pytest.mark.parametrize("longer_T", [None, pytest.param(1024, marks=pytest.mark.slow)], ids=["T256", "T256-and-1024"])
def test_tpu_sequence_exchanges_states_the_same_whatever_T(worker, libtpu, op, longer_T):
    case = dict(TPU, op=op, name="tpu-sequence", mode="shard", mesh=[4], split={"sequence": 0})
    if op != "simple_gla":
        case["features"] = ["output_final_state"]
    short = worker.ask("tpu", dict(case, T=256))
    assert short["implementations"] == ["tpu_pallas.fused.backward", "tpu_pallas.fused.forward"]
    if longer_T is not None:
        assert sorted(short["collectives"]) == sorted(worker.ask("tpu", dict(case, T=longer_T))["collectives"])
    state = 4 * case["B"] * case["H"] * case["K"] * case["V"]
    decays = 4 * case["B"] * case["H"] * {"simple_gla": 1, "gla": case["K"]}.get(op, case["K"] * case["K"])
    assert {size for opcode, _, size in short["collectives"] if opcode == "collective-permute"} == {state, decays}


def test_tpu_explicit_mesh_axes_split_without_being_asked(worker, libtpu):
    answer = worker.ask("tpu", dict(TPU, name="tpu-types", mode="types", mesh=[2, 2], split={"batch": 0, "sequence": 1}))
    assert answer["kernels"] == 1 + 1 and "tpu_pallas.fused.forward" in answer["implementations"]


@pytest.mark.parametrize("explicit_backward", [False, True], ids=["vjp", "backward"])
def test_tpu_sharded_inputs_without_a_split_say_how_to_split(worker, libtpu, explicit_backward):
    # TPU compilers cannot run custom_partitioning's callback, and Pallas kernels run on several
    # devices only inside shard_map: the error says what to do, for the backward kernels alone too.
    case = dict(TPU, name="tpu-auto", mode="auto", mesh=[4], split={"batch": 0}, explicit_backward=explicit_backward)
    answer = worker.ask("tpu", case)
    assert "tops_core.parallel.shard(mesh, batch=..., heads=..., sequence=...)" in answer["error_text"]


# -- the float64 sweep --------------------------------------------------------------------------

PACKINGS = [None, [5, 0, 20, 8, 0, 31], [16, 16, 0, 16, 1, 15], [64], [0, 64, 0], [1] * 8 + [56], [3, 60, 1]]
VARIANTS = [ALL, ["g"], ["g_gamma", "output_final_state"], ["initial_state"]]
# The other ops (their gates always given): fewer packings and options, the same devices.
OTHER_PACKINGS = [None, [5, 0, 20, 8, 0, 31], [1] * 8 + [56]]
OTHER_VARIANTS = [["initial_state", "output_final_state"], []]
OTHER_ALL = OTHER_VARIANTS[0]


def sweep() -> list[dict]:
    cases = []
    for devices in (2, 4, 8):
        others = [(op, OTHER_PACKINGS, OTHER_VARIANTS) for op in ("gla", "kda", "gated_delta_rule")]
        for op, packings, variants in [("simple_gla", PACKINGS, VARIANTS), *others]:
            for packing in packings:
                for features in variants:
                    name = f"{op}-P{devices}-{'rows' if packing is None else '-'.join(map(str, packing))}-{'+'.join(features) or 'g'}"
                    cases.append(dict(
                        op=op, name=name, mode="shard", mesh=[devices], split={"sequence": 0}, dtype="float64", B=2, T=64, H=2, K=8,
                        V=8, features=features, seqlens=packing,
                    ))
    return cases


@pytest.fixture(scope="module")
def worker64():
    started = Worker("--x64")
    yield started
    started.close()


@pytest.mark.slow
@pytest.mark.parametrize("case", sweep(), ids=lambda case: case["name"])
def test_float64_sequence_split_is_exact(worker64, case):
    assert_within_tolerance(case, worker64.ask("compare", case))


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in sweep() if c["mesh"] == [8] and c["features"] in (ALL, OTHER_ALL)], ids=lambda case: case["name"])
def test_float64_sequence_split_against_the_reference(worker64, case):
    assert_within_tolerance(case, worker64.ask("compare", dict(case, against="ref.recurrent", strong_decay=True)))


def test_tpu_batch_and_heads_hand_the_forwards_residuals_to_the_backward_on_every_chip(worker, libtpu):
    # kda's backward walks every chunk for its states and inverses unless its forward hands them on
    # (Implementation.residuals): split over the batch and the heads, each chip's forward hands on its own.
    case = dict(TPU, op="kda", name="tpu-kda-batch-heads", mode="shard", mesh=[2, 2], split={"batch": 0, "heads": 1},
                features=["output_final_state"])
    answer = worker.ask("tpu", case)
    assert answer["implementations"] == ["tpu_pallas.fused.backward", "tpu_pallas.fused.forward"]
    assert answer["kernels"] == 1 + 1  # the forward, writing the states and inverses too, and the gradients kernel
