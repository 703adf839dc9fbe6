"""simple_gla, chunked, in plain jax.numpy (``xla.chunk``): see ``chunk``."""

from tops_plugins_xla.simple_gla.chunk import backward, forward

__all__ = ["backward", "forward"]
