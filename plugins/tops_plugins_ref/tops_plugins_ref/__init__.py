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


@tops_core.hookimpl
def tops_register_implementations(register):
    """Register ``ref.recurrent`` for every op."""
    register(Implementation(
        op="simple_gla",
        name="recurrent",
        forward=simple_gla.forward,
        backward=simple_gla.backward,
        capabilities=Capabilities(
            platforms=PLATFORMS, dtypes=FLOAT_DTYPES, features=SimpleGLA.features, ndims={"g_gamma": {0, 1}},
            predicate=needs_a_cpu_device,
        ),
        priority=LOWEST_PRIORITY,
        description="float64 token-by-token NumPy scan on the CPU host (the oracle); exact hand-written reverse sweep",
    ))
    register(Implementation(
        op="kda",
        name="recurrent",
        forward=kda.forward,
        backward=kda.backward,
        capabilities=Capabilities(
            platforms=PLATFORMS, dtypes=FLOAT_DTYPES, features=KDA.features, predicate=needs_a_cpu_device,
        ),
        priority=LOWEST_PRIORITY,
        description="float64 token-by-token NumPy delta-rule scan on the CPU host (the oracle); exact hand-written reverse sweep",
    ))
    for op, module, contract in (("gla", gla, GLA), ("gated_delta_rule", gated_delta_rule, GatedDeltaRule)):
        register(Implementation(
            op=op,
            name="recurrent",
            forward=module.forward,
            backward=module.backward,
            capabilities=Capabilities(
                platforms=PLATFORMS, dtypes=FLOAT_DTYPES, features=contract.features, predicate=needs_a_cpu_device,
            ),
            priority=LOWEST_PRIORITY,
            description="float64 token-by-token NumPy scan on the CPU host (the oracle); exact hand-written reverse sweep",
        ))
