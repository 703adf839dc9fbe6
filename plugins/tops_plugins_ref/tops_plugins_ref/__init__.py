"""Float64 reference implementations of the tops ops (the oracle).

Each op is the recurrence of docs/ops.md computed token by token in float64 NumPy on the CPU host,
whatever the caller's device and dtype; every other implementation is judged against it. It supports every
call and ranks below every other implementation, so the dispatcher picks it only when forced
(``implementation="ref.recurrent"``) or when nothing else supports a call.
"""

import jax

import tops_core
from tops_core import Capabilities, Implementation
from tops_core.capabilities import FLOAT_DTYPES
from tops_core.callspec import PLATFORMS
from tops_core.ops.gated_delta_rule import GatedDeltaRule
from tops_core.ops.gla import GLA
from tops_core.ops.kda import KDA
from tops_core.ops.simple_gla import SimpleGLA
from tops_plugins_ref import gated_delta_rule, gla, kda, simple_gla

TOPS_CORE_API_VERSION = 1

# Below the 0 an implementation gets on a platform its table leaves out: the dispatcher breaks
# priority ties by name, and the oracle must never win a tie against a real kernel.
LOWEST_PRIORITY = {platform: -1 for platform in PLATFORMS}


def needs_a_cpu_device(spec) -> str | None:
    """Reject every call in a process whose JAX has no CPU backend: ``jax.pure_callback`` places the
    host function's operands on a CPU device, so without one the call would fail inside the callback."""
    try:
        jax.devices("cpu")
    except RuntimeError:
        return "needs a CPU device for its float64 host scan, and JAX has none (JAX_PLATFORMS leaves cpu out)"
    return None


# Each op: its module of entry points, its contract (what a call of it may name) and what the reference sweeps.
_OPS = {
    "simple_gla": (simple_gla, SimpleGLA, "float64 token-by-token NumPy scan"),
    "kda": (kda, KDA, "float64 token-by-token NumPy delta-rule scan"),
    "gla": (gla, GLA, "float64 token-by-token NumPy scan"),
    "gated_delta_rule": (gated_delta_rule, GatedDeltaRule, "float64 token-by-token NumPy delta-rule scan (kda's, one gate for every key)"),
}


@tops_core.hookimpl
def tops_register_implementations(register):
    """Register ``ref.recurrent`` for every op."""
    for op, (module, contract, sweep) in _OPS.items():
        register(Implementation(
            op=op,
            name="recurrent",
            forward=module.forward,
            backward=module.backward,
            capabilities=Capabilities(
                platforms=PLATFORMS, dtypes=FLOAT_DTYPES, features=contract.features,
                ndims={name: {0, 1} for name in contract.variable_ndims}, predicate=needs_a_cpu_device,
            ),
            priority=LOWEST_PRIORITY,
            description=f"{sweep} on the CPU host (the oracle); exact hand-written reverse sweep",
        ))
