"""What splitting a long sequence over many TPU chips costs: the bytes each chip sends, against its own work.

    python benchmarks/sequence_parallel_model.py            # T = 1M over the 64 chips of a v5p:4x4x4

Compile-only (libtpu, no TPU needed): simple_gla in bfloat16 (B=1, H=16, K=V=128, ``g_gamma``,
final state) is compiled for every chip of the topology with ``T`` split over all of them
(``tops_core.parallel.shard``), forward alone and forward with its VJP (a training step), and,
for comparison, the same per-chip block on one chip, unsplit. From the compiled programs: the
collectives and the bytes each chip sends, and XLA's cost analysis of the per-chip work. The
times are a model, not a measurement: local time at the chip's HBM bandwidth or peak compute,
whichever binds; exchange time at one interconnect link's bandwidth per transfer (a
``collective-permute`` ships its array once, a ring ``all-reduce`` twice), each transfer paying
``--latency`` too.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import tops_core
from tops_core.tpu import compile_only
from tops_core.tpu.generations import GENERATIONS

LINK_BYTES_PER_SECOND = {"v5p": 4800e9 / 8 / 6}
"""One interconnect link of a v5p chip: 4,800 Gbps per chip (Cloud TPU v5p page) over its 6 links of the 3D torus."""

HEADS, KEY_DIM, VALUE_DIM = 16, 128, 128


def programs(tokens: int):
    sg = tops_core.op("simple_gla")

    def forward(q, k, v, g_gamma):
        return sg.forward(q, k, v, g_gamma=g_gamma, output_final_state=True)

    def training(q, k, v, g_gamma, do, dht):
        outputs, pullback = jax.vjp(forward, q, k, v, g_gamma)
        return outputs, pullback((do, dht))

    return {"forward": forward, "training": training}


def arguments(tokens: int, token_sharding, replicated) -> tuple:
    token = jax.ShapeDtypeStruct((1, tokens, HEADS, KEY_DIM), jnp.bfloat16, sharding=token_sharding)
    gamma = jax.ShapeDtypeStruct((HEADS,), jnp.float32, sharding=replicated)
    dht = jax.ShapeDtypeStruct((1, HEADS, KEY_DIM, VALUE_DIM), jnp.float32, sharding=replicated)
    return token, token, token, gamma, token, dht


def compile_split(function, mesh: Mesh, tokens: int, training: bool):
    args = arguments(tokens, NamedSharding(mesh, PartitionSpec(None, "seq")), NamedSharding(mesh, PartitionSpec()))

    def split(*args):
        with tops_core.parallel.shard(mesh, sequence="seq"):
            return function(*args)

    return jax.jit(split).lower(*(args if training else args[:4])).compile()


def compile_local(function, device, tokens: int, training: bool):
    placement = jax.sharding.SingleDeviceSharding(device)
    args = arguments(tokens, placement, placement)
    return jax.jit(function).lower(*(args if training else args[:4])).compile()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5p:4x4x4")
    parser.add_argument("--tokens", type=int, default=2**20)
    parser.add_argument("--latency", type=float, default=5e-6, help="seconds each transfer costs besides its bytes")
    options = parser.parse_args()
    from jax.experimental import topologies

    compile_only.quiet_libtpu()
    generation = GENERATIONS[options.topology.split(":")[0]]
    devices = topologies.get_topology_desc(options.topology, "tpu").devices
    mesh = Mesh(np.array(devices), ("seq",))
    chips = len(devices)
    link = LINK_BYTES_PER_SECOND[generation.name]
    print(f"simple_gla bf16, B=1 T={options.tokens} H={HEADS} K={KEY_DIM} V={VALUE_DIM}, T split over {chips} {generation.name} chips "
          f"({options.tokens // chips} tokens each); link {link / 1e9:.0f} GB/s, HBM {generation.hbm_bytes_per_second / 1e12:.2f} TB/s")
    for name, function in programs(options.tokens).items():
        training = name == "training"
        split = compile_split(function, mesh, options.tokens, training)
        local = compile_local(function, devices[0], options.tokens // chips, training)
        sent = compile_only.collectives(split.as_text())
        sent_bytes = sum(c.bytes * (2 if c.opcode == "all-reduce" else 1) for c in sent)
        exchange = sent_bytes / link + len(sent) * options.latency
        print(f"\n{name}: {len(sent)} collectives per chip, {sent_bytes / 2**20:.2f} MiB sent per chip")
        for opcode in sorted({c.opcode for c in sent}):
            sizes = sorted({c.bytes for c in sent if c.opcode == opcode}, reverse=True)
            print(f"  {opcode}: " + ", ".join(f"{sum(c.bytes == s for c in sent if c.opcode == opcode)} x {s} B" for s in sizes))
        for label, compiled in (("split, per chip", split), ("one chip, same block unsplit", local)):
            facts = compile_only.ProgramFacts.of(compiled)
            seconds = max(facts.bytes_accessed / generation.hbm_bytes_per_second, facts.flops / generation.peak_bf16_flops)
            print(f"  {label}: {facts.bytes_accessed / 2**20:.0f} MiB accessed, {facts.flops / 1e9:.1f} GFLOP -> {seconds * 1e6:.0f} us")
        print(f"  exchange: {exchange * 1e6:.0f} us ({sent_bytes / 2**20:.2f} MiB at {link / 1e9:.0f} GB/s + {len(sent)} x {options.latency * 1e6:.0f} us)")


if __name__ == "__main__":
    main()
