"""Runs split calls of the public op on 8 CPU devices, and compiles them for a 4-chip TPU, for ``test_sharded``.

The test process has JAX initialised with one device; this worker starts with
``--xla_force_host_platform_device_count=8`` and ``JAX_PLATFORMS=cpu`` (and libtpu's no-TPU
environment), all set by the test; ``--x64`` enables float64. It reads one JSON request per line
and answers each with one JSON line:

- ``{"compare": case}``: the forward and every gradient (``jax.vjp`` with the kit's cotangents) of
  one call, on one device and split as the case says; the relative error of each split result
  against the single-device one, and the collectives of the split program. A case names ``mode``:
  ``auto`` (sharded inputs under plain ``jit``), ``shard`` (``tops_core.parallel.shard``) or
  ``types`` (a mesh of explicit axes, the split carried by the inputs' types); ``mesh`` (axis
  sizes), ``split`` (``batch``/``heads``/``sequence`` to the index of a mesh axis, or a list of
  them), the ``op`` (``simple_gla`` unless named) and the data (``B, T, H, K, V, dtype,
  features, seqlens, strong_decay, scalar_gamma``). ``"backward": true`` also compares the
  explicit ``op.backward``; ``"unplaced": true`` passes unsharded inputs; ``"explicit": true``
  makes the mesh's axes explicit in every mode (``jax.make_mesh``'s default); ``"set_mesh": true``
  runs the split call inside ``jax.set_mesh`` in every mode; ``"against":
  "ref.recurrent"`` computes the single-device results with that implementation, ``"force":
  "ref.recurrent"`` both the single-device and the split results.
- ``{"collectives": case}``: only compiles the split program and returns its collectives.
- ``{"tpu": case}``: compiles the split program for a compile-only TPU (``generation``, 4 chips)
  and returns its Mosaic kernels, implementations and collectives, or the error's text.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import tops_core
from tops_core.tpu import compile_only
from tops_core.conformance.cases import Case
from tops_core.conformance.compare import relative_error, tolerance
from tops_core.conformance.data import LOWER_BOUND, backward_inputs, forward_inputs

FACTOR_OF = {"batch": 0, "sequence": 1, "heads": 2}
TPU_TOPOLOGY = {"v5p": "v5p:2x2x1", "v6e": "v6e:2x2", "v4": "v4:2x2x1"}


def op_name(case: dict) -> str:
    return case.get("op", "simple_gla")


def conformance_case(case: dict) -> Case:
    features = frozenset(case["features"]) | ({"cu_seqlens"} if case.get("seqlens") else set())
    ndims = (("g_gamma", 0 if case.get("scalar_gamma") else 1),) if "g_gamma" in features else ()
    seqlens = tuple(case["seqlens"]) if case.get("seqlens") else None
    T = sum(seqlens) if seqlens else case["T"]
    return Case(
        op=op_name(case), name=case["name"], dtype=case["dtype"], batch=1 if seqlens else case["B"], seq_len=T,
        heads=case["H"], key_dim=case["K"], value_dim=case["V"], features=features, ndims=ndims, seqlens=seqlens,
        strong_decay=case.get("strong_decay", False), value_heads=case.get("HV"),
    )


def make_mesh(case: dict, devices: list) -> Mesh:
    sizes = tuple(case["mesh"])
    names = tuple(f"axis{i}" for i in range(len(sizes)))
    explicit = case["mode"] == "types" or case.get("explicit", False)
    types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(sizes)
    return Mesh(np.array(devices[: int(np.prod(sizes))]).reshape(sizes), names, axis_types=types)


def axis_names(case: dict) -> dict[str, str | tuple[str, ...]]:
    """The case's split with its mesh axes named ``axis<i>`` (the case gives their indices)."""
    named = {}
    for dimension, axes in case["split"].items():
        named[dimension] = tuple(f"axis{i}" for i in axes) if isinstance(axes, list) else f"axis{axes}"
    return named


def specs(case: dict, inputs: dict) -> dict[str, PartitionSpec]:
    """How the split shards each array input: B, T, H of the per-token arrays; the rest replicated."""
    token_spec = [None, None, None]
    for dimension, axes in axis_names(case).items():
        token_spec[FACTOR_OF[dimension]] = axes
    result = {}
    for name, x in inputs.items():
        if not isinstance(x, jax.Array):
            continue
        if name in ("q", "k", "v", "g", "beta", "do"):
            result[name] = PartitionSpec(*token_spec[: x.ndim])
        elif name in ("initial_state", "dht"):
            result[name] = PartitionSpec(token_spec[0] if not case.get("seqlens") else None, token_spec[2])
        elif name == "g_gamma" and x.ndim == 1:
            result[name] = PartitionSpec(token_spec[2])
        else:
            result[name] = PartitionSpec()
    return result


def placed(case: dict, mesh: Mesh, inputs: dict) -> dict:
    """The inputs on the mesh as the split shards them (``"unplaced"``: left where they are, for the op to split)."""
    if case.get("unplaced"):
        return inputs
    shardings = specs(case, inputs)
    return {name: jax.device_put(x, NamedSharding(mesh, shardings[name])) if name in shardings else x for name, x in inputs.items()}


