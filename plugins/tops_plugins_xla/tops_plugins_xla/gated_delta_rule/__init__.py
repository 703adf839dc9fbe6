"""gated_delta_rule, chunked, in plain jax.numpy (``xla.chunk``): see ``chunk``."""

from tops_plugins_xla.gated_delta_rule.chunk import backward, forward

__all__ = ["backward", "forward"]
