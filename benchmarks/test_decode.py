"""A decode step on a state pool: the public op against a hand-written jax.numpy step of the same math.

    pytest benchmarks/test_decode.py --benchmark-only      # timings, one group per op
    python benchmarks/test_decode.py                       # the same as tops bench --decode, for both ops

The workload is ``tops bench --decode``'s (``tops_core.decode_bench``): B=64 running requests,
one token each, H=8, K=V=128, float32, their states in a pool of 128 rows (``ssm_state_indices``),
updated in place (``donate_argnums``). ``hand-written`` gathers the rows, runs the recurrence's
step and scatters the rows back: the least a decode step can do. ``tops`` is the op as a user
calls it (the dispatcher picks ``xla.recurrent``); ``tops xla.chunk`` forces the chunked kernel,
which pads the token to a chunk.
"""

from __future__ import annotations

import jax
import pytest

from tops_core import decode_bench
from tops_core.ops.base import platform_of


def workload(op: str) -> decode_bench.Decode:
    return decode_bench.workload(op, decode_bench.DEFAULT_SHAPE, "float32", decode_bench.DEFAULT_FEATURES[op], None)


STEPS = {
    "hand-written": lambda decode, inputs: decode_bench.hand_written_step(decode, inputs),
    "tops": lambda decode, inputs: decode_bench.tops_step(decode, None, inputs),
    "tops xla.chunk": lambda decode, inputs: decode_bench.tops_step(decode, "xla.chunk", inputs),
}


@pytest.mark.parametrize("name", list(STEPS))
@pytest.mark.parametrize("op", ["simple_gla", "kda"])
def test_decode_step(benchmark, op, name):
    decode = workload(op)
    pool, inputs = decode_bench.arrays(decode)
    step = STEPS[name](decode, inputs)
    state = {"pool": pool}
    arrays = {key: value for key, value in inputs.items() if isinstance(value, jax.Array)}

    def call():
        _, state["pool"] = step(state["pool"], arrays)
        jax.block_until_ready(state["pool"])

    call()
    benchmark.group = decode.describe()
    benchmark(call)


if __name__ == "__main__":
    for op in ("simple_gla", "kda"):
        decode = workload(op)
        print(decode_bench.format_rows(decode, decode_bench.run(decode), platform_of([])) + "\n")
