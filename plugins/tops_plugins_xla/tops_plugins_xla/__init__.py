"""Portable chunked jax.numpy implementations of the tops ops (CPU, GPU, TPU)."""

import tops_core

TOPS_CORE_API_VERSION = 1


@tops_core.hookimpl
def tops_register_implementations(register):
    """Register this plugin's implementations (none yet)."""
