"""The layout both kernels read and write, and the few copies some head dimensions need.

The kernels work on the caller's time-major arrays seen through reshapes: ``q``, ``k`` as
``[B, T, H * K]``, ``v`` and ``o`` as ``[B, T, H * V]``. A block of one head is then
``(rows, K)`` at column block ``h``: a legal TPU block whenever ``K`` is a multiple of 128 lanes
(the last two block dimensions must be multiples of (8, 128) or equal the array's). In a model
``q``, ``k``, ``v`` come out of projections as ``[B, T, H * D]`` and are reshaped to
``[B, T, H, D]`` for the op, so the reshape back cancels with that one (and ``o``'s reshape with the
next projection's); on CPU a reshape is a free bitcast. Nothing is transposed, nothing is upcast.

Two things are never copied:

- ``T`` is not padded to whole chunks, nor to whole grid steps: the last time block may extend past
  the end of the array (a ragged block), by part of a chunk and by whole chunks. A TPU reads
  unspecified values there and drops writes there; the kernels zero those rows with ``where``
  before any arithmetic (``Geometry.valid_rows``), so a chunk past the end reads as no tokens.
- ``g`` ``[B, T, H]`` is read as a full-width block ``(rows, H)`` (legal: the last block dimension
  equals the array's) and the kernel picks the head's column.

The one copy left is the **lane padding decision** (``Geometry.pads_keys``, ``pads_values``): a
head dimension that is not a multiple of 128 is zero-padded to one, by one copy per input (and a
slice back for ``o`` and the final state). The launch plans record these copies (``Relayout``) so
the traffic model counts them next to the kernels' own traffic.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tops_plugins_tpu_pallas.plan import Relayout

LANES = 128
"""Width of a TPU vector register: a head dimension that is not a multiple of it is padded to one."""

SUBLANES = 8
"""Rows of a float32 vector register: slices and concatenations of rows at multiples of it move no data between registers."""


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def largest_divisor_at_most(n: int, limit: int) -> int:
    """``limit`` if it divides ``n``, else the largest divisor of ``n`` below it."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _ceil_div(x: int, y: int) -> int:
    return -(-x // y)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static sizes of one call, the lane padding decision, and how time is cut into chunks and grid steps.

    ``heads`` are the heads of ``v``, ``o`` and the state, the grid's head axis; with grouped value heads each
    ``groups`` of them share one head of ``q`` and ``k`` (``key_heads`` in all).
    """

    batch: int
    seq_len: int
    heads: int
    key_dim: int
    value_dim: int
    chunk_size: int
    num_steps: int
    full_values: bool = False  # one value block of all of V_pad (else 128-lane value tiles)
    groups: int = 1

    @property
    def key_heads(self) -> int:
        return self.heads // self.groups

    @property
    def pads_keys(self) -> bool:
        """Whether ``q`` and ``k`` are copied with ``K`` zero-padded to whole lane tiles (else read in place)."""
        return self.key_dim % LANES != 0

    @property
    def pads_values(self) -> bool:
        """Whether ``v`` (and ``o`` on the way back) go through a copy with ``V`` padded to whole lane tiles."""
        return self.value_dim % LANES != 0

    @property
    def pads_state(self) -> bool:
        return self.pads_keys or self.pads_values

    @property
    def padded_key_dim(self) -> int:
        return _round_up(self.key_dim, LANES)

    @property
    def padded_value_dim(self) -> int:
        return _round_up(self.value_dim, LANES)

    @property
    def num_chunks(self) -> int:
        return _ceil_div(self.seq_len, self.chunk_size)

    @property
    def chunks_per_step(self) -> int:
        """Chunks one grid step walks: the largest divisor of the chunk count up to ``num_steps``, unless a padded grid
        does better, sharing the chunks evenly by the fewest steps of at most ``num_steps`` (37 chunks at 32: two steps
        of 19, the second's last past the end, where the divisor is 1). The divisor stays where it is more than half
        that share: no chunk is computed past the end, and the extra steps cost less (kda's forward, 72 chunks at 16 per
        step, v6e: six steps of 12 issue 2.2% fewer cycles than five of 15). The packed kernels read a chunk past the
        end as one of no boundary (``simple_gla.varlen.chunk_sequences``).

        The divisor alone walked a chunk count with no good one a chunk or a few per step, each step paying its own
        cycles: simple_gla's forward with ``g`` at T=4736 (37 chunks of 128, v5e) issued 2.9x the cycles per token of
        T=4608's (README "Chunk counts with no good divisor")."""
        divisor = largest_divisor_at_most(self.num_chunks, self.num_steps)
        even = _ceil_div(self.num_chunks, _ceil_div(self.num_chunks, self.num_steps))
        return divisor if 2 * divisor > even else even

    @property
    def time_steps(self) -> int:
        return _ceil_div(self.num_chunks, self.chunks_per_step)

    @property
    def grid_chunks(self) -> int:
        """Chunks the grid walks: ``num_chunks`` and those of the last step past the end of the sequence."""
        return self.time_steps * self.chunks_per_step

    @property
    def chunks_past_end(self) -> int:
        """Chunks of the last grid step past the end of the sequence (0 where the steps divide the chunks)."""
        return self.grid_chunks - self.num_chunks

    def past_end(self, chunk: jax.Array) -> jax.Array | bool:
        """Whether chunk number ``chunk`` lies past the end of the sequence (False, statically, where none can)."""
        return chunk >= self.num_chunks if self.chunks_past_end else False

    def real_chunk(self, chunk: jax.Array) -> jax.Array:
        """Chunk number ``chunk``, or the last chunk of the sequence for one past its end: where a chunk's SMEM scalars
        (which stop at the end) are read."""
        return jnp.minimum(chunk, self.num_chunks - 1) if self.chunks_past_end else chunk

    @property
    def rows_per_step(self) -> int:
        return self.chunks_per_step * self.chunk_size

    @property
    def value_block(self) -> int:
        """Lanes of V one block (and one grid point) holds: all of ``V_pad``, or one 128-lane tile."""
        return self.padded_value_dim if self.full_values else LANES

    @property
    def value_tiles(self) -> int:
        return self.padded_value_dim // self.value_block

    @property
    def first_short_chunk(self) -> int:
        """Where in a grid step the chunks that may hold rows past ``T`` begin (they are in the last step alone, but the
        step is traced): the sequence's ragged last chunk, or the first past the end; ``chunks_per_step`` when none can."""
        in_last_step = self.num_chunks - (self.time_steps - 1) * self.chunks_per_step
        return in_last_step - 1 if self.seq_len % self.chunk_size else in_last_step

    def describe_steps(self) -> str:
        """For ``explain``: the chunks, the grid steps that walk them, and the last step's chunks past the end."""
        past = self.chunks_past_end
        steps = f"{self.time_steps} grid step{'s' if self.time_steps > 1 else ''} of {self.chunks_per_step}"
        return f"{self.num_chunks} chunks in {steps}" + (f", {past} past the end" if past else "")

    def valid_rows(self, chunk: jax.Array) -> jax.Array:
        """How many rows of chunk number ``chunk`` are real tokens: ``chunk_size``, fewer in the ragged last, 0 past it."""
        return jnp.clip(self.seq_len - chunk * self.chunk_size, 0, self.chunk_size)

    # -- the caller-facing arrays that padded operands are copies of ------------------------------

    def token_relayout(self, padded: bool, heads: int, width: int, dtype) -> Relayout | None:
        return Relayout((self.batch, self.seq_len, heads, width), dtype) if padded else None

    def state_relayout(self, dtype) -> Relayout | None:
        return Relayout((self.batch, self.heads, self.key_dim, self.value_dim), dtype) if self.pads_state else None


def heads_flattened(x: jax.Array, padded_width: int) -> jax.Array:
    """``[B, T, H, D]`` -> ``[B, T, H * padded_width]``: a reshape, plus a lane padding copy only when ``D`` is short."""
    if x.shape[-1] != padded_width:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, padded_width - x.shape[-1])))
    B, T, H, D = x.shape
    return x.reshape(B, T, H * D)


