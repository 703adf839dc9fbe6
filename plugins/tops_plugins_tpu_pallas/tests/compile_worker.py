"""Compiles calls of the public op for compile-only TPUs, for ``test_pallas_compile``, in its own process.

The tests start it with ``JAX_PLATFORMS=cpu`` (nothing tries to open a TPU) and libtpu's no-TPU
environment, so libtpu's start-up stays out of the test process. It reads one JSON request per
line on stdin and answers each with one JSON line on stdout: the facts of the compiled program
(``tops_core.tpu.compile_only.ProgramFacts``), or the error.

Requests: ``{"call": {...}}`` compiles the forward of one call of ``tpu_pallas.<kernel>`` or, given
``"implementation"``, of that one (null: the dispatcher's choice) (simple_gla, packed with traced
``cu_seqlens`` when it names ``num_seqs``; or kda with ``"op": "kda"`` (gated_delta_rule and gla likewise), with the
activation options it names, and ``groups`` value heads per query/key head), or with ``"gradient": true`` the
value and gradient of ``sum(o**2) (+ sum(final_state**2))`` for every input;
``{"layer": {...}}`` compiles the forward between projections (``tops_core.tpu.model.in_a_layer``, as `tops bench` models it); ``{"bench": {...}}`` returns the
text of ``tops bench``'s modelled TPU section; ``{"decode": {...}}`` compiles a decode step as a server
runs it (or a packed prefill of ``num_seqs`` sequences; any op), the dispatcher choosing: a state pool of ``pool`` rows
(or a dense state, or none) donated, the final state returned (``aliased``: whether the compiled program returns the pool in its input's buffer;
``moved_states``: the states XLA gathers or scatters around the kernels).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import traceback

import jax
import jax.numpy as jnp
import tops_core
from tops_core.tpu import compile_only, model as tpu_model
from tops_core.bench import workload

sg = tops_core.op("simple_gla")
PER_CHUNK_OPS = ("kda", "gated_delta_rule", "gla")  # the ops on kda's machinery, called with kda's arrays


def _arrays(call: dict) -> dict[str, jax.ShapeDtypeStruct]:
    B, T, H, K, V = (call[name] for name in ("B", "T", "H", "K", "V"))
    dtype = jnp.dtype(call["dtype"])
    arrays = {
        "q": jax.ShapeDtypeStruct((B, T, H, K), dtype), "k": jax.ShapeDtypeStruct((B, T, H, K), dtype),
        "v": jax.ShapeDtypeStruct((B, T, H, V), dtype), "g_gamma": jax.ShapeDtypeStruct((H,), jnp.float32),
    }
    if call["g"]:
        arrays["g"] = jax.ShapeDtypeStruct((B, T, H), jnp.float32)
    num_seqs = call.get("num_seqs")  # packed: B == 1 and N traced boundaries
    if num_seqs is not None:
        arrays["cu_seqlens"] = jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32)
    if call["initial_state"]:
        arrays["initial_state"] = jax.ShapeDtypeStruct((num_seqs or B, H, K, V), jnp.float32)
    return arrays


def _kda_arrays(call: dict) -> dict[str, jax.ShapeDtypeStruct]:
    """kda's inputs (gated_delta_rule's: ``g`` per value head; gla's: no ``beta``); with ``groups``, ``groups * H`` value heads,
    and the raw gate and beta logits in the call's dtype when activated."""
    B, T, H, K, V = (call[name] for name in ("B", "T", "H", "K", "V"))
    HV = H * call.get("groups", 1)
    dtype = jnp.dtype(call["dtype"])
    arrays = {
        "q": jax.ShapeDtypeStruct((B, T, H, K), dtype), "k": jax.ShapeDtypeStruct((B, T, H, K), dtype),
        "v": jax.ShapeDtypeStruct((B, T, HV, V), dtype),
        "g": jax.ShapeDtypeStruct((B, T, HV) if call.get("op") == "gated_delta_rule" else (B, T, HV, K), dtype if call.get("use_gate") else jnp.float32),
        "beta": jax.ShapeDtypeStruct((B, T, HV), dtype if call.get("use_beta_sigmoid") else jnp.float32),
    }
    if call.get("op") == "gla":
        del arrays["beta"]
    if call["initial_state"]:  # one per sequence when packed
        arrays["initial_state"] = jax.ShapeDtypeStruct((call.get("num_seqs") or B, HV, K, V), jnp.float32)
    if call.get("num_seqs") is not None:  # packed: B == 1 and N traced boundaries
        arrays["cu_seqlens"] = jax.ShapeDtypeStruct((call["num_seqs"] + 1,), jnp.int32)
    if call.get("A_log"):
        arrays["A_log"] = jax.ShapeDtypeStruct((HV,), jnp.float32)
    if call.get("dt_bias"):
        arrays["dt_bias"] = jax.ShapeDtypeStruct((HV * K,), jnp.float32)
    return arrays


