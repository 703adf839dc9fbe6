"""Portable jax.numpy implementations of the tops ops (CPU, GPU, TPU): chunked, and token by token for decode steps."""

import tops_core

from tops_plugins_xla import gated_delta_rule, gla, kda, recurrent, simple_gla
from tops_plugins_xla.config import ChunkConfig
from tops_plugins_xla.gated_delta_rule import recurrent as gated_delta_rule_recurrent
from tops_plugins_xla.gla import recurrent as gla_recurrent
from tops_plugins_xla.kda import recurrent as kda_recurrent
from tops_plugins_xla.simple_gla import recurrent as simple_gla_recurrent

TOPS_CORE_API_VERSION = 1

_PLATFORMS = {"cpu", "gpu", "tpu"}
_DTYPES = {"bfloat16", "float16", "float32", "float64"}
# On TPU the Pallas kernels outrank xla.chunk.
_CHUNK_PRIORITY = {"cpu": 100, "gpu": 100, "tpu": 50}
# What a call of each op may carry besides cu_seqlens, which only xla.chunk takes.
_UNPACKED_FEATURES = {
    "simple_gla": {"g", "g_gamma", "initial_state", "output_final_state"},
    "kda": {
        "initial_state", "output_final_state", "use_qk_l2norm", "grouped_value_heads",
        "use_gate", "A_log", "dt_bias", "lower_bound", "use_beta_sigmoid", "allow_neg_eigval",
    },
    "gla": {"initial_state", "output_final_state"},
    "gated_delta_rule": {"initial_state", "output_final_state", "use_qk_l2norm", "grouped_value_heads"},
}
_NDIMS = {"simple_gla": {"g_gamma": {0, 1}}}


def _capabilities(op: str, *, packed: bool) -> tops_core.Capabilities:
    features = _UNPACKED_FEATURES[op] | ({"cu_seqlens"} if packed else set())
    return tops_core.Capabilities(platforms=_PLATFORMS, dtypes=_DTYPES, features=features, ndims=_NDIMS.get(op, {}))


@tops_core.hookimpl
def tops_register_implementations(register):
    """Register ``xla.chunk`` and ``xla.recurrent`` for simple_gla, kda and gla."""
    chunked = {
        "simple_gla": (simple_gla, "chunked simple_gla in plain jax.numpy with a hand-written chunked backward"),
        "kda": (kda, "chunked KDA in plain jax.numpy: exact per-chunk inverse, hand-written chunked backward"),
        "gla": (gla, "chunked GLA (per-key gates) in plain jax.numpy with a hand-written chunked backward"),
        "gated_delta_rule": (gated_delta_rule, "chunked gated delta rule in plain jax.numpy: kda's sweeps with dense pair "
                                               "products for its gate per head, hand-written chunked backward"),
    }
    for op, (module, description) in chunked.items():
        register(tops_core.Implementation(
            op=op, name="chunk", forward=module.forward, backward=module.backward,
            capabilities=_capabilities(op, packed=True), priority=_CHUNK_PRIORITY, config=ChunkConfig(),
            description=description,
        ))
    stepped = {"simple_gla": (simple_gla_recurrent, "simple_gla"), "kda": (kda_recurrent, "KDA"), "gla": (gla_recurrent, "GLA"),
               "gated_delta_rule": (gated_delta_rule_recurrent, "gated delta rule")}
    for op, (module, label) in stepped.items():
        register(tops_core.Implementation(
            op=op, name="recurrent", forward=module.forward, capabilities=_capabilities(op, packed=False),
            priority=tops_core.decode_step_priority(recurrent.PRIORITY), description=f"{label} token by token in plain jax.numpy, for decode steps (forward only)",
        ))
