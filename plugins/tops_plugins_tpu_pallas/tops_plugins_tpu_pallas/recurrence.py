"""What kda's fused machinery (``kda/fused.py``, ``kda/backward.py``, ``kda/varlen.py``) needs to know of an op to run it:
the kda, gla and gated_delta_rule kernels are that machinery with one ``Recurrence`` each.

The three ops share a chunk's shape of computation: factors that depend only on the chunk's own rows (decays, pair
products and, with the delta rule, the inverse of ``I + diag(beta) Akk``), then the chunk's way through the state. They
differ in the gate (one log decay per key, ``[B, T, HV, K]``, or one per head, ``[B, T, HV]``), in whether a chunk solves
for its writes (the delta rule, with ``beta``) or writes its values as they are (gla), and in how the factors are built.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from tops_plugins_tpu_pallas.exponents import RESET_LOG_DECAY
from tops_plugins_tpu_pallas.mxu import row_to_column
from tops_plugins_tpu_pallas.simple_gla.fused import gates_along_lanes


@dataclasses.dataclass(frozen=True)
class Recurrence:
    """One op's chunk math on the fused grid.

    ``factors(chunks, operands=, fine_size=, inverses=None)``: every chunk's ``Factors`` (``kda.chunkwise``) from ``(q,
    k, g, beta, resets)`` each (``beta`` None without the delta rule; ``g`` as the kernel read it, ``-inf`` a reset;
    ``resets`` None or a packed chunk's ``(C, 1)`` sequence starts; ``fine_size``: kda's bounded sub-chunk,
    ``kda.chunkwise.sub_chunk_size``, or None; ``inverses``: the chunks' inverses where they are
    known, ``kda.chunkwise.inverses_of``); a pure function of its arrays, so its VJP is the backward's.
    ``through_state(q, k, v, beta, state, entering, factors, operands)``: ``(o, state leaving, writes)``, the writes being
    what each row adds to the state (``delta`` of the delta rule, ``v`` itself without it).
    ``ahead(q, k, v, beta, factors, operands)`` (optional): ``factors`` with ``Factors.ahead`` set to what
    ``through_state`` needs that does not depend on the state, computed for every chunk before the chain (where
    ``Factors.ahead`` is None, as the backward's VJP of one chunk calls it, ``through_state`` computes what it needs
    itself: gla's ``ahead_of_state`` there, the delta rule's solve, ``kda.chunkwise.ahead_of_walk``).
    ``chunk_work(geometry, use_qk_l2norm, lower_bound, packed)``, ``chunk_body_vmem(geometry, lower_bound)`` and
    ``kept_vmem(geometry, lower_bound)``: what a chunk computes, holds while it works, and keeps (bytes) from its factors
    to its turn at the state, for the launch plans.
    """

    op: str
    gate_per_key: bool  # g [B, T, HV, K] (kda, gla), else [B, T, HV] (gated_delta_rule)
    delta_rule: bool  # beta [B, T, HV] and the writes' solve (kda, gated_delta_rule)
    factors: Callable
    through_state: Callable
    chunk_work: Callable
    chunk_body_vmem: Callable
    kept_vmem: Callable
    arms: Callable
    """``arms(gs, step, fine_size, fast, resets)``: ``step(fine_size)`` at the ``fine_size`` a grid step's gates allow,
    its fast arms where ``fast`` (``fast_walk``, ``fast_gradients``), chosen in the kernel (``tops_core.tpu.fast_paths``):
    kda's and gla's ``kda.chunkwise.by_mildness``, gated_delta_rule's ``gated_delta_rule.chunkwise.by_finiteness``.
    ``resets``: each chunk's packed sequence starts (``(C, 1)`` bool, they reset the state), or None."""
    ahead: Callable | None = None
    walked_link: Callable | None = None
    """``walked_link(k, v, beta, state, entering, factors, operands)`` (optional): ``through_state`` for the states alone,
    ``(S_out, known)``, where ``through_state`` takes ``known=`` (its products with the state, ``kda.chunkwise.StateProducts``)
    from it: the backward's gradients kernel, walking its states itself, then computes no link's products twice."""
    fast_walk: bool = False
    """The forward kernel's and the checkpoints walk's factors take the fast arms the step's gates allow (``arms``): gla's
    where every chunk, or every 32 tokens, decays mildly (``kda.chunkwise.every_chunk_mild``), gated_delta_rule's where
    every gate is finite."""
    fast_gradients: bool = False
    """The same in the backward's gradients kernel, the choice taken around its whole step (``kda.backward``; not kda's:
    its ``dg`` in bf16 cannot afford it)."""

    def step_body_vmem(self, geometry, lower_bound: float | None = None) -> int:
        """An upper estimate of the values one grid step of ``chunk_steps`` holds at once (bytes): what each of its chunks
        keeps, plus one chunk's working values."""
        return geometry.chunks_per_step * self.kept_vmem(geometry, lower_bound) + self.chunk_body_vmem(geometry, lower_bound)

    def gates_along_lanes(self, chunk_size: int) -> bool:
        """Whether the kernels read a gate per head laid out ``[B, HV, T]`` (``blocks.gate_rows``) and take each chunk's as a
        row ``(1, C)``, where the chunks fill whole 128-lane rows (``simple_gla.fused.gates_along_lanes``); else as it is,
        ``[B, T, HV]``, a ``(C, 1)`` column each. A gate per key is read as ``k`` is."""
        return gates_along_lanes(not self.gate_per_key, chunk_size)

    def per_key_log_decays(self, g: jax.Array, key_dim: int) -> jax.Array:
        """``g`` as kda's per-sequence terms (``kda.sequences``) take it: ``(C, K)`` (a gate per head, its ``(C, 1)`` column
        or ``(1, C)`` row, given to every key), ``-inf`` as ``RESET_LOG_DECAY`` (those terms sum runs of it, and a mask's 0
        times ``-inf`` is NaN)."""
        if not self.gate_per_key:
            column = row_to_column(g) if g.shape[0] == 1 else g
            g = jnp.broadcast_to(column, (column.shape[0], key_dim))
        return jnp.maximum(g, RESET_LOG_DECAY)
