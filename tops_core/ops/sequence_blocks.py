"""One device's block of a sequence split over devices, and what every op's sequence-parallel algorithm does with it.

Device ``p`` of ``P`` holds tokens ``[p L, (p + 1) L)`` of every batch row (with ``cu_seqlens``, of the one packed
row). An op's algorithm (``diagonal_sequence``, ``delta_sequence``) finds the state carried into the block from the
devices before, and the cotangent of the state it passes on from the devices after; ``forward`` and ``backward`` here
then run the ordinary op on the block with them, with boundaries clipped to the block, and keep what the block owns:
the final state of every sequence that ends in it, the initial state's gradient of every sequence that starts in it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tops_core.partitioning import SequenceShards, per_row


@dataclasses.dataclass(frozen=True)
class Block:
    """Where the sequences lie in one device's block.

    Per batch row (``[B]``): ``first_end``, the local end of the first sequence segment;
    ``last_start``, the local start of the last one; ``crosses_in``/``crosses_out``, whether a
    sequence continues into the block from the device before / out of it to the device after;
    ``first_seq``/``last_seq``, the sequence of the first and last segment. Per sequence
    (``[N]``): ``starts_here``/``ends_here``, whether its first / last token is in the block
    (never for an empty one); ``empty``. ``cu_seqlens``: the boundaries clipped to the block.
    """

    length: int
    first_end: jax.Array
    last_start: jax.Array
    crosses_in: jax.Array
    crosses_out: jax.Array
    first_seq: jax.Array
    last_seq: jax.Array
    starts_here: jax.Array
    ends_here: jax.Array
    empty: jax.Array
    cu_seqlens: jax.Array | None

    @classmethod
    def of(cls, batch: int, length: int, cu_seqlens: jax.Array | None, shards: SequenceShards) -> Block:
        first, last = shards.index == 0, shards.index == shards.size - 1
        if cu_seqlens is None:  # every row is one sequence through every device
            rows = jnp.arange(batch)
            every = jnp.ones(batch, bool)
            return cls(
                length, jnp.full(batch, length), jnp.zeros(batch, jnp.int32), every & ~first, every & ~last, rows, rows,
                every & first, every & last, ~every, None,
            )
        start = shards.index * length
        end = start + length
        seq_starts, seq_ends = cu_seqlens[:-1], cu_seqlens[1:]
        nonempty = seq_starts < seq_ends
        first_seq = jnp.argmax(nonempty & (seq_starts <= start) & (start < seq_ends))
        last_seq = jnp.argmax(nonempty & (seq_starts < end) & (end <= seq_ends))
        return cls(
            length,
            first_end=jnp.minimum(seq_ends[first_seq] - start, length)[None],
            last_start=jnp.maximum(seq_starts[last_seq] - start, 0)[None],
            crosses_in=(seq_starts[first_seq] < start)[None],
            crosses_out=(seq_ends[last_seq] > end)[None],
            first_seq=first_seq[None],
            last_seq=last_seq[None],
            starts_here=nonempty & (start <= seq_starts) & (seq_starts < end),
            ends_here=nonempty & (start < seq_ends) & (seq_ends <= end),
            empty=~nonempty,
            cu_seqlens=jnp.clip(cu_seqlens - start, 0, length).astype(jnp.int32),
        )

    @property
    def covered(self) -> jax.Array:
        """``[B]``: one sequence runs through the whole block, from the device before."""
        return self.crosses_in & (self.last_start == 0)

    def to_sequences(self, rows: jax.Array, seq_of_row: jax.Array, num_seqs: int) -> jax.Array:
        """``[N, H, K, V]`` with each row's ``[H, K, V]`` at its sequence (zeros elsewhere)."""
        return jnp.zeros((num_seqs, *rows.shape[1:]), rows.dtype).at[seq_of_row].add(rows)


def num_seqs_of(arrays: dict[str, Any]) -> int:
    """``N``: the batch rows, or the packed sequences."""
    cu_seqlens = arrays["cu_seqlens"]
    return arrays["q"].shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def block_inputs(arrays: dict[str, Any], block: Block, carried: jax.Array) -> dict[str, Any]:
    """The block's inputs to the ordinary op: each sequence enters with the state ``carried`` in (``[B, H, K, V]``, for
    the sequence continuing into the block) or its own ``initial_state`` (where it starts in the block)."""
    states = block.to_sequences(carried, block.first_seq, num_seqs_of(arrays))
    if arrays["initial_state"] is not None:
        states = states + jnp.where(per_row(block.starts_here, states), arrays["initial_state"].astype(states.dtype), 0.0)
    return {**arrays, "initial_state": states, "cu_seqlens": block.cu_seqlens}


def forward(arrays: dict[str, Any], block: Block, carried: jax.Array, output_final_state: bool, shards: SequenceShards,
            run: Any) -> tuple[Any, Any]:
    """This device's ``o`` and its share of the final states, the state ``carried`` into the block known."""
    o, final_state = run(block_inputs(arrays, block, carried))
    if not output_final_state:
        return o, None
    empty = arrays["initial_state"] if arrays["initial_state"] is not None else jnp.zeros_like(final_state)
    return o, _share(block, shards, block.ends_here, final_state, empty)  # an empty sequence ends in its initial state


def backward(arrays: dict[str, Any], block: Block, carried: jax.Array, passed_on: jax.Array, do: jax.Array,
             dht: jax.Array | None, shards: SequenceShards, run: Any) -> Any:
    """This device's gradients and its share of ``dinitial_state``, the state ``carried`` in and the cotangent of the
    state ``passed_on`` to the device after (``[B, H, K, V]``, for the sequence continuing out of the block) known."""
    block_dht = block.to_sequences(passed_on, block.last_seq, num_seqs_of(arrays))
    if dht is not None:
        block_dht = block_dht + jnp.where(per_row(block.ends_here, block_dht), dht.astype(block_dht.dtype), 0.0)
    grads = run(block_inputs(arrays, block, carried), (do, block_dht), output_final_state=True)
    initial_state = arrays["initial_state"]
    if initial_state is None:
        return dataclasses.replace(grads, dinitial_state=None)
    empty = dht if dht is not None else jnp.zeros_like(block_dht)  # an empty sequence passes dht to its initial state
    dinitial_state = _share(block, shards, block.starts_here, grads.dinitial_state, empty)
    return dataclasses.replace(grads, dinitial_state=dinitial_state.astype(initial_state.dtype))


def _share(block: Block, shards: SequenceShards, owns: jax.Array, per_sequence: jax.Array, empty: jax.Array) -> jax.Array:
    """``per_sequence`` where this block ``owns`` a sequence's value, zeros elsewhere; an empty sequence's
    value (``empty``) belongs to the first device. Summed over the devices, every sequence's value once."""
    share = jnp.where(per_row(owns, per_sequence), per_sequence, 0.0)
    return share + jnp.where(per_row(block.empty & (shards.index == 0), share), empty.astype(share.dtype), 0.0)
