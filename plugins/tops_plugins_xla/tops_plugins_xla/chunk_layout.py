"""Chunk-aligned token layouts and packed sequences' boundaries: pure index math.

``dense_layout``: each batch row is one sequence in regular chunks; only its end needs padding.
``packed_layout`` (``cu_seqlens``, ``B == 1``, ``N`` packed sequences) moves every sequence to its
own run of chunks, ``max(1, ceil(L / C))`` of them, padded with empty slots, so that a chunk never
holds tokens of two sequences; a sequence of length 0 still owns one (empty) chunk, so every
sequence has a first and a last chunk and needs no special case. ``num_chunks = T // C + N``
bounds the total, so shapes stay static while ``cu_seqlens`` may be a traced value under ``jit``;
chunks past the last sequence are empty. kda's sweeps run in it; simple_gla runs packed tokens in
the dense layout, cutting the state at ``tops_core.packing.sequence_starts``, and groups tokens by sequence in a
``packed_layout`` of short pieces.

Padded slots hold zeros and must not decay the state (``token_mask`` tells them apart).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from tops_core.packing import sequence_of

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Where the tokens of one call sit in a layout of ``rows x num_chunks x chunk_size`` slots.

    ``rows`` is ``B`` (one sequence per row) or ``1`` (packed). The sequences of a row are
    numbered ``0 .. sequences_per_row - 1``; row ``r``'s sequence ``s`` is sequence
    ``r * sequences_per_row + s`` of the call (its row of ``initial_state`` and final state).
    """

    num_tokens: int
    chunk_size: int
    num_chunks: int
    sequences_per_row: int
    chunk_sequence: Array
    """``[num_chunks]`` int32: the sequence (within its row) each chunk belongs to."""
    chunk_is_first: Array
    """``[num_chunks]`` bool: the chunk starts its sequence (the state is reset to its initial state)."""
    chunk_is_last: Array
    """``[num_chunks]`` bool: the chunk ends its sequence (its final state is read after it)."""
    slot_token: Array | None = None
    """``[num_slots]`` int32: the token in each slot, ``num_tokens`` for padding; None: slot ``i`` holds token ``i``."""
    token_slot: Array | None = None
    """``[num_tokens]`` int32: the slot of each token; None: token ``i`` sits in slot ``i``."""

    @property
    def num_slots(self) -> int:
        return self.num_chunks * self.chunk_size

    @property
    def one_sequence_per_row(self) -> bool:
        """Static: each row is one sequence, so states never reset between its chunks."""
        return self.sequences_per_row == 1 and self.slot_token is None

    def token_mask(self) -> Array:
        """``[num_slots]`` bool: True where a slot holds a token, False for padding."""
        if self.slot_token is None:
            return jnp.arange(self.num_slots) < self.num_tokens
        return self.slot_token < self.num_tokens

    def pack(self, x: Array) -> Array:
        """``[rows, num_tokens, ...]`` -> ``[rows, num_slots, ...]``, zeros in padded slots."""
        if self.slot_token is None:
            pad = [(0, 0)] * x.ndim
            pad[1] = (0, self.num_slots - self.num_tokens)
            return jnp.pad(x, pad) if self.num_slots != self.num_tokens else x
        return jnp.take(x, self.slot_token, axis=1, mode="fill", fill_value=0)

    def unpack(self, x: Array) -> Array:
        """``[rows, num_slots, ...]`` -> ``[rows, num_tokens, ...]``: the inverse of ``pack``."""
        if self.token_slot is None:
            return x[:, : self.num_tokens]
        return jnp.take(x, self.token_slot, axis=1, mode="clip")


def dense_layout(num_tokens: int, chunk_size: int) -> ChunkLayout:
    """One sequence per batch row: pad the end of each row to a whole number of chunks."""
    num_chunks = -(-num_tokens // chunk_size)
    chunks = jnp.arange(num_chunks)
    return ChunkLayout(
        num_tokens=num_tokens,
        chunk_size=chunk_size,
        num_chunks=num_chunks,
        sequences_per_row=1,
        chunk_sequence=jnp.zeros(num_chunks, jnp.int32),
        chunk_is_first=chunks == 0,
        chunk_is_last=chunks == num_chunks - 1,
    )


def packed_layout(cu_seqlens: Array, num_tokens: int, chunk_size: int) -> ChunkLayout:
    """Packed sequences (``B == 1``) at ``cu_seqlens`` (``[N + 1]``, may be traced): each starts a chunk."""
    num_sequences = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    chunks_per_sequence = jnp.maximum(1, -(-lengths // chunk_size))
    first_chunk = jnp.cumsum(chunks_per_sequence) - chunks_per_sequence
    last_chunk = first_chunk + chunks_per_sequence - 1
    # sum(max(1, ceil(L / C))) <= sum(L // C + 1) <= T // C + N, whatever the lengths.
    num_chunks = num_tokens // chunk_size + num_sequences

    chunks = jnp.arange(num_chunks, dtype=jnp.int32)
    # Chunks past the last sequence's last chunk land on the last sequence, as padding.
    chunk_sequence = jnp.searchsorted(first_chunk, chunks, side="right").astype(jnp.int32) - 1
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    sequence = sequence_of(cu, tokens)
    token_slot = first_chunk[sequence] * chunk_size + tokens - starts[sequence]
    # Scattered, slot_token is computed once: as an expression of the slot, XLA fused it into the
    # gathers that read it and recomputed it for every element gathered (K of them per slot),
    # which took longer than the gathers themselves.
    slot_token = jnp.full(num_chunks * chunk_size, num_tokens, jnp.int32).at[token_slot].set(tokens, unique_indices=True)

    return ChunkLayout(
        num_tokens=num_tokens,
        chunk_size=chunk_size,
        num_chunks=num_chunks,
        sequences_per_row=num_sequences,
        chunk_sequence=chunk_sequence,
        chunk_is_first=first_chunk[chunk_sequence] == chunks,
        chunk_is_last=last_chunk[chunk_sequence] == chunks,
        slot_token=slot_token,
        token_slot=token_slot.astype(jnp.int32),
    )