def program(case: dict, mesh: Mesh | None, explicit_backward: bool = False):
    """The jitted call: forward and VJP (or the explicit backward), split as the case says when ``mesh`` is given."""

    def scope():
        if mesh is not None and case["mode"] == "shard":
            return tops_core.parallel.shard(mesh, **axis_names(case))
        return contextlib.nullcontext()

    op = tops_core.op(op_name(case))
    features = case["features"]
    options = {"output_final_state": "output_final_state" in features}
    options |= {flag: True for flag in ("use_qk_l2norm", "use_gate", "use_beta_sigmoid", "allow_neg_eigval") if flag in features}
    if "lower_bound" in features:
        options["lower_bound"] = LOWER_BOUND  # the test data's

    def run(inputs: dict):
        given = {name: inputs[name] for name in op.differentiable if name in inputs}
        static = {"cu_seqlens": inputs.get("cu_seqlens"), **options}
        with scope():
            if explicit_backward:
                backward_options = {name: value for name, value in static.items() if name != "output_final_state"}
                grads = op.backward(**given, do=inputs["do"], dht=inputs.get("dht"), **backward_options)
                return {"d" + name: getattr(grads, "d" + name) for name in given}

            def forward(*arrays):
                return op.forward(**dict(zip(given, arrays)), **static)

            (o, final_state), pullback = jax.vjp(forward, *given.values())
            grads = pullback((inputs["do"], inputs.get("dht")))
        results = {"o": o, **{"d" + name: grad for name, grad in zip(given, grads)}}
        if final_state is not None:
            results["final_state"] = final_state
        return results

    return jax.jit(run)


def inputs_of(case: dict) -> dict:
    conformance = conformance_case(case)
    forward = forward_inputs(conformance)
    backward = backward_inputs(conformance, forward)
    arrays = {name: x for name, x in forward.items() if isinstance(x, jax.Array)}
    return {**arrays, "do": backward["do"], **({"dht": backward["dht"]} if "dht" in backward else {})}


def in_context(case: dict, mesh: Mesh):
    return jax.set_mesh(mesh) if case["mode"] == "types" or case.get("set_mesh") else contextlib.nullcontext()


def forcing(case: dict, key: str):
    """A fresh scope forcing the implementation the case names under ``key``, if any."""
    return tops_core.use(**{op_name(case): case[key]}) if case.get(key) else contextlib.nullcontext()


def collectives_of(compiled) -> list[list]:
    return [[c.opcode, c.shape, c.bytes] for c in compile_only.collectives(compiled.as_text())]


def compare(case: dict) -> dict:
    inputs = inputs_of(case)
    mesh = make_mesh(case, jax.devices())
    answer = {"errors": {}, "tolerances": {}}
    for explicit_backward in (False, True) if case.get("backward") else (False,):
        # The split first: a split the op refuses fails before the one-device program compiles.
        with forcing(case, "force"), in_context(case, mesh):
            sharded_inputs = placed(case, mesh, inputs)
            split = program(case, mesh, explicit_backward)
            results = split(sharded_inputs)
            if not explicit_backward:
                answer["collectives"] = collectives_of(split.lower(sharded_inputs).compile())
                spec = tuple(getattr(results["o"].sharding, "spec", ())) + (None,) * 4  # none: placed whole on one device
                answer["o_spec"] = [entry if entry is None or isinstance(entry, str) else list(entry) for entry in spec[:4]]
        with forcing(case, "force"), forcing(case, "against"):
            single = program(case, None, explicit_backward)(inputs)
        for name, got in results.items():
            label = ("backward " if explicit_backward else "") + name
            answer["errors"][label] = relative_error(np.asarray(got, np.float64), np.asarray(single[name], np.float64))
            answer["tolerances"][label] = tolerance(case["dtype"], name.startswith("d"))
    return answer


def collectives(case: dict) -> dict:
    mesh = make_mesh(case, jax.devices())
    with in_context(case, mesh):
        sharded_inputs = placed(case, mesh, inputs_of(case))
        return {"collectives": collectives_of(program(case, mesh).lower(sharded_inputs).compile())}


def tpu(case: dict) -> dict:
    from jax.experimental import topologies

    compile_only.quiet_libtpu()
    devices = list(topologies.get_topology_desc(TPU_TOPOLOGY[case["generation"]], "tpu").devices)
    mesh = make_mesh(case, devices)
    inputs = inputs_of(case)
    shardings = specs(case, inputs)
    abstract = {
        name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, shardings[name])) if name in shardings else x
        for name, x in inputs.items()
    }
    with in_context(case, mesh):
        try:
            compiled = program(case, mesh, case.get("explicit_backward", False)).lower(abstract).compile()
        except Exception as error:  # noqa: BLE001 - the test reads what went wrong
            return {"error_text": f"{type(error).__name__}: {error}"}
    facts = compile_only.ProgramFacts.of(compiled)
    return {"kernels": facts.kernels, "implementations": sorted(facts.implementations), "collectives": collectives_of(compiled)}


def start_the_cpu_backend() -> None:
    """Start the CPU backend under ``CPU_BACKEND_XLA_FLAGS``, the test run's flags with the CPU backend's own (the same
    programs, compiled faster: conftest.py), when the parent passes them; ``XLA_FLAGS`` stays without those: libtpu,
    which the TPU requests load later, reads it when it loads and rejects them. The CPU backend reads its flags once,
    when it starts."""
    cpu_flags = os.environ.pop("CPU_BACKEND_XLA_FLAGS", None)
    if cpu_flags is None:
        return
    user_flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = cpu_flags
    jax.devices("cpu")
    os.environ["XLA_FLAGS"] = user_flags


def main() -> None:
    start_the_cpu_backend()
    if "--x64" in sys.argv:
        jax.config.update("jax_enable_x64", True)
    handlers = {"compare": compare, "collectives": collectives, "tpu": tpu}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            (kind, case), = request.items()
            reply = handlers[kind](case)
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            reply = {"error": traceback.format_exc()}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
