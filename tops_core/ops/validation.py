"""Argument checks shared by the op contracts; every message names the argument, what it got and what was expected."""

from __future__ import annotations

import numbers
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLOATS = "bfloat16, float16, float32 or float64"


class LayoutWarning(UserWarning):
    """The shapes of a call suggest head-first ``[B, H, T, ...]`` arrays where ``[B, T, H, ...]`` is expected."""


def is_concrete(x: Any) -> bool:
    """True when the value can be inspected now (not a tracer under jit/grad/vmap)."""
    return not isinstance(x, jax.core.Tracer)


def array(name: str, value: Any, *, required: bool = True, float_dtype: Any = jnp.float32, python: bool = True) -> jax.Array | None:
    """A jax array from a jax or NumPy array, a NumPy scalar, or (``python``) a Python number or (nested) list.

    Python floats and lists of them become ``float_dtype`` (float32, or float64 beside float64
    inputs); Python ints stay integers (``cu_seqlens``). The token arrays take no Python values:
    a list of millions of numbers is a mistake, not a convenience.
    """
    if value is None:
        if required:
            raise TypeError(f"{name} is required, got None")
        return None
    if isinstance(value, jax.Array):
        return value
    if isinstance(value, (np.ndarray, np.generic)) and not isinstance(value, np.bool_):
        return jnp.asarray(value)
    if python and isinstance(value, (numbers.Real, list, tuple)) and not isinstance(value, bool):
        host = np.asarray(value)
        if host.dtype.kind == "f":
            return jnp.asarray(host, float_dtype)
        if host.dtype.kind in "iu":
            return jnp.asarray(host)
        raise TypeError(f"{name} must hold numbers, got {value!r}")
    accepted = "a jax or numpy array (or a number or list of numbers)" if python else "a jax or numpy array"
    raise TypeError(f"{name} must be {accepted}, got {type(value).__name__}")


def real_array(name: str, value: Any, float_dtype: Any, *, required: bool = True) -> jax.Array | None:
    """A floating array for a real-valued input (the gates, ``beta``, ``initial_state``): a jax array
    of a floating dtype, or numbers on the host, which become floats.

    Integers on the host (``g_gamma=-1``, ``[-1, -2]``, ``np.int64(-1)``, an integer NumPy
    array) are as unambiguous as the floats they stand for and become ``float_dtype``, as Python
    floats do. An integer jax array stays a TypeError: it is a device tensor of the user's
    model, whose dtype says something went wrong upstream, and tops does not cast device arrays.
    """
    x = array(name, value, required=required, float_dtype=float_dtype)
    if x is not None and not isinstance(value, jax.Array) and jnp.issubdtype(x.dtype, jnp.integer):
        x = x.astype(float_dtype)
    return None if x is None else floating(name, x)


def floating(name: str, x: jax.Array) -> jax.Array:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype ({FLOATS}), got {x.dtype}")
    return x


def shape(name: str, x: jax.Array, expected: tuple[int, ...], layout: str) -> jax.Array:
    if x.ndim != len(expected):
        raise ValueError(f"{name} must have rank {len(expected)} ({layout}), got shape {tuple(x.shape)}")
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {layout} = {tuple(expected)}, got {tuple(x.shape)}")
    return x


def rank(name: str, x: jax.Array, ndim: int, layout: str) -> jax.Array:
    if x.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim} ({layout}), got shape {tuple(x.shape)}")
    return x


def positive_dims(name: str, x: jax.Array, layout: str) -> None:
    if any(d < 1 for d in x.shape):
        raise ValueError(f"{name} must have every dimension >= 1 ({layout}), got shape {tuple(x.shape)}")


def negative_number(name: str, value: Any) -> float | None:
    """None, or a static real number below 0 (``static_number``)."""
    if value is None:
        return None
    value = static_number(name, value)
    if not (-np.inf < value < 0):
        raise ValueError(f"{name} must be a finite number below 0, got {value!r}")
    return value