def _decode_arrays(call: dict) -> dict[str, jax.ShapeDtypeStruct]:
    """A decode call's token inputs: kda's and simple_gla's as their compile calls take them; gla's gate per key and
    gated_delta_rule's per value head (with beta), float32."""
    B, T, H, HV, K, V = (call[name] for name in ("B", "T", "H", "HV", "K", "V"))
    if call["op"] == "kda":
        return _kda_arrays({**call, "groups": HV // H, "initial_state": False})
    if call["op"] == "simple_gla":
        return _arrays({**call, "initial_state": False})
    dtype = jnp.dtype(call["dtype"])
    arrays = {"q": jax.ShapeDtypeStruct((B, T, H, K), dtype), "k": jax.ShapeDtypeStruct((B, T, H, K), dtype),
              "v": jax.ShapeDtypeStruct((B, T, HV, V), dtype)}
    if call["op"] == "gla":
        return {**arrays, "g": jax.ShapeDtypeStruct((B, T, HV, K), jnp.float32)}
    return {**arrays, "g": jax.ShapeDtypeStruct((B, T, HV), jnp.float32), "beta": jax.ShapeDtypeStruct((B, T, HV), jnp.float32)}


def _kda_forward(call: dict):
    """kda's (or gated_delta_rule's, gla's) forward through the public op and ``tpu_pallas.<kernel>`` (or ``implementation``),
    with the call's activation options (gla has neither those nor ``use_qk_l2norm``)."""
    options = {name: call[name] for name in ("use_gate", "lower_bound", "use_beta_sigmoid", "allow_neg_eigval") if name in call}
    if call["op"] != "gla":
        options["use_qk_l2norm"] = call["use_qk_l2norm"]
    contract = tops_core.op(call["op"])

    def forward(arrays):
        return contract.forward(**arrays, output_final_state=call["final_state"],
                           implementation=call.get("implementation", f"tpu_pallas.{call['kernel']}"), **options)

    return forward


def _forward(call: dict):
    if call.get("op") in PER_CHUNK_OPS:
        return _kda_forward(call)

    def forward(arrays):
        return sg.forward(**arrays, output_final_state=call["final_state"], implementation=call.get("implementation", f"tpu_pallas.{call['kernel']}"))

    return forward


def _loss(call: dict):
    forward = _forward(call)

    def loss(arrays):
        o, final_state = forward(arrays)
        total = jnp.sum(o.astype(jnp.float32) ** 2)
        return total + jnp.sum(final_state**2) if final_state is not None else total

    return loss


def compile_call(call: dict) -> compile_only.ProgramFacts:
    function = jax.value_and_grad(_loss(call), allow_int=True) if call.get("gradient") else _forward(call)  # cu_seqlens: int
    arrays = _kda_arrays(call) if call.get("op") in PER_CHUNK_OPS else _arrays(call)
    return compile_only.ProgramFacts.of(compile_only.compile_for(call["generation"], function, arrays))


def compile_layer(call: dict) -> compile_only.ProgramFacts:
    forward = _forward(call)
    arrays = _kda_arrays(call) if call.get("op") in PER_CHUNK_OPS else _arrays(call)
    layer, *args = tpu_model.in_a_layer(lambda **inputs: forward(inputs), arrays)
    return compile_only.ProgramFacts.of(compile_only.compile_for(call["generation"], layer, *args))


def bench_section(request: dict) -> str:
    case = workload(request.get("op", "simple_gla"), tuple(request["shape"]), request["dtype"], request["features"])
    return tpu_model.format_model(tpu_model.model(case, request["generation"], names=request.get("names")))


def compile_decode(call: dict) -> tuple[compile_only.ProgramFacts, bool, list[str]]:
    B, HV, K, V, P = (call[name] for name in ("B", "HV", "K", "V", "pool"))
    arrays = _decode_arrays(call)
    options = {name: call[name] for name in ("use_qk_l2norm", "use_gate", "lower_bound", "use_beta_sigmoid") if name in call}
    num_seqs = call.get("num_seqs") or B  # a packed prefill with num_seqs (B == 1)
    if P is not None:
        arrays["ssm_state_indices"] = jax.ShapeDtypeStruct((num_seqs,), jnp.int32)
    state = None if call["state"] is None else jax.ShapeDtypeStruct((P or num_seqs, HV, K, V), jnp.float32)
    contract = tops_core.op(call["op"])

    def step(state, arrays):
        return contract.forward(**arrays, initial_state=state, output_final_state=True, **options)

    compiled = compile_only.compile_for(call["generation"], step, state, arrays, donate_argnums=(0,))
    text = compiled.as_text()
    moved_states = re.findall(r"= (f32\[\d+,\d+,\d+,\d+\])\S* (?:gather|scatter)\(", text)  # rows gathered or scattered by XLA
    return compile_only.ProgramFacts.of(compiled), "input_output_alias={ {1}: (0, {}" in text, moved_states


def answer(request: dict) -> dict:
    if "bench" in request:
        return {"text": bench_section(request["bench"])}
    aliased = moved_states = None
    if "decode" in request:
        facts, aliased, moved_states = compile_decode(request["decode"])
    else:
        facts = compile_layer(request["layer"]) if "layer" in request else compile_call(request["call"])
    answer = dataclasses.asdict(facts)
    answer["aliased"], answer["moved_states"] = aliased, moved_states
    answer["implementations"] = sorted(facts.implementations)
    answer["hbm_bytes"] = facts.hbm_bytes
    answer["kernel_cost"] = dataclasses.asdict(facts.kernel_cost)
    return answer


def main() -> None:
    for line in sys.stdin:
        try:
            reply = answer(json.loads(line))
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            reply = {"error": traceback.format_exc()}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
