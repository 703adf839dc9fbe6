"""Float64 reference implementations of the tops ops (the oracle)."""

import tops_core

TOPS_CORE_API_VERSION = 1


@tops_core.hookimpl
def tops_register_implementations(register):
    """Register this plugin's implementations (none yet)."""
