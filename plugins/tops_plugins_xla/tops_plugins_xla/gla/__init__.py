"""gla, chunked, in plain jax.numpy (``xla.chunk``): see ``chunk``; one chunk's pair products in ``tops_plugins_xla.intra``."""

from tops_plugins_xla.gla.chunk import backward, forward

__all__ = ["backward", "forward"]
