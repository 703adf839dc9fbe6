"""A decode step on a state pool: the public op against a hand-written jax.numpy step of the same math.

    pytest benchmarks/test_decode.py --benchmark-only      # timings, one group per op
    python benchmarks/test_decode.py                       # medians and ratios, interleaved in one process

The workload is a server's decode step: B=64 running requests, one token each, H=8, K=V=128,
float32, their states in a pool of 128 rows (``ssm_state_indices``), updated in place
(``donate_argnums``). The hand-written step gathers the rows, runs the recurrence's step and
scatters the rows back: the least a decode step can do. ``tops`` is the op as a user calls it (the
dispatcher picks ``xla.recurrent``); ``tops xla.chunk`` forces the chunked kernel, which pads the
token to a chunk.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import pytest

import tops_core

B, H, K, V, POOL = 64, 8, 128, 128, 128
SCALE = K**-0.5


def inputs(op: str, seed: int = 0) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    HV = H
    arrays = dict(
        q=jax.random.normal(keys[0], (B, 1, H, K), jnp.float32),
        k=jax.random.normal(keys[1], (B, 1, H, K), jnp.float32) * K**-0.5,
        v=jax.random.normal(keys[2], (B, 1, HV, V), jnp.float32),
        pool=jax.random.normal(keys[3], (POOL, HV, K, V), jnp.float32),
        indices=jax.random.permutation(keys[4], POOL)[:B].astype(jnp.int32),
    )
    if op == "simple_gla":
        arrays["g"] = -jax.nn.softplus(jax.random.normal(keys[5], (B, 1, H), jnp.float32))
    else:
        arrays["g"] = -jax.nn.softplus(jax.random.normal(keys[5], (B, 1, HV, K), jnp.float32))
        arrays["beta"] = jax.nn.sigmoid(jax.random.normal(keys[5], (B, 1, HV), jnp.float32))
    return arrays


def tops_step(op: str, implementation: str | None = None):
    contract = tops_core.op(op)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(pool, arrays):
        gates = dict(g=arrays["g"]) if op == "simple_gla" else dict(g=arrays["g"], beta=arrays["beta"])
        return contract.forward(
            arrays["q"], arrays["k"], arrays["v"], **gates, scale=SCALE, initial_state=pool, output_final_state=True,
            ssm_state_indices=arrays["indices"], implementation=implementation,
        )

    return step


def hand_written_step(op: str):
    """The same math, written directly: gather the rows, one step of the recurrence, scatter the rows back."""

    @functools.partial(jax.jit, donate_argnums=0)
    def step(pool, arrays):
        q, k, v, g = (arrays[name][:, 0] for name in ("q", "k", "v", "g"))
        state = pool[arrays["indices"]]
        if op == "simple_gla":
            state = jnp.exp(g)[..., None, None] * state + k[..., :, None] * v[..., None, :]
        else:
            state = jnp.exp(g)[..., :, None] * state
            delta = arrays["beta"][:, 0, :, None] * (v - jnp.einsum("bhk,bhkv->bhv", k, state))
            state = state + k[..., :, None] * delta[..., None, :]
        o = jnp.einsum("bhk,bhkv->bhv", q * SCALE, state)
        return o[:, None], pool.at[arrays["indices"]].set(state)

    return step


STEPS = {
    "hand-written": hand_written_step,
    "tops": tops_step,
    "tops xla.chunk": lambda op: tops_step(op, "xla.chunk"),
}


class Loop:
    """Runs a donating step again and again, feeding each call the pool the last one returned."""

    def __init__(self, op: str, name: str):
        self.step, self.arrays = STEPS[name](op), inputs(op)
        self.pool = self.arrays.pop("pool")
        self()

    def __call__(self):
        o, self.pool = self.step(self.pool, self.arrays)
        jax.block_until_ready(self.pool)


@pytest.mark.parametrize("name", list(STEPS))
@pytest.mark.parametrize("op", ["simple_gla", "kda"])
def test_decode_step(benchmark, op, name):
    benchmark.group = f"decode {op} B={B} T=1 H={H} K=V={K} float32 pool {POOL}"
    benchmark(Loop(op, name))


def report(repeats: int = 30) -> None:
    """Medians of interleaved calls, and each one's ratio to the hand-written step."""
    for op in ("simple_gla", "kda"):
        loops = {name: Loop(op, name) for name in STEPS}
        times = {name: [] for name in STEPS}
        for _ in range(repeats):
            for name, loop in loops.items():
                start = time.perf_counter()
                loop()
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["hand-written"])
        print(f"decode {op}: B={B} T=1 H={H} K=V={K} float32, pool {POOL}, {jax.devices()[0].platform}")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"  {name:<15} {median * 1e3:8.3f} ms   {median / base:5.2f}x the hand-written step")


if __name__ == "__main__":
    report()