def static_number(name: str, value: Any) -> float:
    """A static real number (Python, NumPy or a concrete JAX scalar): it is compiled into the kernels, so a traced value cannot be used."""
    if isinstance(value, jax.Array):
        if not is_concrete(value):
            raise TypeError(
                f"{name} must be a static number, got a traced value: it is compiled into the kernels. "
                "Pass a Python float (close over it, or make it a static argument of your jit)"
            )
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        if value.ndim != 0 or value.dtype.kind not in "fiu":
            raise TypeError(f"{name} must be a real number, got an array of shape {value.shape} and dtype {value.dtype}")
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    return float(value)


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def scale(value: Any, key_dim: int) -> float:
    """The attention scale: ``K ** -0.5`` when None, else a static real number (``static_number``)."""
    return float(key_dim) ** -0.5 if value is None else static_number("scale", value)


def cu_seqlens(value: Any, batch: int, seq_len: int) -> tuple[jax.Array | None, int]:
    """Validate packed boundaries; returns them as int32 and the number of sequences N.

    Concrete values are checked here. Traced ones (under ``jit``) cannot be: the op checks them
    inside the program instead (``cu_seqlens_valid``) and returns NaN for an invalid call.
    """
    if value is None:
        return None, batch
    cu = array("cu_seqlens", value)
    if cu.size == 0:  # an empty list has no integer dtype to check: say what is wrong
        raise ValueError(f"cu_seqlens is empty: it must hold the N + 1 >= 2 boundaries of the packed sequences, e.g. [0, {seq_len}]")
    if not jnp.issubdtype(cu.dtype, jnp.integer):
        raise TypeError(f"cu_seqlens must be an int32 or int64 array, got {cu.dtype}")
    rank("cu_seqlens", cu, 1, "[N + 1]")
    if cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens must hold at least 2 boundaries ([N + 1] with N >= 1), got shape {tuple(cu.shape)}")
    if batch != 1:
        raise ValueError(f"cu_seqlens requires B == 1 (sequences packed along T), got B = {batch}")
    if is_concrete(cu):
        host = np.asarray(cu)
        if host[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {host.tolist()}")
        if np.any(np.diff(host) < 0):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {host.tolist()}")
        if host[-1] != seq_len:
            raise ValueError(f"cu_seqlens must end at T = {seq_len}, got {host.tolist()}")
    return cu.astype(jnp.int32), cu.shape[0] - 1


def state_indices(value: Any, initial_state: jax.Array | None, num_seqs: int, dtype: Any) -> jax.Array | None:
    """Validate ``ssm_state_indices`` (``tops_core.ops.pool``): ``[N]`` integers naming rows of the pool passed as
    ``initial_state``, which must be ``[P, ...]`` of the states' ``dtype`` (the op writes the final states into it);
    returns them as int32.

    Concrete values are checked here: below ``P``, distinct where non-negative. Traced ones cannot be;
    ``tops_core.ops.pool`` makes what breaks a rule NaN.
    """
    if value is None:
        return None
    if initial_state is None:
        raise ValueError(
            "ssm_state_indices names rows of a state pool, which is passed as initial_state [P, H, K, V]: "
            "pass the pool as initial_state (zeros for rows not in use)"
        )
    indices = array("ssm_state_indices", value)
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"ssm_state_indices must be an int32 array (one pool row per sequence), got {indices.dtype}")
    rank("ssm_state_indices", indices, 1, "[N], one per sequence")
    if indices.shape[0] != num_seqs:
        raise ValueError(
            f"ssm_state_indices must have shape [N] = ({num_seqs},), one per sequence (N = B, or the packed count "
            f"with cu_seqlens), got {tuple(indices.shape)}"
        )
    rank("initial_state", initial_state, 4, "a pool [P, H, K, V] with ssm_state_indices")
    if initial_state.dtype != dtype:
        raise TypeError(
            f"initial_state is a state pool here (ssm_state_indices is given): the op writes the final states into it, "
            f"so it must have their dtype {jnp.dtype(dtype).name}, got {initial_state.dtype}"
        )
    if is_concrete(indices):
        host, size = np.asarray(indices), initial_state.shape[0]
        if np.any(host >= size):
            raise ValueError(f"ssm_state_indices must be below the pool's P = {size} rows (initial_state), got {host.tolist()}")
        used, counts = np.unique(host[host >= 0], return_counts=True)
        if np.any(counts > 1):
            raise ValueError(
                f"ssm_state_indices must be distinct where non-negative (each sequence writes its own pool row): "
                f"rows {used[counts > 1].tolist()} repeat in {host.tolist()}"
            )
    return indices.astype(jnp.int32)


