"""The sequences of one packed kda chunk (``tpu_pallas.varlen``): which rows start one, and the per-sequence
states that enter at a sequence's first row and leave at its last.

``chunkwise`` takes a packed chunk whole: a sequence's first row is a reset (``resets``), so the state carried
into the chunk reaches only the rows of the sequence the chunk continues, and no pair of tokens of two
sequences interacts (the inverse is block-diagonal by sequence). What a reset cannot say is the state a
sequence starts from, or where its state leaves. With ``a`` a sequence's first row in the chunk, ``e`` its
end (both clipped to the chunk) and every exponent a run sum of the gate as given (``chunkwise.run_sums``:
exact, at most zero):

- **entering**: sequence ``n`` starting on row ``a`` from ``S0 = initial_state[n]`` adds
  ``(k_i * exp(g_a + ... + g_i)) S0`` on its rows ``i`` to the chunk's ``k S`` (the writes' residual) and
  ``(q_i * exp(...)) S0`` to its output; when it is the chunk's last sequence,
  ``exp(g_a + ... + g_{C-1}) * S0`` to the state leaving the chunk;
- **leaving**: a sequence that ends inside the chunk leaves
  ``exp(g_a + ... + g_{e-1}) * S_in + sum_{j in [a, e)} (k_j * exp(g_{j+1} + ... + g_{e-1}))^T delta_j``,
  with ``S_in`` the carried state when it began before the chunk (``a = 0``), else ``S0`` or zeros. It goes to
  ``final_state[n]`` by a DMA.

Only the sequences with a boundary in the chunk are visited (``fori_loop``s over bounds read from SMEM), so a
chunk inside one sequence costs nothing more. The per-sequence states live in HBM
(``simple_gla.varlen.SequenceStates``: boundaries are traced, so no block index map could fetch them).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from tops_plugins_tpu_pallas.grid import Work
from tops_plugins_tpu_pallas.kda.chunkwise import column_sums, run_sums
from tops_plugins_tpu_pallas.layout import Geometry
from tops_plugins_tpu_pallas.mxu import COLUMNS_BY_COLUMNS, matmul, row_and_column_iotas
from tops_plugins_tpu_pallas.simple_gla.varlen import SequenceStates

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Entering:
    """What the initial states of the sequences starting in a chunk add to it (``chunkwise.chunk_step``)."""

    keys: jax.Array  # (C, value block): to k S, the residual's
    queries: jax.Array  # (C, value block): to the output
    leaving: jax.Array  # (K, value block): to the state leaving the chunk


@dataclasses.dataclass(frozen=True)
class PackedChunk:
    """Chunk ``number`` of a packed call: its first token and the sequences it overlaps, read from SMEM
    (``simple_gla.varlen.boundaries``), and the per-sequence states of the grid point (``states``)."""

    cu_seqlens: jax.Array  # the SMEM ref
    first_token: jax.Array
    first_sequence: jax.Array
    last_sequence: jax.Array
    chunk_size: int
    states: SequenceStates

    @classmethod
    def of(cls, refs: dict, number: jax.Array, chunk_size: int, states: SequenceStates) -> PackedChunk:
        return cls(
            refs["cu_seqlens"], number * chunk_size, refs["first_sequence"][number], refs["last_sequence"][number],
            chunk_size, states,
        )

    def _rows_of(self, sequence: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``[start, end)``: the rows of the chunk ``sequence`` covers (empty when it covers none)."""
        C = self.chunk_size
        return (jnp.clip(self.cu_seqlens[sequence] - self.first_token, 0, C),
                jnp.clip(self.cu_seqlens[sequence + 1] - self.first_token, 0, C))

    def _begins_before(self, sequence: jax.Array) -> jax.Array:
        return self.cu_seqlens[sequence] < self.first_token

    def resets(self) -> jax.Array:
        """``(C, 1)`` bool: the rows that are a sequence's first token.

        The chunk's first sequence starts on row 0 or before the chunk (then on no row), the others inside it.
        An empty sequence between them starts where the next one does, so it marks nothing of its own.
        """
        rows = lax.broadcasted_iota(jnp.int32, (self.chunk_size, 1), 0)

        def mark(n, starts):  # int32: Mosaic carries no bool vectors through a loop
            return jnp.where(rows == self.cu_seqlens[n] - self.first_token, 1, starts)

        return lax.fori_loop(self.first_sequence, self.last_sequence + 1, mark, jnp.zeros((self.chunk_size, 1), jnp.int32)) > 0

    def entering(self, q: jax.Array, k: jax.Array, g: jax.Array, operands) -> Entering | None:
        """The initial states' terms (``q``, ``k`` as the chunk math holds them, ``g`` ``(C, K)`` as given but ``-inf``
        taken as ``RESET_LOG_DECAY``), or None without ``initial_state`` (every sequence starts from zeros, which a
        reset already is)."""
        if not self.states.has("initial_state"):
            return None
        C, K = k.shape
        Vb = self.states.shape[1]
        i, t = row_and_column_iotas(C)
        rows = lax.broadcasted_iota(jnp.int32, (C, 1), 0)

        def add(n, terms):
            keys, queries, leaving = terms
            start, end = self._rows_of(n)
            initial = self.states.load("initial_state", "loaded", n, True)
            inside = (rows >= start) & (rows < end)
            decays = jnp.where(inside, jnp.exp(run_sums((start <= t) & (t <= i), g)), 0.0)
            keys = keys + matmul(k * decays, initial, operands)
            queries = queries + matmul(q * decays, initial, operands)
            # The chunk's last sequence runs on to its last row: its state, decayed from row a, leaves the chunk.
            whole = jnp.exp(column_sums(g, rows >= start))
            leaving = leaving + jnp.where(n == self.last_sequence, whole * initial, 0.0)
            return keys, queries, leaving

        # Sequences that start in the chunk: all it overlaps but a first one begun before it.
        first = self.first_sequence + self._begins_before(self.first_sequence).astype(jnp.int32)
        zeros = (jnp.zeros((C, Vb), _F32), jnp.zeros((C, Vb), _F32), jnp.zeros((K, Vb), _F32))
        return Entering(*lax.fori_loop(first, self.last_sequence + 1, add, zeros))

    def leave(self, k: jax.Array, g: jax.Array, delta: jax.Array, carried: jax.Array, operands) -> None:
        """Write the final state of every sequence that ends in the chunk (nothing without ``final_state``):
        ``delta`` the chunk's writes, ``carried`` the state that entered the chunk."""
        if not self.states.has("final_state"):
            return
        C = self.chunk_size
        j, t = row_and_column_iotas(C)
        rows = lax.broadcasted_iota(jnp.int32, (C, 1), 0)

        def write(n, unused):
            start, end = self._rows_of(n)
            begun = self._begins_before(n)
            # A sequence that began in this chunk reads its initial state a second time (``entering``'s copy is gone).
            entering = jnp.where(begun, carried, self.states.load("initial_state", "loaded", n, ~begun))
            inside = (rows >= start) & (rows < end)
            decays = jnp.where(inside, jnp.exp(run_sums((j < t) & (t < end), g)), 0.0)
            whole = jnp.exp(column_sums(g, inside))
            final = whole * entering + matmul(k * decays, delta, operands, COLUMNS_BY_COLUMNS)
            # An empty sequence covers no row of any chunk: its final state is set around the kernel.
            self.states.store("final_state", "leaving", n, final, end > start)
            return unused

        # Sequences that end in the chunk: all it overlaps but a last one going on past it.
        goes_on = self.cu_seqlens[self.last_sequence + 1] > self.first_token + C
        lax.fori_loop(self.first_sequence, self.last_sequence + 1 - goes_on.astype(jnp.int32), write, 0)


def sequence_work(geometry: Geometry, initial_state: bool, final_state: bool) -> Work:
    """What one sequence's states add, per head and value block, counted as ``chunkwise.chunk_work`` counts: a run-sum
    section, a column of sums and two state products entering, one of each leaving, and their exps."""
    C, K, Vb = geometry.chunk_size, geometry.padded_key_dim, geometry.value_block
    sums = Work(flops=2 * C * C * K + 2 * C * K, transcendentals=C * K + K)
    entering = sums + Work(flops=2 * 2 * C * K * Vb) if initial_state else Work()
    leaving = sums + Work(flops=2 * C * K * Vb) if final_state else Work()
    return entering + leaving
