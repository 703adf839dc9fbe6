"""Packed sequences in simple_gla's xla.chunk: a call with ``cu_seqlens`` against the same tokens unpacked.

    pytest benchmarks/test_xla_packed.py --benchmark-only   # one group per direction: unpacked, N = 16, 256, 1024
    python -m benchmarks.test_xla_packed                   # ratios to the unpacked call (from the repository root)

Issue 27's workload: B=1, T=4096, H=4, K=V=64, float32, ``g_gamma``, jitted, through the public op,
``N`` packed sequences of uneven lengths (``tops_core.bench.packed_lengths``: alternately a third
shorter and a third longer than the mean, so boundaries fall off the chunk grid). The unpacked
call is the same tokens as one sequence. Each program returns the final state too, and its
backward takes a cotangent for it, so that nothing a call with states does is left out.

The report times each packed call in turns with the unpacked call of the same kind
(``interleaved_timings``; not all N together: beside calls with far larger arrays a small call's
fresh pages fault again, which slowed the unpacked call by half) and prints the ratio, in wall
time and in the process's CPU time (which moves less when other jobs share the machine). With ``initial_state`` and ``output_final_state`` a
call reads and writes ``N H K V`` floats of states: at N = 1024 that is 128 MiB against the 16
MiB of ``q, k, v, o``. The report prints both, and times beside them a copy of the states (read
``initial_state``, write a fresh array of its size), the least any call with both states costs
for them: the packed forward against the unpacked forward plus that copy.
"""

from __future__ import annotations

import jax
import pytest

import tops_core
from tops_core import bench
from tops_core.conformance import data
from benchmarks.test_xla_throughput import interleaved_timings, ready, run

SHAPE = (1, 4096, 4, 64, 64)
STATES = ("initial_state", "output_final_state")


def workload(num_seqs: int | None, states: bool = False):
    """The benchmark call, unpacked when ``num_seqs`` is None."""
    features = ["g_gamma", *(STATES if states else ()), *(["cu_seqlens"] if num_seqs else [])]
    return bench.workload("simple_gla", SHAPE, "float32", features, num_seqs=num_seqs)


def programs(case):
    """``(forward, forward+backward)`` of xla.chunk on the case's data, jitted, ready to call."""
    op = tops_core.op("simple_gla")
    inputs = data.forward_inputs(case)
    cotangents = data.backward_inputs(case, inputs)
    arrays = {name: x for name, x in inputs.items() if isinstance(x, jax.Array) and name != "cu_seqlens"}
    options = {name: x for name, x in inputs.items() if name not in arrays}

    def forward(arrays):
        return op.forward(**arrays, **options, implementation="xla.chunk")

    def forward_backward(arrays, do, dht):
        outputs, pullback = jax.vjp(forward, arrays)
        return outputs, pullback((do, dht))

    both = (arrays, cotangents["do"], cotangents.get("dht"))
    return ready(jax.jit(forward), (arrays,)), ready(jax.jit(forward_backward), both)


def states_copy(case):
    """What any call with both states moves for them alone: ``initial_state`` read, a fresh final state written."""
    h0 = data.forward_inputs(case)["initial_state"]
    return ready(jax.jit(lambda h0: h0 * 2), (h0,))


# -- pytest-benchmark: one group per direction ---------------------------------------------------


@pytest.mark.parametrize("direction", ["forward", "forward+backward"])
@pytest.mark.parametrize("num_seqs", [None, 16, 256, 1024], ids=["unpacked", "N=16", "N=256", "N=1024"])
def test_packed(benchmark, num_seqs, direction):
    forward, forward_backward = programs(workload(num_seqs))
    run(benchmark, f"packed-T4096-H4-K64-V64-g_gamma {direction}", forward if direction == "forward" else forward_backward)


# -- the report --------------------------------------------------------------------------------


def report(rounds: int = 7, num_seqs=(1, 16, 256, 1024, 4096)) -> None:
    B, T, H, K, V = SHAPE
    token_mib = T * H * (2 * K + 2 * V) * 4 / 2**20
    print(f"xla.chunk, B={B} T={T} H={H} K={K} V={V} float32 g_gamma, jitted; {jax.devices()[0].device_kind}")
    print(f"each N in turns with the unpacked call alone (a call with far larger arrays beside it slows a small one's")
    print(f"fresh pages); medians of {rounds} rounds, ratios in wall time (process CPU time)")
    for states in (False, True):
        print("with initial_state and output_final_state" if states else "without states")
        unpacked = programs(workload(None, states))
        for n in num_seqs:
            packed = programs(workload(n, states))
            calls = {(name, direction): program for name, pair in (("unpacked", unpacked), ("packed", packed))
                     for direction, program in zip(("forward", "forward+backward"), pair)}
            if states:
                calls["states copy", None] = states_copy(workload(n, states))
            timings = interleaved_timings(calls, rounds)
            cells = []
            for direction in ("forward", "forward+backward"):
                (wall, cpu), (wall0, cpu0) = timings["packed", direction], timings["unpacked", direction]
                cells.append(f"{direction} {wall0 * 1e3:6.1f} -> {wall * 1e3:7.1f} ms {wall / wall0:5.2f}x ({cpu / cpu0:4.2f}x)")
            state_mib = ""
            if states:
                copy = timings["states copy", None][0]
                floor = timings["unpacked", "forward"][0] + copy
                state_mib = (f"  states {2 * n * H * K * V * 4 / 2**20:6.1f} MiB vs tokens {token_mib:.0f} MiB; copying them "
                             f"{copy * 1e3:.1f} ms, forward {timings['packed', 'forward'][0] / floor:.2f}x unpacked + copy")
            print(f"  N={n:<5d} " + "   ".join(cells) + state_mib)


if __name__ == "__main__":
    report()
