"""State pools (``ssm_state_indices``): a server's recurrent states, one row per live request.

With ``ssm_state_indices`` ``[N]`` (one per sequence), ``initial_state`` is a pool ``[P, H, K, V]``
(``HV`` heads for kda): sequence ``n`` starts from row ``ssm_state_indices[n]``, or from a zero
state where the index is negative (a padding slot). With ``output_final_state`` the op returns the
pool with each indexed row replaced by its sequence's final state and every other row as it was; a
padding slot writes nothing.

The core runs such a call as the dense call of its ``N`` sequences, whatever implementation serves
it: ``rows`` gathers their initial states before the implementation, ``written`` puts the final
states back after. The write is a scatter into the pool, so under ``jax.jit(..., donate_argnums=...)``
XLA updates the pool in place. Gradients take the same path back (``row_cotangents``, ``gradient``).

Concrete indices are checked when the call is validated (``validation.state_indices``). Traced ones
cannot be: an index ``>= P`` gives its sequence a NaN state (its output is NaN and it writes
nothing), and a row that more than one sequence writes becomes NaN. Neither is ever a plausible
number, and no write races another.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array


def _rows_or_past_the_end(indices: Array, size: int) -> Array:
    """Each sequence's row; ``size`` (past the end, which a ``mode="drop"`` scatter skips) where it has none."""
    return jnp.where((indices >= 0) & (indices < size), indices, size)


def _per_row(mask: Array) -> Array:
    return mask[:, None, None, None]


def rows(pool: Array, indices: Array) -> Array:
    """The ``[N, H, K, V]`` initial states of the sequences: their rows, zeros for padding, NaN past the pool."""
    size = pool.shape[0]
    gathered = jnp.take(pool, jnp.clip(indices, 0, size - 1), axis=0)
    gathered = jnp.where(_per_row(indices >= size), jnp.nan, gathered)
    return jnp.where(_per_row(indices < 0), 0, gathered).astype(pool.dtype)


def written(pool: Array, indices: Array, final_states: Array) -> Array:
    """The pool with each sequence's row replaced by its final state; a row two sequences write is NaN."""
    size = pool.shape[0]
    targets = _rows_or_past_the_end(indices, size)
    updated = pool.at[targets].set(final_states.astype(pool.dtype), mode="drop")
    writers = jnp.zeros((size,), jnp.int32).at[targets].add(1, mode="drop")
    contested = jnp.where(writers[jnp.minimum(targets, size - 1)] > 1, targets, size)
    # Only when a row is contested: writing NaN (or masking the values with it) costs a pass over N rows, a third
    # of a decode step on CPU, for what is a caller's bug.
    return lax.cond(jnp.any(contested < size), lambda p: p.at[contested].set(jnp.nan, mode="drop"), lambda p: p, updated)


def row_cotangents(pool_cotangent: Array, indices: Array) -> Array:
    """The cotangents of the sequences' final states: their rows of the returned pool's cotangent, zero where
    a sequence wrote no row."""
    size = pool_cotangent.shape[0]
    gathered = jnp.take(pool_cotangent, jnp.clip(indices, 0, size - 1), axis=0)
    return jnp.where(_per_row((indices >= 0) & (indices < size)), gathered, 0)


def gradient(pool: Array, indices: Array, initial_state_gradients: Array, pool_cotangent: Array | None) -> Array:
    """The gradient of the pool: the returned pool's cotangent where a row passed through unchanged (nothing where
    a sequence overwrote it, or without ``output_final_state``), plus each sequence's initial-state gradient at its row."""
    size = pool.shape[0]
    targets = _rows_or_past_the_end(indices, size)
    kept = jnp.zeros_like(pool) if pool_cotangent is None else pool_cotangent.at[targets].set(0, mode="drop")
    return kept.at[targets].add(initial_state_gradients.astype(pool.dtype), mode="drop")


def describe(size: int, num_seqs: int) -> str:
    """One line for ``explain``: how the core serves a pool call."""
    return (
        f"state pool: initial_state holds P={size} rows; the core gathers the N={num_seqs} rows ssm_state_indices "
        "names before the implementation and writes the final states back after (in place under donation)"
    )
