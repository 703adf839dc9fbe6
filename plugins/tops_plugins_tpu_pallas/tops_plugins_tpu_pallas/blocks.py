"""The operands the kernels share, as launch-plan entries over one grid.

Every kernel of this plugin runs on the grid ``(batch, head, value tile, time step)``: one value
tile is 128 lanes of ``V`` (independent columns of the state and of ``o``, so tiles never
reduce into each other), and one time step walks ``chunks_per_step`` consecutive chunks. The full
padded ``K`` sits in every block (no K tiles, so no reduction over K; the VMEM model in
``traffic`` bounds how large ``K`` may grow).

Token arrays are ``[B, T, H * D]`` (``layout``): head ``h`` is column block ``h`` of width ``K``
for ``q`` and ``k`` (with grouped value heads, grid head ``h`` reads block ``h // groups``), and
value tile ``tile`` of head ``h`` is 128-lane column block ``h * value_tiles + tile`` for ``v`` and
``o``. The last time block may be ragged.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from tops_plugins_tpu_pallas.plan import Blocked, Relayout, Scalars, Scratch
from tops_plugins_tpu_pallas.layout import Geometry


def grid(geometry: Geometry) -> tuple[int, int, int, int]:
    return (geometry.batch, geometry.heads, geometry.value_tiles, geometry.time_steps)


def _quotient(index, divisor: int):
    """``index // divisor`` of a grid index (>= 0): NumPy's on the traffic model's points, else ``lax.div``, the same
    for indices >= 0 without floor division's sign fix-up (which Mosaic lowers only for a known chip). The divisor takes
    the index's dtype: with ``jax_enable_x64`` a Python int would be int64 beside the grid's int32."""
    if isinstance(index, np.ndarray):
        return index // divisor
    return lax.div(index, lax.convert_element_type(divisor, index.dtype))


def _all_columns(b, h, tile, t, *_):
    return (b, t, 0)


def _state_tile(b, h, tile, t, *_):
    return (b, h, 0, tile)


def _chunk_state_tile(b, h, tile, t, *_):
    return (b, h, t, 0, tile)


def decay(geometry: Geometry) -> Scalars:
    """The per-head constant log decay (``g_gamma``, zeros without it), read as a scalar from SMEM."""
    return Scalars("decay", (geometry.heads,), jnp.float32)


def key_rows(name: str, geometry: Geometry, dtype, *, per_value_head: bool = False) -> Blocked:
    """``q`` or ``k``: rows of one step, the ``K_pad`` columns of the grid head's query/key head ``h // groups``
    (the value heads of a group read the same block: q and k are never repeated in HBM). ``per_value_head``:
    an array of the same width with a row per value head (kda's ``g``)."""
    g = geometry
    heads, groups = (g.heads, 1) if per_value_head else (g.key_heads, g.groups)

    def key_head_columns(b, h, tile, t, *_):
        return (b, t, _quotient(h, groups))

    return Blocked(
        name, (g.batch, g.seq_len, heads * g.padded_key_dim), dtype,
        (None, g.rows_per_step, g.padded_key_dim), key_head_columns, g.token_relayout(g.pads_keys, heads, g.key_dim, dtype),
    )


def value_rows(name: str, geometry: Geometry, dtype) -> Blocked:
    """``v`` or ``o``: rows of one step, one value block of the head's ``V_pad`` columns."""
    g = geometry

    def value_tile_columns(b, h, tile, t, *_):
        return (b, t, h * g.value_tiles + tile)

    return Blocked(
        name, (g.batch, g.seq_len, g.heads * g.padded_value_dim), dtype,
        (None, g.rows_per_step, g.value_block), value_tile_columns, g.token_relayout(g.pads_values, g.heads, g.value_dim, dtype),
    )


def per_head(name: str, geometry: Geometry, dtype) -> Blocked:
    """One number per token and head ``[B, T, H]``: rows of one step, every head (the kernel picks its column)."""
    g = geometry
    return Blocked(name, (g.batch, g.seq_len, g.heads), dtype, (None, g.rows_per_step, g.heads), _all_columns)


def gates(geometry: Geometry, dtype) -> Blocked:
    """simple_gla's per-token ``g`` ``[B, T, H]``."""
    return per_head("g", geometry, dtype)


def _every_head_row(b, h, tile, t, *_):
    return (b, 0, t)


def gate_rows(geometry: Geometry, dtype) -> Blocked:
    """simple_gla's ``g`` transposed to ``[B, H, T]`` outside the kernel (a copy of the caller's ``[B, T, H]``):
    tokens along lanes, every head's row of one step (the kernel picks its row, ``grid.Chunk.head_row``); the
    same bytes per step as ``gates``, lane-dense in VMEM instead of H of 128 lanes."""
    g = geometry
    return Blocked(
        "g", (g.batch, g.heads, g.seq_len), dtype, (None, g.heads, g.rows_per_step), _every_head_row,
        Relayout((g.batch, g.seq_len, g.heads), dtype),
    )


def sequence_cuts(geometry: Geometry) -> tuple[tuple[Scalars, Scalars], Blocked]:
    """A packed call's sequence starts as ``ChunkGates.cut_at`` takes them (``simple_gla.varlen.sequence_cuts``): the
    first and last start of every chunk of the grid in SMEM, and ``next_starts`` ``[1, T]`` int32, tokens along lanes,
    one step's rows, the same for every (batch, head): 4 bytes per token and head read."""
    g = geometry
    chunks = g.time_steps * g.chunks_per_step

    def step_rows(b, h, tile, t, *_):
        return (0, t)

    scalars = (Scalars("first_starts", (chunks,), jnp.int32), Scalars("last_starts", (chunks,), jnp.int32))
    return scalars, Blocked("next_starts", (1, g.seq_len), jnp.int32, (1, g.rows_per_step), step_rows)


def state(name: str, geometry: Geometry, dtype) -> Blocked:
    """``initial_state`` or ``final_state``: one value block of one head's state; its block changes only with (b, h, tile)."""
    g = geometry
    return Blocked(
        name, (g.batch, g.heads, g.padded_key_dim, g.padded_value_dim), dtype,
        (None, None, g.padded_key_dim, g.value_block), _state_tile, g.state_relayout(dtype),
    )


def chunk_states(geometry: Geometry) -> Blocked:
    """The state entering every chunk the grid walks (two-stage kernel): float32 ``[B, H, grid chunks, K_pad, V_pad]``."""
    g = geometry
    return Blocked(
        "chunk_states", (g.batch, g.heads, g.grid_chunks, g.padded_key_dim, g.padded_value_dim), jnp.float32,
        (None, None, g.chunks_per_step, g.padded_key_dim, g.value_block), _chunk_state_tile,
    )


def token_rows(name: str, geometry: Geometry) -> Blocked:
    """One float32 number per token of each head, ``[B, H, steps, chunks per step, C]``: one row per chunk (a
    gradient per token, reduced over a block's lanes in the kernel). The last two block dimensions equal the
    array's, a legal TPU block for any chunk count."""
    g = geometry

    def head_rows(b, h, tile, t, *_):
        return (b, h, t, 0, 0)

    return Blocked(
        name, (g.batch, g.heads, g.time_steps, g.chunks_per_step, g.chunk_size), jnp.float32,
        (None, None, None, g.chunks_per_step, g.chunk_size), head_rows,
    )


def running_state(geometry: Geometry) -> Scratch:
    """The float32 state carried along the sequential time axis, in VMEM only."""
    return Scratch("state", (geometry.padded_key_dim, geometry.value_block), jnp.float32)
