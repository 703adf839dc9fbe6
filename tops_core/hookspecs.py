"""Hook specifications for tops plugins (pluggy project ``tops``, entry-point group ``tops``).

A plugin is a module (or any object) that sets ``TOPS_CORE_API_VERSION`` and implements::

    @tops_core.hookimpl
    def tops_register_implementations(register):
        register(tops_core.Implementation(op="simple_gla", name="chunk", forward=..., ...))
"""

import pluggy

hookspec = pluggy.HookspecMarker("tops")
hookimpl = pluggy.HookimplMarker("tops")


@hookspec
def tops_register_implementations(register):
    """Register kernel implementations by calling ``register(Implementation(...))`` once per kernel."""
