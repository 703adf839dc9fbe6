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
(``grid.SequenceStates``: boundaries are traced, so no block index map could fetch them).

Each term is a pure function of the chunk's values and one sequence's bounds (``_entering_terms``,
``_carried_through``, ``_writes``), so the backward (``kda.backward``) takes their VJPs one sequence at a time
(``leave_gradients``, ``entering_gradients``): the same math, differentiated as computed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from tops_plugins_tpu_pallas.kda.chunkwise import column_sums, run_sums
from tops_plugins_tpu_pallas.layout import Geometry
from tops_plugins_tpu_pallas.mxu import COLUMNS_BY_COLUMNS, matmul, row_and_column_iotas
from tops_plugins_tpu_pallas.grid import SequenceStates, Work
from tops_plugins_tpu_pallas.simple_gla.varlen import chunk_sequences

_F32 = jnp.float32


def _inside(start: jax.Array, end: jax.Array, chunk_size: int) -> jax.Array:
    rows = lax.broadcasted_iota(jnp.int32, (chunk_size, 1), 0)
    return (rows >= start) & (rows < end)


def _entering_terms(start, end, is_last, q, k, g, initial, operands) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """What ``initial`` (the initial state of the sequence on rows ``[start, end)``, which starts in the chunk) adds to
    the chunk's ``k S``, its output (None without ``q``), and (``is_last``: the chunk's last sequence) the state leaving it."""
    C = k.shape[0]
    i, t = row_and_column_iotas(C)
    decays = jnp.where(_inside(start, end, C), jnp.exp(run_sums((start <= t) & (t <= i), g)), 0.0)
    # The chunk's last sequence runs on to its last row: its state, decayed from row a, leaves the chunk.
    whole = jnp.exp(column_sums(g, _inside(start, C, C)))
    return (
        matmul(k * decays, initial, operands), None if q is None else matmul(q * decays, initial, operands),
        jnp.where(is_last, whole * initial, 0.0),
    )


def _carried_through(start, end, g, entering) -> jax.Array:
    """The state entering the sequence on rows ``[start, end)``, decayed over those rows."""
    return jnp.exp(column_sums(g, _inside(start, end, g.shape[0]))) * entering


def _writes(start, end, k, g, delta, operands) -> jax.Array:
    """The writes ``delta`` of rows ``[start, end)``, each decayed to the sequence's end: its final state's other part."""
    C = k.shape[0]
    j, t = row_and_column_iotas(C)
    decays = jnp.where(_inside(start, end, C), jnp.exp(run_sums((j < t) & (t < end), g)), 0.0)
    return matmul(k * decays, delta, operands, COLUMNS_BY_COLUMNS)


