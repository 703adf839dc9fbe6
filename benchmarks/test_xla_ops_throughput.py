"""Throughput of xla.chunk for kda, gla and gated_delta_rule against simple_gla's xla.chunk, measured in the same process.

    pytest benchmarks/test_xla_ops_throughput.py --benchmark-only   # timings, one group per comparison
    python -m benchmarks.test_xla_ops_throughput                   # ratios, GFLOP/s, shares (from the repository root)

Same shape as the simple_gla report (``benchmarks/test_xla_throughput.py``): B=2, T=4096, H=8,
K=V=128, float32, chunk 64. kda runs with ``use_qk_l2norm`` (as ``tops bench kda`` does) and per-key
gates ``g = log_sigmoid(normal) / 16``; gla with the same gates; simple_gla with ALiBi ``g_gamma``, as in
its report. gla counts simple_gla's FLOPs (its per-key decays ride on the same products);
gated_delta_rule (``use_qk_l2norm``, ``g = log_sigmoid(normal) / 16`` per head) counts kda's.

FLOPs of the kda forward, per token and head, counting the chunked algorithm's matrix products
with triangles whole: ``6KV`` (queries and keys against the state, the state update), ``4CK``
(``Aqk`` and ``Akk``), ``4CV`` (the inverse and ``Aqk`` against the writes) and ``2C^2/3`` (the
blocked inverse; ``tops_core.bench.forward_flops``, which ``tops bench`` uses too); forward+backward
counts 3x that, as the simple_gla report does. At this shape that is 1.69x simple_gla's count.
The share of the flat-product ceiling is kda's rate over the
rate of one flat ``[B*T*H, K] @ [K, V]`` product, the best shape a product of these head dims
gets on this machine (see the simple_gla report).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import tops_core
from tops_core import bench
from benchmarks.test_xla_throughput import (
    B, H, K, T, V, forward_flops, inputs, interleaved_timings, matmul_program, product_programs, ready, run,
    simple_gla_programs,
)

CHUNK = 64


def kda_forward_flops(seq_len: int, chunk_size: int) -> float:
    return bench.forward_flops(bench.workload("kda", (B, seq_len, H, K, V), "float32", ["use_qk_l2norm"]), chunk_size)


def delta_rule_programs(op_name: str = "kda", seq_len: int = T, chunk_size: int = CHUNK):
    """Jitted forward and forward+backward of kda's or gated_delta_rule's xla.chunk through the public op (``use_qk_l2norm``),
    with their inputs: ``g`` per key for kda, per head for gated_delta_rule."""
    op = tops_core.op(op_name)
    implementation = ("xla.chunk", {"chunk_size": chunk_size})

    def forward(q, k, v, g, beta):
        return op.forward(q, k, v, g, beta, use_qk_l2norm=True, implementation=implementation)[0]

    def loss(q, k, v, g, beta, do):
        return jnp.sum(forward(q, k, v, g, beta) * do)

    q, k, v, _, do = inputs(seq_len)
    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    gate_shape = (B, seq_len, H, K) if op_name == "kda" else (B, seq_len, H)
    g = jax.nn.log_sigmoid(jax.random.normal(keys[0], gate_shape, jnp.float32)) / 16
    beta = jax.nn.sigmoid(jax.random.normal(keys[1], (B, seq_len, H), jnp.float32))
    forward_backward = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    return jax.jit(forward), (q, k, v, g, beta), forward_backward, (q, k, v, g, beta, do)


def gla_programs(seq_len: int = T, chunk_size: int = CHUNK):
    """Jitted forward and forward+backward of gla's xla.chunk through the public op, with their inputs."""
    op = tops_core.op("gla")
    implementation = ("xla.chunk", {"chunk_size": chunk_size})

    def forward(q, k, v, g):
        return op.forward(q, k, v, g, implementation=implementation)[0]

    def loss(q, k, v, g, do):
        return jnp.sum(forward(q, k, v, g) * do)

    q, k, v, _, do = inputs(seq_len)
    g = jax.nn.log_sigmoid(jax.random.normal(jax.random.PRNGKey(3), (B, seq_len, H, K), jnp.float32)) / 16
    return jax.jit(forward), (q, k, v, g), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))), (q, k, v, g, do)


