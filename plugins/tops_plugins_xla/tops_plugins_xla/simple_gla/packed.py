"""What packed sequences' initial and final states add to simple_gla's chunked stream, by linearity.

The chunk sweeps run packed tokens as one stream in regular chunks, every sequence start cutting
the state as a gate of ``-inf`` would, from zero states: without states that is the whole answer.
The recurrence is linear in the initial state and in the tokens' writes, so the states of
sequence ``n`` only add (``q`` times ``scale``; ``i, j`` its tokens)::

    o_i      += alpha_i q_i h0_n
    final_n   = gamma_n h0_n + sum_j omega_j k_j^T v_j

with ``alpha_i`` the decay from the sequence's start to token ``i`` (inclusive), ``omega_j`` from
token ``j`` (exclusive) to the sequence's end and ``gamma_n`` over the whole sequence (1 when it
is empty); each is 0 across a gate of ``-inf``. The exponents are sums inside one sequence, made
by segmented scans that restart at every sequence, never differences of sums over the whole
stream (which would carry that sum's rounding into every decay).

Both products are ragged: each token meets its own sequence's ``K x V`` matrix, and each
sequence sums its own tokens' outer products. They run over *pieces* of at most ``W`` tokens of
one sequence (``Pieces``, from a ``packed_layout`` at ``W``, ``piece_size``: about twice the mean
length). Each sequence's first piece takes part in one product batched over the sequences, which
reads ``h0`` (or ``dht``) and writes the final states (or ``dinitial_state``) in place, with
``N W`` (about ``2 T``) token slots; the pieces of longer sequences past their first, at most
``T // W``, are added in a loop that runs once per such piece. So the cost is that of the
tokens plus about one pass over the ``N H K V`` states, which a call with states reads or
writes anyway.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from tops_core.packing import sequence_of, sequence_starts
from tops_plugins_xla.chunk_layout import packed_layout
from tops_plugins_xla.sweep import einsum

Array = jax.Array


def piece_size(num_tokens: int, num_sequences: int) -> int:
    """Tokens per piece: the power of two at or above twice the mean length (at most ``T``'s).

    A first piece per sequence costs ``W`` slots (``K V`` multiply-adds each), so all of them cost
    ``N W``, about ``2 T``; twice the mean leaves most sequences of an even packing in one piece,
    and longer ones to the loop over the other pieces.
    """
    mean = -(-num_tokens // max(num_sequences, 1))
    return min(_power_of_two_at_least(2 * mean), _power_of_two_at_least(num_tokens))


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class PackedStates:
    """The decays and the pieces of one packed call; arrays are ``[1, T, H, .]`` as the call's."""

    pieces: Pieces
    starts: Array
    """``[T]`` bool: the token starts its sequence."""
    ends: Array
    """``[T]`` bool: the token ends its sequence."""
    sequence: Array
    """``[T]`` int32: the token's sequence."""
    from_start: Array
    """``[1, T, H, 1]``: ``alpha``, the decay from the sequence's start to each token (inclusive)."""
    to_end: Array
    """``[1, T, H, 1]``: ``omega``, the decay from each token (exclusive) to the sequence's end."""
    whole: Array
    """``[N, H, 1, 1]``: ``gamma``, the decay over each whole sequence."""

    # -- forward ---------------------------------------------------------------------------------

    def initial_state_outputs(self, q: Array, h0: Array) -> Array:
        """``alpha_i q_i h0_n`` (``[1, T, H, V]``) for queries ``q`` already times ``scale``."""
        return self._per_token(self.from_start * q, h0, transpose=False)

    def final_states(self, k: Array, v: Array, h0: Array | None) -> Array:
        """``[N, H, K, V]``: each sequence's state after its last token."""
        return self._per_sequence(k, self.to_end * v, plus=None if h0 is None else self.whole * h0)

    # -- backward --------------------------------------------------------------------------------

    def backward(self, q: Array, k: Array, v: Array, do: Array, h0: Array | None, dht: Array | None):
        """The gradients of the two terms above: ``(dq, dk, dv, da, dh0)``, each None where absent.

        ``dq`` is the gradient of ``q`` times ``scale`` (as ``q`` is given). ``da`` (``[1, T, H]``)
        is that of each token's log decay ``a_t``: ``alpha_i`` holds ``a_t`` for ``t <= i``, so
        ``da_t`` gets the later ``u_i = alpha_i q_i h0 . do_i``; ``omega_j`` holds it for
        ``t > j``, so ``da_t`` gets the earlier ``w_j = omega_j k_j^T v_j . dht``; ``gamma``
        holds every ``a_t`` of the sequence.
        """
        dq = dk = dv = dh0 = None
        da = jnp.zeros(q.shape[:3], q.dtype)
        if h0 is not None:
            dq = self.from_start * self._per_token(do, h0, transpose=True)
            da += _segment_cumsum(jnp.sum(q * dq, axis=-1), self.ends, reverse=True)
            dh0 = self._per_sequence(self.from_start * q, do, plus=None if dht is None else self.whole * dht)
        if dht is not None:
            dk = self.to_end * self._per_token(v, dht, transpose=True)
            dv = self.to_end * self._per_token(k, dht, transpose=False)
            earlier = _segment_cumsum(jnp.sum(v * dv, axis=-1), self.starts)
            da += jnp.where(self.starts[None, :, None], 0, jnp.roll(earlier, 1, axis=1))  # j < t only
        if h0 is not None and dht is not None:
            through = (self.whole[..., 0, 0] * jnp.sum(h0 * dht, axis=(-2, -1)))  # [N, H]
            da += through[self.sequence][None]
        return dq, dk, dv, da, dh0

    # -- the ragged products -----------------------------------------------------------------------

    def _per_token(self, tokens: Array, matrices: Array, *, transpose: bool) -> Array:
        """Each token times its sequence's matrix: ``[1, T, H, A]`` by ``[N, H, A, B]`` (or its
        transpose ``[N, H, B, A]``) -> ``[1, T, H, B]``."""
        p = self.pieces
        if transpose:
            # The states stay the left operand as they lie: with the states transposed the
            # product took 4 to 5 times as long (at T=4096, N=1024: 65 to 77 ms against 13 to 20).
            first = jnp.swapaxes(einsum("nhba,nhaw->nhbw", matrices, p.first(tokens, slots_last=True)), -1, -2)
        else:
            first = einsum("nhwa,nhab->nhwb", p.first(tokens), matrices)
        piece_spec = "wha,hba->whb" if transpose else "wha,hab->whb"
        # Tokens outside the first pieces read a zero there, then get their products in place.
        out = p.from_first(first)

        def piece(m, out):
            rows = p.rest_rows(m)
            matrix = lax.dynamic_index_in_dim(matrices, p.rest_sequence[m], keepdims=False)
            return out.at[rows].add(einsum(piece_spec, p.take(tokens, rows), matrix), mode="drop",
                                    indices_are_sorted=True, unique_indices=True)

        return p.for_each_rest(piece, out)[None]

    def _per_sequence(self, left: Array, right: Array, *, plus: Array | None) -> Array:
        """Each sequence's sum of its tokens' ``left_t^T right_t``, ``+ plus`` when given: ``[N, H, A, B]``."""
        p = self.pieces
        sums = einsum("nhaw,nhwb->nhab", p.first(left, slots_last=True), p.first(right))
        if plus is not None:
            sums = sums + plus

        def piece(m, sums):
            rows, n = p.rest_rows(m), p.rest_sequence[m]
            term = einsum("wha,whb->hab", p.take(left, rows), p.take(right, rows))
            return lax.dynamic_update_index_in_dim(sums, lax.dynamic_index_in_dim(sums, n, keepdims=False) + term, n, 0)

        return p.for_each_rest(piece, sums)


@dataclasses.dataclass(frozen=True)
class Pieces:
    """Packed tokens in pieces of at most ``W`` tokens of one sequence (a ``packed_layout`` at ``W``).

    Every sequence's first piece (``[N, W]``, in sequence order) meets the sequence's own state in
    one batched product that reads ``h0`` and writes final states without a copy. The other pieces
    (of sequences longer than ``W``; ``num_rest`` of at most ``T // W``) are taken one at a time in
    a loop that runs only as often as there are such pieces.
    """

    size: int
    """``W``."""
    num_tokens: int
    first_tokens: Array
    """``[N, W]`` int32: the token in each slot of each sequence's first piece; ``T`` for padding."""
    token_first: Array
    """``[T]`` int32: the sequence whose first piece holds the token; ``N`` for the other tokens."""
    token_offset: Array
    """``[T]`` int32: the token's slot in its piece."""
    rest_start: Array
    """``[T // W]`` int32: the first token of each other piece, in order."""
    rest_length: Array
    """``[T // W]`` int32: its number of tokens."""
    rest_sequence: Array
    """``[T // W]`` int32: its sequence."""
    num_rest: Array
    """int32: how many other pieces there are."""

    @staticmethod
    def of(cu_seqlens: Array, num_tokens: int, size: int) -> Pieces:
        """The pieces of ``size`` tokens of the packed sequences at ``cu_seqlens``."""
        N = cu_seqlens.shape[0] - 1
        layout = packed_layout(cu_seqlens, num_tokens, size)
        slot_token = layout.slot_token.reshape(layout.num_chunks, size)
        # Every sequence has one first piece, so there are T // W others, the empty ones last.
        first = jnp.nonzero(layout.chunk_is_first, size=N)[0]
        rest = jnp.nonzero(~layout.chunk_is_first, size=layout.num_chunks - N)[0]
        rest_length = jnp.sum(slot_token[rest] < num_tokens, axis=1, dtype=jnp.int32)
        piece = layout.token_slot // size
        return Pieces(
            size=size, num_tokens=num_tokens, first_tokens=slot_token[first],
            token_first=jnp.where(layout.chunk_is_first[piece], layout.chunk_sequence[piece], N).astype(jnp.int32),
            token_offset=(layout.token_slot % size).astype(jnp.int32),
            rest_start=slot_token[rest, 0], rest_length=rest_length, rest_sequence=layout.chunk_sequence[rest],
            num_rest=jnp.sum(rest_length > 0, dtype=jnp.int32),
        )

    # Heads before slots, as in the states (``[N, H, K, V]``), so that the batched products read
    # them in place (with the batch split around the slots they took 3.5 times as long). A sum
    # over the slots takes its left side with the slots last, an ordinary matrix product: the
    # slots contracted where they stand ran in XLA's generic dot (at T=4096, N=1024: 56 ms
    # against 46, most of either the writing of 64 MiB of final states).

    def first(self, tokens: Array, *, slots_last: bool = False) -> Array:
        """The first pieces of ``tokens`` (``[1, T, H, A]``): ``[N, H, W, A]`` (``[N, H, A, W]`` when
        ``slots_last``), zeros for padding."""
        rows = jnp.take(tokens[0], self.first_tokens.reshape(-1), axis=0, mode="fill", fill_value=0)
        rows = rows.reshape(*self.first_tokens.shape, *tokens.shape[2:])  # [N, W, H, A]: whole rows gathered
        return jnp.transpose(rows, (0, 2, 3, 1) if slots_last else (0, 2, 1, 3))

    def from_first(self, slots: Array) -> Array:
        """``[N, H, W, B]`` -> ``[T, H, B]``: each token's slot in the first pieces, zeros for the other tokens."""
        heads = jnp.arange(slots.shape[1])
        return slots.at[self.token_first[:, None], heads[None, :], self.token_offset[:, None]].get(mode="fill", fill_value=0)

    def for_each_rest(self, body, init):
        """``body(m, carry)`` for every other piece ``m`` in turn; ``init`` when there are none."""
        if self.rest_start.shape[0] == 0:  # T < W: the bound T // W is 0, nothing to trace
            return init
        return lax.fori_loop(0, self.num_rest, body, init)

    def rest_rows(self, m: Array) -> Array:
        """``[W]``: the tokens of other piece ``m``, ``T`` (out of range) past its end."""
        slots = jnp.arange(self.size, dtype=jnp.int32)
        return jnp.where(slots < self.rest_length[m], self.rest_start[m] + slots, self.num_tokens)

    @staticmethod
    def take(tokens: Array, rows: Array) -> Array:
        """``tokens`` (``[1, T, ...]``) at ``rows``: ``[W, ...]``, zeros out of range."""
        return jnp.take(tokens[0], rows, axis=0, mode="fill", fill_value=0)


def packed_states(log_decay: Array, cu_seqlens: Array) -> PackedStates:
    """The decays and pieces of a packed call with log decays ``log_decay`` (``[1, T, H]``)."""
    T = log_decay.shape[1]
    N = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    starts = sequence_starts(cu, T)
    ends = jnp.append(starts[1:], True)
    cut = log_decay == -jnp.inf
    # Per token: its finite log decay and whether it cuts the state, summed together.
    sums = jnp.stack([jnp.where(cut, 0, log_decay), cut.astype(log_decay.dtype)], axis=-1)
    since_start = _segment_cumsum(sums, starts)
    to_end_inclusive = _segment_cumsum(sums, ends, reverse=True)
    after = jnp.where(ends[None, :, None, None], 0, jnp.roll(to_end_inclusive, -1, axis=1))
    from_start, to_end = _decay(since_start), _decay(after)

    lengths = cu[1:] - cu[:-1]
    last = from_start[0, jnp.maximum(cu[1:] - 1, 0)]  # [N, H]
    whole = jnp.where(lengths[:, None] > 0, last, 1)
    return PackedStates(
        pieces=Pieces.of(cu, T, piece_size(T, N)), starts=starts, ends=ends,
        sequence=sequence_of(cu, jnp.arange(T, dtype=jnp.int32)),
        from_start=from_start[..., None], to_end=to_end[..., None], whole=whole[..., None, None],
    )


def _decay(sums: Array) -> Array:
    """``exp`` of a summed log decay (``sums[..., 0]``), 0 where a ``-inf`` gate was summed (``sums[..., 1] > 0``)."""
    return jnp.exp(jnp.where(sums[..., 1] > 0, -jnp.inf, sums[..., 0]))


def _segment_cumsum(x: Array, first: Array, *, reverse: bool = False) -> Array:
    """Inclusive cumulative sums of ``x`` (``[1, T, ...]``) along ``T``, restarting wherever ``first``
    (``[T]``, in the sums' direction) is True; every sum adds terms of one segment only."""
    if reverse:
        return jnp.flip(_segment_cumsum(jnp.flip(x, axis=1), jnp.flip(first)), axis=1)
    return _blocked_segment_cumsum(x[0], first)[None]


_SCAN_BLOCK = 64


def _blocked_segment_cumsum(x: Array, first: Array) -> Array:
    """``_segment_cumsum`` of ``x`` (``[T, ...]``) in blocks: the sums inside each block are one product
    by a 0/1 matrix, and the sums carried into each block are this function of the blocks' last sums.

    Few operations (``lax.associative_scan`` took seconds to compile here) at any ``T``.
    """
    T = x.shape[0]
    num_blocks = -(-T // _SCAN_BLOCK)
    size = min(T, _SCAN_BLOCK)
    pad = num_blocks * size - T
    # Padding starts segments of its own, so it never adds to a real token.
    blocks = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(num_blocks, size, -1)
    starts = jnp.pad(first, (0, pad), constant_values=True).reshape(num_blocks, size)
    count = jnp.cumsum(starts.astype(jnp.int32), axis=1)  # starts in the block up to each element
    same = jnp.tril(jnp.ones((size, size), bool)) & (count[:, :, None] == count[:, None, :])
    within = einsum("bij,bjx->bix", same.astype(x.dtype), blocks)
    if num_blocks > 1:
        ends = _blocked_segment_cumsum(within[:, -1], starts.any(axis=1))  # the sum at each block's end
        carried = jnp.concatenate([jnp.zeros_like(ends[:1]), ends[:-1]])
        within += jnp.where(count[..., None] == 0, carried[:, None], 0)
    return within.reshape(num_blocks * size, *x.shape[1:])[:T]
