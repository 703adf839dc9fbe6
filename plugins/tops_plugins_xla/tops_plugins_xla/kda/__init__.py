"""KDA, chunked, in plain jax.numpy (``xla.chunk``): the sweeps in ``chunk``, one chunk's pair products in ``intra``."""

from tops_plugins_xla.kda.chunk import backward, forward

__all__ = ["backward", "forward"]
