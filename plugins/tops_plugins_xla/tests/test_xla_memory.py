"""The backward's memory stays O(T (K + V) + (T / C) K V): checked on the compiled program, not run."""

import jax
import jax.numpy as jnp

from tops_plugins_xla import kda, simple_gla
from tops_plugins_xla.config import ChunkConfig

B, T, H, K, V = 1, 32768, 8, 128, 128


def test_backward_temporaries_are_the_chunk_states_and_little_else():
    config = ChunkConfig()
    C = config.chunk_size

    def backward(q, k, v, do, g_gamma):
        return simple_gla.backward(q, k, v, do, g=None, g_gamma=g_gamma, scale=K**-0.5, initial_state=None,
                                   dht=None, cu_seqlens=None, config=config)

    qk = jax.ShapeDtypeStruct((B, T, H, K), jnp.float32)
    vo = jax.ShapeDtypeStruct((B, T, H, V), jnp.float32)
    gamma = jax.ShapeDtypeStruct((H,), jnp.float32)
    memory = jax.jit(backward).lower(qk, qk, vo, vo, gamma).compile().memory_analysis()
    states = B * (T // C) * H * K * V * 4  # the state before every chunk, float32
    chunk_temporaries = 16 * 2**20  # per-chunk buffers, gates, small per-token sums
    assert memory.temp_size_in_bytes <= states + chunk_temporaries, memory
    assert memory.output_size_in_bytes <= B * T * H * (2 * K + V) * 4 + 1024  # dq, dk, dv and dg_gamma


def test_kda_backward_temporaries_are_the_chunk_states_and_little_else():
    config = ChunkConfig()
    C = config.chunk_size

    def backward(q, k, v, g, beta, do):
        return kda.backward(q, k, v, g, beta, do, scale=K**-0.5, initial_state=None, dht=None, cu_seqlens=None,
                            use_qk_l2norm=True, config=config)

    qk = jax.ShapeDtypeStruct((B, T, H, K), jnp.float32)
    vo = jax.ShapeDtypeStruct((B, T, H, V), jnp.float32)
    beta = jax.ShapeDtypeStruct((B, T, H), jnp.float32)
    memory = jax.jit(backward).lower(qk, qk, vo, qk, beta, vo).compile().memory_analysis()
    states = B * (T // C) * H * K * V * 4  # the state before every chunk, float32
    chunk_temporaries = 16 * 2**20  # per-chunk buffers (pair products, decays of every level), small per-token sums
    assert memory.temp_size_in_bytes <= states + chunk_temporaries, memory
    assert memory.output_size_in_bytes <= B * T * H * (3 * K + V + 1) * 4 + 1024  # dq, dk, dg, dv and dbeta
