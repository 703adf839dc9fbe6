"""Portable chunked jax.numpy implementations of the tops ops (CPU, GPU, TPU)."""

import tops_core

from tops_plugins_xla import kda, simple_gla
from tops_plugins_xla.config import ChunkConfig

TOPS_CORE_API_VERSION = 1

_PLATFORMS = {"cpu", "gpu", "tpu"}
_DTYPES = {"bfloat16", "float16", "float32", "float64"}
# On TPU the Pallas kernels outrank them.
_PRIORITY = {"cpu": 100, "gpu": 100, "tpu": 50}


@tops_core.hookimpl
def tops_register_implementations(register):
    """Register ``xla.chunk`` for simple_gla and kda."""
    register(
        tops_core.Implementation(
            op="simple_gla",
            name="chunk",
            forward=simple_gla.forward,
            backward=simple_gla.backward,
            capabilities=tops_core.Capabilities(
                platforms=_PLATFORMS,
                dtypes=_DTYPES,
                features={"g", "g_gamma", "initial_state", "cu_seqlens", "output_final_state"},
                ndims={"g_gamma": {0, 1}},
            ),
            priority=_PRIORITY,
            config=ChunkConfig(),
            description="chunked simple_gla in plain jax.numpy with a hand-written chunked backward",
        )
    )
    register(
        tops_core.Implementation(
            op="kda",
            name="chunk",
            forward=kda.forward,
            backward=kda.backward,
            capabilities=tops_core.Capabilities(
                platforms=_PLATFORMS,
                dtypes=_DTYPES,
                features={
                    "initial_state", "cu_seqlens", "output_final_state", "use_qk_l2norm", "grouped_value_heads",
                    "use_gate", "A_log", "dt_bias", "lower_bound", "use_beta_sigmoid", "allow_neg_eigval",
                },
            ),
            priority=_PRIORITY,
            config=ChunkConfig(),
            description="chunked KDA in plain jax.numpy: exact per-chunk inverse, hand-written chunked backward",
        )
    )
