"""Portable chunked jax.numpy implementations of the tops ops (CPU, GPU, TPU)."""

import tops_core

from tops_plugins_xla import simple_gla
from tops_plugins_xla.config import ChunkConfig

TOPS_CORE_API_VERSION = 1


@tops_core.hookimpl
def tops_register_implementations(register):
    """Register ``xla.chunk`` for simple_gla."""
    register(
        tops_core.Implementation(
            op="simple_gla",
            name="chunk",
            forward=simple_gla.forward,
            backward=simple_gla.backward,
            capabilities=tops_core.Capabilities(
                platforms={"cpu", "gpu", "tpu"},
                dtypes={"bfloat16", "float16", "float32", "float64"},
                features={"g", "g_gamma", "initial_state", "cu_seqlens", "output_final_state"},
                ndims={"g_gamma": {0, 1}},
            ),
            # On TPU the Pallas kernels outrank it.
            priority={"cpu": 100, "gpu": 100, "tpu": 50},
            config=ChunkConfig(),
            description="chunked simple_gla in plain jax.numpy with a hand-written chunked backward",
        )
    )