@dataclasses.dataclass(frozen=True)
class PackedChunk:
    """Chunk ``number`` of a packed call: its first token and the sequences it overlaps, read from SMEM
    (``simple_gla.varlen.boundaries``), its ``resets``, and the per-sequence states of the grid point (``states``)."""

    cu_seqlens: jax.Array  # the SMEM ref
    first_token: jax.Array
    first_sequence: jax.Array
    last_sequence: jax.Array
    chunk_size: int
    states: SequenceStates
    resets: jax.Array  # bool: the rows that are a sequence's first token, laid out as the chunk's gate, (C, 1) or (1, C)
    past_end: jax.Array | bool  # a padded grid's chunk past the end of T: the middle of the last sequence, no boundary

    @classmethod
    def of(cls, refs: dict, number: jax.Array, geometry: Geometry, states: SequenceStates, along_lanes: bool) -> PackedChunk:
        """Chunk ``number`` of the packed ``T``, its sequences (``varlen.chunk_sequences``) and its resets from the bits of
        ``start_bits`` in SMEM (``fused.packed_operands``): a shift of the row's word by the row, compared, exact and
        without a loop over the chunk's sequences. A chunk past the end has no reset and no boundary. ``along_lanes``: the
        resets as a row ``(1, C)``, as the kernel reads a gate per head along lanes (``Recurrence.gates_along_lanes``),
        else as a column ``(C, 1)``."""
        chunk_size = geometry.chunk_size
        first_sequence, last_sequence = chunk_sequences(refs, number, geometry)
        past_end = geometry.past_end(number)
        word_of = geometry.real_chunk(number) * (chunk_size // 32)
        axis = 1 if along_lanes else 0
        rows = lax.broadcasted_iota(jnp.int32, (1, chunk_size) if along_lanes else (chunk_size, 1), axis)
        word = refs["start_bits"][word_of]
        for index in range(1, chunk_size // 32):
            word = jnp.where(rows >= 32 * index, refs["start_bits"][word_of + index], word)
        resets = (lax.shift_right_logical(word, rows % 32) & 1) > 0
        if geometry.chunks_past_end:
            resets = resets & jnp.logical_not(past_end)
        return cls(refs["cu_seqlens"], number * chunk_size, first_sequence, last_sequence, chunk_size, states, resets, past_end)

    def _rows_of(self, sequence: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``[start, end)``: the rows of the chunk ``sequence`` covers (empty when it covers none)."""
        C = self.chunk_size
        return (jnp.clip(self.cu_seqlens[sequence] - self.first_token, 0, C),
                jnp.clip(self.cu_seqlens[sequence + 1] - self.first_token, 0, C))

    def _begins_before(self, sequence: jax.Array) -> jax.Array:
        return self.cu_seqlens[sequence] < self.first_token

    def _goes_on(self, sequence: jax.Array) -> jax.Array:
        return (self.cu_seqlens[sequence + 1] > self.first_token + self.chunk_size) | self.past_end

    def _starting(self) -> tuple[jax.Array, jax.Array]:
        """The bounds of a loop over the sequences that start in the chunk: all it overlaps but a first one begun before it."""
        return self.first_sequence + self._begins_before(self.first_sequence).astype(jnp.int32), self.last_sequence + 1

    def _ending(self) -> tuple[jax.Array, jax.Array]:
        """The bounds of a loop over the sequences that end in the chunk: all it overlaps but a last one going on past it."""
        return self.first_sequence, self.last_sequence + 1 - self._goes_on(self.last_sequence).astype(jnp.int32)

    def _final_gradient(self, sequence: jax.Array, ends_here: jax.Array) -> jax.Array:
        """``dht[sequence]`` (copied only ``ends_here``), zeros elsewhere."""
        return jnp.where(ends_here, self.states.load("dht", sequence, ends_here), 0.0)

    def entering(self, q: jax.Array | None, k: jax.Array, g: jax.Array, operands) -> tuple[jax.Array, ...] | None:
        """The initial states' terms ``(keys, queries, leaving)`` for ``chunkwise.through_state`` (``q``, ``k`` as the chunk math
        holds them, ``g`` ``(C, K)`` as given but ``-inf`` taken as ``RESET_LOG_DECAY``), or None without
        ``initial_state`` (every sequence starts from zeros, which a reset already is). ``q`` None: ``queries`` None."""
        if not self.states.has("initial_state"):
            return None
        C, K = k.shape
        Vb = self.states.shape[1]

        def add(n, terms):
            start, end = self._rows_of(n)
            initial = self.states.load("initial_state", n, True)
            added = _entering_terms(start, end, n == self.last_sequence, q, k, g, initial, operands)
            return tuple(term + more for term, more in zip(terms, (x for x in added if x is not None)))

        zeros = (jnp.zeros((C, Vb), _F32), *([] if q is None else [jnp.zeros((C, Vb), _F32)]), jnp.zeros((K, Vb), _F32))
        sums = lax.fori_loop(*self._starting(), add, zeros)
        return sums if q is not None else (sums[0], None, sums[1])

    def leave(self, k: jax.Array, g: jax.Array, delta: jax.Array, carried: jax.Array, operands) -> None:
        """Write the final state of every sequence that ends in the chunk (nothing without ``final_state``):
        ``delta`` the chunk's writes, ``carried`` the state that entered the chunk."""
        if not self.states.has("final_state"):
            return

        def write(n, unused):
            start, end = self._rows_of(n)
            begun = self._begins_before(n)
            # A sequence that began in this chunk reads its initial state a second time (``entering``'s copy is gone); its
            # first read read its successor's ahead.
            entering = jnp.where(begun, carried, self.states.load("initial_state", n, ~begun, read_ahead=0))
            final = _carried_through(start, end, g, entering) + _writes(start, end, k, g, delta, operands)
            # An empty sequence covers no row of any chunk: its final state is set around the kernel.
            self.states.store("final_state", n, final, end > start)
            return unused

        lax.fori_loop(*self._ending(), write, 0)

    # -- the backward (kda.backward): the VJPs of the per-sequence terms above ---------------------------------------

    def leave_gradients(self, k, g, delta, carried, operands) -> tuple[jax.Array, ...] | None:
        """``(dk, dg, ddelta, dcarried)`` from ``dht`` of the sequences that end in the chunk (None without ``dht``).

        A sequence that starts in the chunk contributes its writes' part only: what its initial state carries through is
        taken, with that state's other terms, by ``entering_gradients``."""
        if not self.states.has("dht"):
            return None

        def add(n, sums):
            start, end = self._rows_of(n)
            begun = self._begins_before(n)
            dfinal = self._final_gradient(n, end > start)  # loaded before the work: its DMA's branches end a block

            def final(k, g, delta, carried):
                return _carried_through(start, end, g, jnp.where(begun, carried, 0.0)) + _writes(start, end, k, g, delta, operands)

            _, vjp = jax.vjp(final, k, g, delta, carried)
            return tuple(total + more for total, more in zip(sums, vjp(dfinal)))

        return lax.fori_loop(*self._ending(), add, tuple(jnp.zeros(x.shape, _F32) for x in (k, g, delta, carried)))

    def entering_gradients(self, q, k, g, dentering, operands) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(dq, dk, dg)`` of the initial states' terms, from their cotangents ``dentering`` (``through_state``'s VJP) and, for a
        sequence that also ends in the chunk, ``dht``; writes ``dinitial_state`` of every sequence that starts in the chunk."""
        with_final = self.states.has("dht")

        def add(n, sums):
            start, end = self._rows_of(n)
            initial = self.states.load("initial_state", n, True)
            cotangents = tuple(dentering)

            def terms(q, k, g, initial):
                entering = _entering_terms(start, end, n == self.last_sequence, q, k, g, initial, operands)
                return (*entering, _carried_through(start, end, g, initial)) if with_final else entering

            if with_final:
                cotangents += (self._final_gradient(n, (end > start) & ~self._goes_on(n)),)
            _, vjp = jax.vjp(terms, q, k, g, initial)
            dq, dk, dg, dinitial = vjp(cotangents)
            # An empty sequence's gradient (dht[n] or zeros: its final state is its initial state) is set around the kernel.
            self.states.store("dinitial_state", n, dinitial, end > start)
            return tuple(total + more for total, more in zip(sums, (dq, dk, dg)))

        return lax.fori_loop(*self._starting(), add, tuple(jnp.zeros(x.shape, _F32) for x in (q, k, g)))


def sequence_work(geometry: Geometry, initial_state: bool, final_state: bool) -> Work:
    """What one sequence's states add, per head and value block, counted as ``chunkwise.chunk_work`` counts: a run-sum
    section, a column of sums and two state products entering, one of each leaving, and their exps."""
    C, K, Vb = geometry.chunk_size, geometry.padded_key_dim, geometry.value_block
    sums = Work(flops=2 * C * C * K + 2 * C * K, transcendentals=C * K + K)
    entering = sums + Work(flops=2 * 2 * C * K * Vb) if initial_state else Work()
    leaving = sums + Work(flops=2 * C * K * Vb) if final_state else Work()
    return entering + leaving