def state_shape(initial_state: jax.Array, indices: jax.Array | None, num_seqs: int, dims: tuple[int, ...], names: str) -> None:
    """``initial_state`` is ``[N, *dims]``, or a pool ``[P, *dims]`` of any ``P >= 1`` with ``ssm_state_indices``."""
    if indices is None:
        shape("initial_state", initial_state, (num_seqs, *dims), f"[N, {names}]")
        return
    shape("initial_state", initial_state, (max(initial_state.shape[0], 1), *dims), f"a pool [P, {names}] with ssm_state_indices")


def cu_seqlens_valid(cu: jax.Array, seq_len: int) -> jax.Array:
    """The rules of ``cu_seqlens`` as a boolean scalar computed inside the program (for traced boundaries)."""
    return (cu[0] == 0) & jnp.all(cu[1:] >= cu[:-1]) & (cu[-1] == seq_len)


def placeholder_cu_seqlens(num_seqs: int, seq_len: int) -> jax.Array:
    """Valid boundaries of the same shape, ``T`` split as evenly as it goes, run in place of invalid traced ones: with
    ``T >= N`` every sequence has a token, so a kernel that writes a pool row where a sequence ends writes every row
    the call names (NaN: ``OpContract._checked``)."""
    return (jnp.arange(num_seqs + 1) * seq_len // num_seqs).astype(jnp.int32)


def qkv(
    q: Any, k: Any, v: Any, *, initial_state_given: bool = False, grouped_values: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, tuple[int, int, int, int, int]]:
    """Check ``q, k: [B, T, H, K]`` and ``v: [B, T, H, V]`` of one floating dtype; returns them and (B, T, H, K, V).

    ``grouped_values``: ``v`` may have ``HV`` heads, a multiple of ``H`` (grouped value heads).

    A head-first ``[B, H, T, K]`` array passed by mistake reads as ``H`` tokens of ``T`` heads;
    models have fewer heads than tokens, so ``1 < T < H`` suggests one, and a ``LayoutWarning``
    says so. Not for one token: a decode step ``[B, 1, H, K]`` is time-major, and a head-first
    array reads as one token only for a one-head model. Not with ``initial_state_given``: the
    state's ``[N, H, K, V]`` shape, checked against ``q``'s ``H``, settles the layout (a swapped
    call fails that check).
    """
    q, k, v = (array(name, x, python=False) for name, x in (("q", q), ("k", k), ("v", v)))
    for name, x in (("q", q), ("k", k), ("v", v)):
        floating(name, x)
        rank(name, x, 4, "[B, T, H, K]" if name != "v" else "[B, T, H, V]")
    positive_dims("q", q, "[B, T, H, K]")
    B, T, H, K = q.shape
    if 1 < T < H and not initial_state_given:
        warnings.warn(
            f"q has shape {tuple(q.shape)}: T = {T} tokens but H = {H} heads. tops expects [B, T, H, K] "
            "(time before heads); if these are head-first [B, H, T, K] arrays, pass x.swapaxes(1, 2)",
            LayoutWarning, stacklevel=4,
        )
    shape("k", k, (B, T, H, K), "[B, T, H, K] like q")
    if grouped_values and tuple(v.shape[:2]) == (B, T) and v.shape[3] >= 1 and v.shape[2] % H:
        raise ValueError(
            f"v has HV = {v.shape[2]} value heads, not a multiple of q's H = {H} heads: with grouped value heads "
            f"each of q's heads serves HV / H of v's (shape {tuple(v.shape)})"
        )
    if tuple(v.shape[:2]) != (B, T) or v.shape[3] < 1 or not (v.shape[2] == H or grouped_values and v.shape[2] >= H):
        expected = "[B, T, HV, V] with HV a multiple of H" if grouped_values else "[B, T, H, V]"
        raise ValueError(f"v must have shape {expected}, with B, T, H = {(B, T, H)} like q, got {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    return q, k, v, (B, T, H, K, v.shape[3])
