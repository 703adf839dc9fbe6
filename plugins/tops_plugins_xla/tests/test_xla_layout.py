"""The chunk-aligned token layout: index math from cu_seqlens, also under jit with traced boundaries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tops_core.packing import sequence_of, sequence_starts
from tops_plugins_xla.chunk_layout import dense_layout, packed_layout

BOUNDARIES = [
    [0, 300],
    [0, 64, 128, 192],
    [0, 0, 1, 70, 70, 150, 151, 300],
    [0, 0, 0, 10],
    [0, 5, 6, 133, 300],
]


def expected_chunks(cu, C):
    """Per sequence: the chunks it owns, worked out by hand (every sequence owns at least one)."""
    lengths = np.diff(cu)
    counts = np.maximum(1, -(-lengths // C))
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return lengths, counts, first


@pytest.mark.parametrize("C", [16, 64])
@pytest.mark.parametrize("cu", BOUNDARIES)
def test_packed_layout_places_every_sequence_at_a_chunk_start(cu, C):
    T = cu[-1]
    layout = packed_layout(jnp.asarray(cu, jnp.int32), T, C)
    lengths, counts, first = expected_chunks(np.asarray(cu), C)
    assert layout.num_chunks == T // C + len(lengths)
    assert counts.sum() <= layout.num_chunks
    token_slot = np.asarray(layout.token_slot)
    slot_token = np.asarray(layout.slot_token)
    for s, (start, length) in enumerate(zip(cu[:-1], lengths)):
        slots = token_slot[start:start + length]
        np.testing.assert_array_equal(slots, first[s] * C + np.arange(length))
        owned = slot_token[first[s] * C:(first[s] + counts[s]) * C]
        np.testing.assert_array_equal(owned[:length], np.arange(start, start + length))
        assert np.all(owned[length:] == T)  # padding
        chunk_range = slice(first[s], first[s] + counts[s])
        assert np.all(np.asarray(layout.chunk_sequence)[chunk_range] == s)
        assert np.asarray(layout.chunk_is_first)[first[s]]
        assert np.asarray(layout.chunk_is_last)[first[s] + counts[s] - 1]
    assert np.asarray(layout.chunk_is_first).sum() == len(lengths)
    assert np.asarray(layout.chunk_is_last).sum() == len(lengths)
    # Chunks past the last sequence hold only padding and start or end nothing.
    used = counts.sum()
    assert np.all(slot_token[used * C:] == T)
    np.testing.assert_array_equal(np.asarray(layout.token_mask()), slot_token < T)


@pytest.mark.parametrize("cu", BOUNDARIES)
def test_pack_then_unpack_is_the_identity_under_jit(cu):
    T, C = cu[-1], 64
    x = jnp.arange(1, 2 * T + 1, dtype=jnp.float32).reshape(1, T, 2)

    @jax.jit
    def roundtrip(x, cu_seqlens):  # cu_seqlens is traced here: only N is static
        layout = packed_layout(cu_seqlens, T, C)
        packed = layout.pack(x)
        return packed, layout.unpack(packed)

    packed, back = roundtrip(x, jnp.asarray(cu, jnp.int32))
    np.testing.assert_array_equal(back, x)
    # Padded slots are zeros; real slots hold every token once.
    assert int(jnp.sum(packed != 0)) == 2 * T


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_dense_layout_pads_only_the_end(T):
    C = 64
    layout = dense_layout(T, C)
    assert layout.one_sequence_per_row
    assert layout.num_chunks == -(-T // C)
    x = jnp.ones((2, T, 3))
    packed = layout.pack(x)
    assert packed.shape == (2, layout.num_chunks * C, 3)
    assert int(jnp.sum(packed)) == 2 * T * 3
    np.testing.assert_array_equal(layout.unpack(packed), x)
    np.testing.assert_array_equal(np.asarray(layout.token_mask()), np.arange(layout.num_slots) < T)
    assert bool(layout.chunk_is_first[0]) and bool(layout.chunk_is_last[-1])


def test_packed_layout_is_never_one_sequence_per_row():
    layout = packed_layout(jnp.asarray([0, 100]), 100, 64)
    assert not layout.one_sequence_per_row


@pytest.mark.parametrize("cu", BOUNDARIES)
def test_sequence_starts_and_sequence_of_under_jit(cu):
    T = cu[-1]
    starts, sequence = jax.jit(lambda cu_seqlens: (sequence_starts(cu_seqlens, T), sequence_of(cu_seqlens, jnp.arange(T, dtype=jnp.int32))))(
        jnp.asarray(cu, jnp.int32))
    want_sequence = np.concatenate([np.full(end - start, n) for n, (start, end) in enumerate(zip(cu[:-1], cu[1:]))])
    np.testing.assert_array_equal(sequence, want_sequence)
    want_starts = np.zeros(T, bool)
    want_starts[[start for start, end in zip(cu[:-1], cu[1:]) if end > start]] = True
    np.testing.assert_array_equal(starts, want_starts)
