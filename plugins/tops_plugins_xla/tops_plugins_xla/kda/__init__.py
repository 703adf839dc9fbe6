"""KDA, chunked, in plain jax.numpy (``xla.chunk``): its entry points in ``chunk``, the sweeps in ``tops_plugins_xla.delta_rule``."""

from tops_plugins_xla.kda.chunk import backward, forward

__all__ = ["backward", "forward"]
