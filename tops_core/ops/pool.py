"""State pools (``ssm_state_indices``): a server's recurrent states, one row per live request.

With ``ssm_state_indices`` ``[N]`` (one per sequence), ``initial_state`` is a pool ``[P, H, K, V]``
(``HV`` heads for kda): sequence ``n`` starts from row ``ssm_state_indices[n]``, or from a zero
state where the index is negative (a padding slot). With ``output_final_state`` the op returns the
pool with each indexed row replaced by its sequence's final state and every other row as it was; a
padding slot writes nothing.

An implementation that serves pools itself (``Implementation.serves_pools``: the Pallas decode,
fused and packed kernels) gets the pool and the indices and reads and writes the rows where they lie. For every
other one the core runs the call as the dense call of its ``N`` sequences: ``rows`` gathers their
initial states before the implementation, ``written`` puts the final states back after. The write
is a scatter into the pool, so under ``jax.jit(..., donate_argnums=...)`` XLA updates the pool in
place. Gradients always take the dense path back (``row_cotangents``, ``gradient``).

Concrete indices are checked when the call is validated (``validation.state_indices``). Traced ones
cannot be: an index ``>= P`` gives its sequence NaN outputs and writes nothing, and a row that more
than one sequence writes becomes NaN (with a pool-serving implementation, so do those sequences'
outputs: ``served``). Neither is ever a plausible number, and no write races another.
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


def _contested(targets: Array, size: int) -> Array:
    """Per sequence: whether the row it writes (``targets``, ``size`` for none) is written by another sequence too.

    By sorting, not by counting writers with a scatter: a scatter's asynchronous form on TPU leaves a program
    whose text JAX cannot print (``Compiled.as_text``), which the compile-only checks read."""
    order = jnp.argsort(targets)
    ordered = targets[order]
    repeats = ordered[1:] == ordered[:-1]
    repeated = jnp.concatenate([repeats, jnp.zeros((1,), bool)]) | jnp.concatenate([jnp.zeros((1,), bool), repeats])
    return (targets < size) & repeated[jnp.argsort(order)]


def written(pool: Array, indices: Array, final_states: Array) -> Array:
    """The pool with each sequence's row replaced by its final state; a row two sequences write is NaN."""
    size = pool.shape[0]
    targets = _rows_or_past_the_end(indices, size)
    updated = pool.at[targets].set(final_states.astype(pool.dtype), mode="drop")
    contested = _contested(targets, size)
    # Only when a row is contested: writing NaN (or masking the values with it) costs a pass over N rows, a third
    # of a decode step on CPU, for what is a caller's bug.
    return lax.cond(jnp.any(contested), lambda p: p.at[jnp.where(contested, targets, size)].set(jnp.nan, mode="drop"), lambda p: p, updated)


def served(indices: Array, size: int, *, packed: bool, writes: bool, rules_kept: Array | None) -> tuple[Array, Array]:
    """``(indices, bad)`` for a forward that serves pools itself (``Implementation.serves_pools``): an index past the
    pool becomes a padding slot (-1), so it never addresses memory past the pool, and ``bad`` marks the sequences
    whose results the traced rules make NaN: an index past the pool, a row another sequence writes too (``writes``:
    the final state is returned), or, with ``rules_kept`` False, every sequence. ``bad`` is ``[N]``, or a scalar for a
    ``packed`` call (all its sequences share the inputs' time axis). The op puts a NaN into an input of each bad
    sequence (``OpContract.poisoned``), which makes its whole state NaN from its first token: its outputs are NaN,
    and so is every row it writes, whichever of a contested row's writes lands last. (Two empty sequences of a packed
    call that name one row write nothing, and leave it as it was.)"""
    targets = _rows_or_past_the_end(indices, size)
    bad = indices >= size
    if writes:
        bad = bad | _contested(targets, size)
    if rules_kept is not None:
        bad = bad | ~rules_kept
    return jnp.where(indices < size, indices, -1), jnp.any(bad) if packed else bad


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


def describe(size: int, num_seqs: int, native: bool) -> str:
    """One line for ``explain``: how a pool call is served (``native``: by a forward that reads and writes the rows itself)."""
    if native:
        return (
            f"state pool: initial_state holds P={size} rows; the forward reads and writes the N={num_seqs} rows "
            "ssm_state_indices names in place (the backward gets them gathered)"
        )
    return (
        f"state pool: initial_state holds P={size} rows; the core gathers the N={num_seqs} rows ssm_state_indices "
        "names before the implementation and writes the final states back after (in place under donation)"
    )
