"""xla.chunk's registration and its config: what a user can override, and what is refused."""

import jax.numpy as jnp
import numpy as np
import pytest

import tops_core
from tops_plugins_xla.config import ChunkConfig


@pytest.mark.parametrize("op", ["simple_gla", "kda", "gla"])
def test_registered_with_its_default_config(op):
    impl = next(i for i in tops_core.op(op).implementations() if i.name == "xla.chunk")
    assert impl.config == ChunkConfig(chunk_size=64)
    assert impl.backward is not None
    assert impl.capabilities.features == tops_core.op(op).features
    if op == "simple_gla":
        assert impl.capabilities.accepted_ndims("g_gamma") == {0, 1}


@pytest.mark.parametrize("size", [16, 32, 64, 128, 256])
def test_accepts_powers_of_two(size):
    assert ChunkConfig(size).chunk_size == size


@pytest.mark.parametrize("size", [0, 8, 48, 100, 512, 64.0, True, "64"])
def test_rejects_other_chunk_sizes(size):
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkConfig(size)


def test_override_through_use_changes_the_chunking_not_the_result():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 200, 2, 32)), jnp.float32) for _ in range(3))
    gamma = jnp.asarray([-0.1, -0.5], jnp.float32)
    sg = tops_core.op("simple_gla")
    results = []
    for size in (16, 128):
        with tops_core.use(simple_gla=("xla.chunk", {"chunk_size": size})):
            results.append(sg.forward(q, k, v, g_gamma=gamma)[0])
    np.testing.assert_allclose(results[0], results[1], rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="chunk_size"):
        with tops_core.use(simple_gla=("xla.chunk", {"chunk_size": 100})):
            sg.forward(q, k, v, g_gamma=gamma)