# -- pytest-benchmark: one group per comparison -----------------------------------------------


@pytest.fixture(scope="module")
def programs():
    return {"kda": delta_rule_programs("kda"), "gla": gla_programs(), "gated_delta_rule": delta_rule_programs("gated_delta_rule"),
            "simple_gla": simple_gla_programs()}


@pytest.mark.parametrize("op_name", ["kda", "gla", "gated_delta_rule", "simple_gla"])
def test_forward(benchmark, programs, op_name):
    forward, args, _, _ = programs[op_name]
    run(benchmark, "ops-vs-simple_gla-forward", ready(forward, args))


@pytest.mark.parametrize("op_name", ["kda", "gla", "gated_delta_rule", "simple_gla"])
def test_forward_backward(benchmark, programs, op_name):
    _, _, forward_backward, args = programs[op_name]
    run(benchmark, "ops-vs-simple_gla-forward-backward", ready(forward_backward, args))


def test_flat_product(benchmark):
    program, args, _ = product_programs()["flat product"]
    run(benchmark, "ops-vs-simple_gla-forward", ready(program, args))


@pytest.mark.parametrize("chunk_size", [32, 64, 128])
def test_kda_forward_chunk_size(benchmark, chunk_size):
    forward, args, _, _ = delta_rule_programs("kda", chunk_size=chunk_size)
    run(benchmark, "kda-forward-chunk-size", ready(forward, args))


# -- the report --------------------------------------------------------------------------------


def report(rounds: int = 7) -> None:
    matmul, matmul_args, matmul_flops = matmul_program()
    flat, flat_args, flat_flops = product_programs()["flat product"]
    calls = {"matmul": ready(matmul, matmul_args), "flat product": ready(flat, flat_args)}
    programs = {"simple_gla": simple_gla_programs(), "kda": delta_rule_programs("kda"), "gla": gla_programs(),
                "gated_delta_rule": delta_rule_programs("gated_delta_rule")}
    for direction, index in (("forward", 0), ("fwd+bwd", 2)):
        for op_name, program in programs.items():
            calls[f"{op_name} {direction}"] = ready(program[index], program[index + 1])
    for chunk_size in (32, 128):
        forward, args, _, _ = delta_rule_programs("kda", chunk_size=chunk_size)
        calls[f"kda forward, chunk {chunk_size}"] = ready(forward, args)
    timings = interleaved_timings(calls, rounds)
    sg_flops, kda_flops = forward_flops(T, CHUNK), kda_forward_flops(T, CHUNK)
    flops = {"matmul": matmul_flops, "flat product": flat_flops}
    for op_name, op_flops in (("simple_gla", sg_flops), ("kda", kda_flops), ("gla", sg_flops), ("gated_delta_rule", kda_flops)):
        flops |= {f"{op_name} forward": op_flops, f"{op_name} fwd+bwd": 3 * op_flops}
    rate = {name: flops[name] / timings[name][0] / 1e9 for name in flops}

    print(f"B={B} T={T} H={H} K={K} V={V} float32, chunk {CHUNK}; {jax.devices()[0].device_kind}; "
          f"medians of {rounds} interleaved rounds (wall, and CPU time of all threads)")
    for name, (wall, cpu) in timings.items():
        line = f"  {name:30s} {wall * 1e3:8.1f} ms wall {cpu * 1e3:8.1f} ms CPU"
        if name in rate:
            line += f"  {rate[name]:6.1f} GFLOP/s"
            if name != "matmul":
                line += f"  {rate[name] / rate['matmul']:4.0%} of the matmul"
            if name not in ("matmul", "flat product"):
                line += f", {rate[name] / rate['flat product']:4.0%} of the flat product"
        print(line)
    for op_name in ("kda", "gla", "gated_delta_rule"):
        for direction in ("forward", "fwd+bwd"):
            wall, cpu = timings[f"{op_name} {direction}"]
            sg_wall, sg_cpu = timings[f"simple_gla {direction}"]
            print(f"{op_name} / simple_gla {direction}: {wall / sg_wall:.2f}x wall, {cpu / sg_cpu:.2f}x CPU time"
                  f" ({op_name} counts {flops[f'{op_name} forward'] / sg_flops:.2f}x the FLOPs)")


if __name__ == "__main__":
    report()
