"""kda and gated_delta_rule with their sequence split over devices: every device runs its block; devices exchange
states and ``K x K`` matrices only.

The delta rule's state update is affine in the state but not diagonal: a token maps ``S`` to
``exp(g_t) (I - beta_t k_t k_t^T) S + beta_t k_t v_t^T`` (``exp(g_t)`` a decay per key for kda, per head for
gated_delta_rule), so what a device's block does to a state carried in is ``S -> M_p S + N_p`` with ``M_p`` a
``K x K`` matrix (``sequence_blocks`` says where the block's sequences lie; as for ``diagonal_sequence``, ``M_p`` is 0
unless one sequence runs through the whole block from the device before, and ``N_p`` is the state its last segment
reaches from its own start). The ordinary op computes both in one run: the columns of a state evolve independently,
so the block run on the values ``[v | 0]`` from the states ``[S_0 | I]`` (``V + K`` value columns) ends its last
segment in ``[N_p | M_p]``. An exclusive scan of the maps (``exclusive_affine_scan``) gives the state carried into
each device, and the ordinary op runs on the block from it.

The backward is the same in reverse: the cotangent of the carried state is ``dS_in(p) = U_p + M_p^T dS_in(p + 1)``
while the sequence continues out of the block. ``U_p``, what the block's outputs (and the ``dht`` of a sequence ending
in it) send back to the state entering its first segment, is that segment's ``dinitial_state`` from one backward run
of the block with nothing from the devices after; the outputs are affine in the entering state, so it does not depend
on it. A reverse scan of those maps, then one backward run with the carried state and the cotangent passed on, gives
exact gradients of the block's inputs, ``A_log`` and ``dt_bias`` included (their sum over devices).

The cost per device, beside the ordinary op on its block: a forward run with ``V + K`` value columns, and in the
backward one more backward run; ``1 + ceil(log2(P - 1))`` exchanges of a ``[B, HV, K, V]`` state and a
``[B, HV, K, K]`` matrix per scan, whatever ``T``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tops_core.ops import sequence_blocks
from tops_core.ops.base import Prepared, state_dtype
from tops_core.ops.sequence_blocks import Block
from tops_core.partitioning import SequenceShards, exclusive_affine_scan, per_row


def _maps(arrays: dict[str, Any], block: Block, run: Any) -> tuple[jax.Array, jax.Array]:
    """``(M_p, N_p)`` of each row's last sequence segment, ``[B, HV, K, K]`` and ``[B, HV, K, V]``: one forward run of the
    block on the values ``[v | 0]`` from the states ``[S_0 | I]``."""
    v = arrays["v"]
    B, L, HV, V = v.shape
    K = arrays["q"].shape[-1]
    local = sequence_blocks.block_inputs(arrays, block, jnp.zeros((B, HV, K, V), state_dtype(v.dtype)))
    states = local["initial_state"]
    identity = jnp.broadcast_to(jnp.eye(K, dtype=states.dtype), (*states.shape[:2], K, K))
    widened = {
        **local, "v": jnp.concatenate([v, jnp.zeros((B, L, HV, K), v.dtype)], axis=-1),
        "initial_state": jnp.concatenate([states, identity], axis=-1),
    }
    _, final_state = run(widened, forward=True, output_final_state=True)
    last = final_state[block.last_seq]
    return last[..., V:], last[..., :V]


def _carried_in(arrays: dict[str, Any], block: Block, shards: SequenceShards, run: Any) -> tuple[jax.Array, jax.Array]:
    """The state carried into this block from the devices before (``[B, HV, K, V]``, for rows that continue in), and
    the block's matrix ``M_p`` (0 where no sequence runs through the whole block)."""
    matrix, state = _maps(arrays, block, run)
    matrix = jnp.where(per_row(block.covered, matrix), matrix, 0.0)
    carried = exclusive_affine_scan(matrix, state, shards)
    return jnp.where(per_row(block.crosses_in, carried), carried, 0.0), matrix


def forward(arrays: dict[str, Any], prepared: Prepared, shards: SequenceShards, run: Any) -> tuple[Any, Any]:
    """This device's ``o`` and its share of the final states."""
    B, L = arrays["q"].shape[:2]
    block = Block.of(B, L, arrays["cu_seqlens"], shards)
    carried, _ = _carried_in(arrays, block, shards, run)
    return sequence_blocks.forward(arrays, block, carried, prepared.option("output_final_state"), shards, run)


def backward(arrays: dict[str, Any], cotangents: tuple[Any, ...], prepared: Prepared, shards: SequenceShards, run: Any) -> Any:
    """This device's gradients and its shares of ``dinitial_state``, ``dA_log`` and ``ddt_bias``."""
    do, dht = cotangents
    B, L = arrays["q"].shape[:2]
    block = Block.of(B, L, arrays["cu_seqlens"], shards)
    carried, matrix = _carried_in(arrays, block, shards, run)

    local = sequence_blocks.block_inputs(arrays, block, carried)
    ending = jnp.zeros_like(local["initial_state"])  # the dht of each sequence ending in the block, nothing from after it
    if dht is not None:
        ending = jnp.where(per_row(block.ends_here, ending), dht.astype(ending.dtype), 0.0)
    into_state = run(local, (do, ending), output_final_state=True).dinitial_state[block.first_seq]  # U_p
    through = jnp.where(per_row(block.covered & block.crosses_out, matrix), jnp.swapaxes(matrix, -1, -2), 0.0)
    passed_on = exclusive_affine_scan(through, into_state.astype(carried.dtype), shards, reverse=True)
    passed_on = jnp.where(per_row(block.crosses_out, passed_on), passed_on, 0.0)
    return sequence_blocks.backward(arrays, block, carried, passed_on, do, dht, shards, run)
