"""tops: fast linear-attention kernels behind one call that picks the best implementation.

    import tops_core
    o, ht = tops_core.op("simple_gla").forward(q, k, v, g_gamma=gamma, output_final_state=True)
"""

from tops_core import environment
from tops_core.callspec import DECODE_STEP_TOKENS, CallSpec, decode_step_priority
from tops_core.capabilities import Capabilities, DimRule
from tops_core.dispatch import Decision, NoImplementationError
from tops_core.hookspecs import hookimpl
from tops_core.implementation import Implementation
from tops_core import parallel
from tops_core.ops import op
from tops_core.ops.base import ContractError, Explanation, target_chip
from tops_core.ops.gated_delta_rule import GatedDeltaRuleGrads
from tops_core.ops.gla import GLAGrads
from tops_core.ops.kda import KDAGrads
from tops_core.ops.simple_gla import SimpleGLAGrads
from tops_core.ops.validation import LayoutWarning
from tops_core.policy import use
from tops_core.registry import API_VERSION, PluginError, default_registry

__version__ = "0.1.0"


def register(implementation: Implementation, plugin: str = "local") -> Implementation:
    """Register one implementation in-process (a user's own kernel, a test) as ``<plugin>.<name>``."""
    return default_registry().register(implementation, plugin)


def register_plugin(plugin: object, name: str):
    """Register a plugin object in-process, through the same path as entry-point plugins."""
    return default_registry().register_plugin(plugin, name)


def unregister_plugin(name: str) -> None:
    default_registry().unregister_plugin(name)


__all__ = [
    "API_VERSION", "DECODE_STEP_TOKENS", "CallSpec", "Capabilities", "ContractError", "Decision", "DimRule", "Explanation",
    "GLAGrads", "GatedDeltaRuleGrads", "Implementation", "KDAGrads", "LayoutWarning", "NoImplementationError", "PluginError", "SimpleGLAGrads",
    "decode_step_priority", "default_registry", "hookimpl", "op", "parallel", "register", "register_plugin", "target_chip", "unregister_plugin", "use",
]

if environment.flag("TOPS_STRICT_PLUGINS"):
    # A broken plugin is fatal here, at import, rather than at the first call of an op.
    default_registry().ensure_loaded()
