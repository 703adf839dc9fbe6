"""Throughput of xla.chunk (simple_gla) against a float32 matmul measured in the same process.

    pytest benchmarks/test_xla_throughput.py --benchmark-only     # timings, one group per workload
    python benchmarks/test_xla_throughput.py                     # GFLOP/s and ratios to the matmul

FLOPs: the forward counts ``B*H*T*(4*K*V + 2*C*(K+V))`` (the chunked algorithm's matrix
products, causal triangles counted whole; ``tops_core.bench.forward_flops``, which ``tops bench``
uses too); forward+backward counts 3x that. The backward here
really does 2.5x the forward's products (state recompute, then dq, dk, dv and dS), so the
forward+backward figure understates the arithmetic done by about 15%. The reference matmul is a
jitted ``jnp.dot`` of two 2048x2048 float32 matrices.

Timings on a shared CPU are noisy: the report interleaves the matmul and the workloads, takes
medians, and states ratios measured in one process.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import pytest

import tops_core
from tops_core import bench

B, T, H, K, V = 2, 4096, 8, 128, 128
MATMUL_N = 2048


def matmul_program():
    a = jax.random.normal(jax.random.PRNGKey(0), (MATMUL_N, MATMUL_N), jnp.float32)
    return jax.jit(jnp.dot), (a, a), 2 * MATMUL_N**3


def inputs(seq_len: int):
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    q = jax.random.normal(keys[0], (B, seq_len, H, K), jnp.float32) * K**-0.5
    k = jax.random.normal(keys[1], (B, seq_len, H, K), jnp.float32) * K**-0.5
    v = jax.random.normal(keys[2], (B, seq_len, H, V), jnp.float32)
    do = jax.random.normal(keys[3], (B, seq_len, H, V), jnp.float32)
    g_gamma = -(2.0 ** (-8.0 * (jnp.arange(H) + 1) / H))  # ALiBi slopes
    return q, k, v, g_gamma, do


def forward_flops(seq_len: int, chunk_size: int) -> float:
    return bench.forward_flops(bench.workload("simple_gla", (B, seq_len, H, K, V), "float32", ["g_gamma"]), chunk_size)


def simple_gla_programs(seq_len: int = T, chunk_size: int = 64):
    """Jitted forward and forward+backward of xla.chunk through the public op, with their inputs."""
    op = tops_core.op("simple_gla")
    implementation = ("xla.chunk", {"chunk_size": chunk_size})

    def forward(q, k, v, g_gamma):
        return op.forward(q, k, v, g_gamma=g_gamma, implementation=implementation)[0]

    def loss(q, k, v, g_gamma, do):
        return jnp.sum(forward(q, k, v, g_gamma) * do)

    q, k, v, g_gamma, do = inputs(seq_len)
    forward_backward = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    return jax.jit(forward), (q, k, v, g_gamma), forward_backward, (q, k, v, g_gamma, do)


def product_programs(chunk_size: int = 64):
    """One of the forward's two state products (``2*K*V`` FLOPs per token each) alone, in two shapes.

    ``flat``: one ``[B*T*H, K] @ [K, V]`` product, as if every token shared one state, the most
    favourable shape any algorithm with these head dims could have. ``per chunk``: the shape a
    chunked algorithm needs, one ``[B*H, C, K] @ [B*H, K, V]`` batched product per chunk in a
    loop, output written in place. Their rates bound what the chunked forward can reach.
    """
    keys = jax.random.split(jax.random.PRNGKey(2), 2)
    queries = jax.random.normal(keys[0], (T // chunk_size, B * H, chunk_size, K), jnp.float32)
    state = jax.random.normal(keys[1], (B * H, K, V), jnp.float32)

    def per_chunk(queries, state):
        def step(n, out):
            return out.at[n].set(jnp.einsum("bik,bkv->biv", queries[n], state))
        out = jnp.zeros(queries.shape[:-1] + (V,), jnp.float32)
        return jax.lax.fori_loop(0, queries.shape[0], step, out)

    flops = 2 * B * T * H * K * V
    flat = (jax.jit(jnp.dot), (queries.reshape(-1, K), state[0]), flops)
    return {"flat product": flat, "per-chunk products": (jax.jit(per_chunk), (queries, state), flops)}


def ready(program, args):
    return lambda: jax.block_until_ready(program(*args))


# -- pytest-benchmark: one group per workload -------------------------------------------------


@pytest.fixture(scope="module")
def programs():
    return simple_gla_programs()


def run(benchmark, group, call):
    benchmark.group = group
    call()  # compile outside the timing
    benchmark(call)


@pytest.mark.parametrize("group", ["matmul-vs-forward", "matmul-vs-forward-backward"])
def test_matmul_2048(benchmark, group):
    program, args, _ = matmul_program()
    run(benchmark, group, ready(program, args))


def test_forward(benchmark, programs):
    forward, args, _, _ = programs
    run(benchmark, "matmul-vs-forward", ready(forward, args))


def test_forward_backward(benchmark, programs):
    _, _, forward_backward, args = programs
    run(benchmark, "matmul-vs-forward-backward", ready(forward_backward, args))


@pytest.mark.parametrize("shape", ["flat product", "per-chunk products"])
def test_state_products(benchmark, shape):
    program, args, _ = product_programs()[shape]
    run(benchmark, "matmul-vs-forward", ready(program, args))


@pytest.mark.parametrize("seq_len", [2048, 4096, 8192])
def test_forward_linear_in_t(benchmark, seq_len):
    forward, args, _, _ = simple_gla_programs(seq_len)
    run(benchmark, "forward-linear-in-T", ready(forward, args))


@pytest.mark.parametrize("seq_len", [2048, 4096, 8192])
def test_forward_backward_linear_in_t(benchmark, seq_len):
    _, _, forward_backward, args = simple_gla_programs(seq_len)
    run(benchmark, "forward-backward-linear-in-T", ready(forward_backward, args))


@pytest.mark.parametrize("chunk_size", [32, 64, 128])
def test_forward_chunk_size(benchmark, chunk_size):
    forward, args, _, _ = simple_gla_programs(chunk_size=chunk_size)
    run(benchmark, "forward-chunk-size", ready(forward, args))


# -- the report --------------------------------------------------------------------------------


def interleaved_timings(calls: dict, rounds: int) -> dict:
    """Median ``(wall, process CPU)`` seconds per call, the calls taking turns so that load changes
    hit all of them alike. CPU time counts every thread of this process, so it moves less than
    wall time when other jobs share the machine."""
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            wall, cpu = time.perf_counter(), time.process_time()
            call()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {name: tuple(statistics.median(column) for column in zip(*values)) for name, values in times.items()}


def interleaved_medians(calls: dict, rounds: int) -> dict:
    """Median wall seconds per call, interleaved (see ``interleaved_timings``)."""
    return {name: wall for name, (wall, _) in interleaved_timings(calls, rounds).items()}


def report(rounds: int = 7) -> None:
    matmul, matmul_args, matmul_flops = matmul_program()
    forward, forward_args, forward_backward, fb_args = simple_gla_programs()
    products = product_programs()
    seconds = interleaved_medians({
        "matmul": ready(matmul, matmul_args),
        "forward": ready(forward, forward_args),
        "forward+backward": ready(forward_backward, fb_args),
        **{name: ready(program, args) for name, (program, args, _) in products.items()},
    }, rounds)
    flops = {"matmul": matmul_flops, "forward": forward_flops(T, 64), "forward+backward": 3 * forward_flops(T, 64),
             **{name: count for name, (_, _, count) in products.items()}}
    rate = {name: flops[name] / seconds[name] / 1e9 for name in seconds}
    print(f"B={B} T={T} H={H} K={K} V={V} float32, g_gamma, chunk_size 64; {jax.devices()[0].device_kind}")
    for name in seconds:
        if name == next(iter(products)):
            print("  one of the forward's two state products alone, for the ceiling its shape sets:")
        ratio = "" if name == "matmul" else f"  {rate[name] / rate['matmul']:.0%} of the matmul"
        print(f"  {name:18s} {seconds[name] * 1e3:8.1f} ms  {rate[name]:6.1f} GFLOP/s{ratio}")

    print("time against T (forward, forward+backward; all six interleaved):")
    seq_lens = (2048, 4096, 8192)
    calls = {}
    for seq_len in seq_lens:
        forward, forward_args, forward_backward, fb_args = simple_gla_programs(seq_len)
        calls[seq_len, "f"] = ready(forward, forward_args)
        calls[seq_len, "fb"] = ready(forward_backward, fb_args)
    t = interleaved_medians(calls, rounds)
    for seq_len in seq_lens:
        per_k = 1024 / seq_len * 1e3
        f, fb = t[seq_len, "f"], t[seq_len, "fb"]
        print(f"  T={seq_len:5d}  {f * 1e3:7.1f} ms ({f * per_k:.2f} ms per 1k tokens)"
              f"  {fb * 1e3:7.1f} ms ({fb * per_k:.2f} ms per 1k tokens)")


if __name__ == "__main__":
    report()
