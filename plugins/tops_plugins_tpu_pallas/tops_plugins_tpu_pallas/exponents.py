"""Decays as ``exp`` of an exponent masked *before* ``exp``, for every op's chunk math (docs/architecture.md "Numerics").

Where a decay must be 0 (above a chunk's diagonal, or across a gate of ``-inf``) its exponent may be
large and positive, ``-inf - -inf = NaN`` or a masked sum's ``0 * -inf = NaN``; ``exp`` of it, masked
afterwards, leaves an inf or a NaN behind (``inf * 0`` is NaN). The exponent is replaced first instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED_EXPONENT = -1e30
"""What a decay's exponent becomes where the decay must be 0: finite, so no ``inf - inf``, and ``exp`` underflows it to exactly 0."""


def masked_exp(exponent: jax.Array, kept: jax.Array | None) -> jax.Array:
    """``exp(exponent)`` where ``kept`` (None: everywhere), exactly 0 elsewhere."""
    return jnp.exp(exponent if kept is None else jnp.where(kept, exponent, MASKED_EXPONENT))


RESET_LOG_DECAY = -(2.0**100)
"""A finite stand-in for a log decay of ``-inf`` (a reset), where the kernels take it as a value: a power of two, so it
times a small integer is exact, and any sum holding it is at most ``-2**100``, whose ``exp`` is exactly 0, the
reference's ``exp(-inf)``, with no ``0 * -inf`` or ``-inf - -inf`` on the way. Only where the exponents are sums
(kda's runs) or the decay is the same for every token (``g_gamma``) is it exact: a difference of two sums that
both hold it has lost every smaller term (simple_gla's ``g`` counts its resets instead, ``LogDecays``)."""