def decay_per_head(g_gamma: jax.Array | None, heads: int) -> jax.Array:
    """The constant log decay per head as float32 ``[H]`` for SMEM: zeros without ``g_gamma``, a scalar broadcast."""
    if g_gamma is None:
        return jnp.zeros((heads,), jnp.float32)
    return jnp.broadcast_to(g_gamma.astype(jnp.float32), (heads,))


def padded_state(state: jax.Array, geometry: Geometry) -> jax.Array:
    if not geometry.pads_state:
        return state
    return jnp.pad(state, ((0, 0), (0, 0), (0, geometry.padded_key_dim - geometry.key_dim), (0, geometry.padded_value_dim - geometry.value_dim)))


def kernel_operands(q, k, v, g, g_gamma, initial_state, geometry: Geometry) -> dict[str, jax.Array]:
    """The arrays both kernels read, by operand name (absent inputs left out)."""
    operands = {
        "decay": decay_per_head(g_gamma, geometry.heads),
        "q": heads_flattened(q, geometry.padded_key_dim),
        "k": heads_flattened(k, geometry.padded_key_dim),
        "v": heads_flattened(v, geometry.padded_value_dim),
    }
    if g is not None:
        operands["g"] = g
    if initial_state is not None:
        operands["initial_state"] = padded_state(initial_state, geometry)
    return operands


def caller_output(o: jax.Array, geometry: Geometry) -> jax.Array:
    """``[B, T, H * V_pad]`` -> ``[B, T, H, V]``: a reshape, and a slice (a copy) only when ``V`` was padded."""
    o = o.reshape(geometry.batch, geometry.seq_len, geometry.heads, geometry.padded_value_dim)
    return o[..., : geometry.value_dim] if geometry.pads_values else o


def caller_state(state: jax.Array, geometry: Geometry) -> jax.Array:
    """``[N, H, K_pad, V_pad]`` -> ``[N, H, K, V]``: the array itself unless the head dimensions were padded."""
    return state[:, :, : geometry.key_dim, : geometry.value_dim] if geometry.pads_state else state
