"""``tpu_pallas.recurrent``: decode steps token by token in one ``pallas_call``, state-pool rows read and written in place.

A decode step moves one token per sequence (a few for speculative drafts) and the sequences' whole
states: the states are all the bytes. So the kernel reads each state once, runs the call's tokens
through it in VMEM, and writes it once, straight from and to its row of the caller's pool
(``ssm_state_indices``; ``tops_core.ops.pool``): no gathered copy, no chunk padding.

Grid ``(head block, sequence)``: heads "parallel", sequences "arbitrary" (in order on one core, which
the padding rule below relies on). A grid point holds ``heads`` value heads of one sequence: its
state rows ``[heads, K, V]`` arrive through the pipeline from row ``rows[n]`` of the pool (a
scalar-prefetch array), so the next sequence's rows are fetched while this one computes, and the
final state leaves the same way, into the same row of the pool's output, which aliases the pool
(``input_output_aliases``): a donated pool is updated where it lies.

A padding slot (index ``-1``) starts from zeros and writes nothing. Its grid points take the row of
the nearest sequence before it that has one (after it, at the start): consecutive grid points with
the same block index neither fetch it again nor write it back between them, so the slot's points
leave the block as that sequence's points leave it. When no sequence of the call has a row, every
point copies its block through unchanged.

Per token and head, on the VPU in float32, with keys along sublanes (each token's ``[heads, K]``
rows transposed once) and values along lanes::

    S = d_t S               (d_t per key: exp of the log decay; simple_gla's is the same for every key)
    S = S + k_t^T v_t                    without the delta rule, else
    S = S + (beta_t k_t)^T (v_t - k_t S)
    o_t = q_t S             (q_t scaled)

The op-specific inputs (decays, normalised and scaled ``q, k``, ``beta k``) are formed by the op's
wrapper (``simple_gla/recurrent.py``, ``kda/recurrent.py``) as float32 ``[N, T, HV, K]`` arrays: a
few hundred bytes per head and token, beside a state of ``4 K V`` bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tops_plugins_tpu_pallas import launch
from tops_plugins_tpu_pallas.config import check_interpret
from tops_plugins_tpu_pallas.plan import Blocked, LaunchPlan, Scalars, Scratch

_F32 = jnp.float32

BLOCK_BYTES = 2**20
"""The most state bytes one grid point holds (double-buffered in and out: four times this in VMEM)."""

OWN_ROW, ZERO_START, COPY_THROUGH = 0, 1, 2
"""A sequence's role: it reads its row (zeros without an initial state) and writes it; it starts from zeros and writes
nothing (a padding slot); it starts from zeros and copies its block through (a padding slot, and no sequence of the
call has a row)."""


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """``interpret``: None compiles where lowered for a TPU and interprets elsewhere (as every kernel's config)."""

    interpret: Any = None

    def __post_init__(self):
        check_interpret(self)


def heads_per_block(value_heads: int, K: int, V: int) -> int | None:
    """The value heads of a grid point: all of them, or the most that keep the state block within ``BLOCK_BYTES``
    and the token blocks tiled (a multiple of 8, the sublanes); None when no such count divides ``value_heads``."""
    per_head = 4 * K * V
    if value_heads * per_head <= BLOCK_BYTES:
        return value_heads
    fitting = [h for h in range(8, value_heads, 8) if value_heads % h == 0 and h * per_head <= BLOCK_BYTES]
    return max(fitting) if fitting else None


def fits(value_heads: int, K: int, V: int) -> str | None:
    """A capability reason when no head block fits (``heads_per_block``), else None."""
    if heads_per_block(value_heads, K, V) is None:
        return (
            f"HV={value_heads} heads of K={K} x V={V} float32 states: no block of all of them or of a multiple of 8 "
            f"dividing HV holds within {BLOCK_BYTES // 2**20} MiB"
        )
    return None


def fits_vmem(shape: Shape, value_dtype, *, delta: bool, writes_state: bool, target: launch.Target) -> str | None:
    """A capability reason when the launch (a grid point holds every token of its sequence) exceeds ``target``'s VMEM
    budget, else None: long calls are not decode steps, and Mosaic would refuse them (T=4096, 8 heads of K=V=128 on a
    v6e: 144.6 MiB of its 128)."""
    needed = launch.needed_vmem((plan(shape, value_dtype, delta=delta, writes_state=writes_state, in_place=False),))
    if needed <= target.budget:
        return None
    return (
        f"T={shape.T}: a grid point holds its sequence's every token, {needed / 2**20:.1f} MiB of VMEM with its states, "
        f"more than the {target.describe()}"
    )


@dataclasses.dataclass(frozen=True)
class Shape:
    """A call as the kernel sees it: ``N`` sequences of ``T`` tokens, ``HV`` value heads, ``K`` x ``V`` states;
    ``pool_rows`` the rows of the state input (``N`` for a dense one, 0 for none)."""

    N: int
    T: int
    HV: int
    K: int
    V: int
    pool_rows: int

    @property
    def heads(self) -> int:
        return heads_per_block(self.HV, self.K, self.V)


def plan(shape: Shape, value_dtype, *, delta: bool, writes_state: bool, in_place: bool) -> LaunchPlan:
    """The launch: ``delta`` the delta rule (``beta_k`` read); ``writes_state`` a final state written, into the pool
    itself (aliased) when ``in_place``, else into a fresh ``[N, HV, K, V]``."""
    N, T, HV, K, V, heads = shape.N, shape.T, shape.HV, shape.K, shape.V, shape.heads

    def tokens(name: str, width: int, dtype) -> Blocked:
        return Blocked(name, (N, T, HV, width), dtype, (None, T, heads, width), lambda h, n, *_: (n, 0, h, 0))

    def state(name: str, rows: int) -> Blocked:
        return Blocked(name, (rows, HV, K, V), _F32, (None, heads, K, V), lambda h, n, rows, *_: (rows[n], h, 0, 0))

    keys = ["q", "k", "decay"] + (["beta_k"] if delta else [])
    inputs = [tokens(name, K, _F32) for name in keys] + [tokens("v", V, value_dtype)]
    if shape.pool_rows:
        inputs.append(state("initial_state", shape.pool_rows))
    outputs = [tokens("o", V, value_dtype)]
    if writes_state:
        outputs.append(state("final_state", shape.pool_rows if in_place else N))
    steps = N * T * HV * K * V
    return LaunchPlan(
        name="tops_recurrent",
        grid=(HV // heads, N),
        dimension_semantics=("parallel", "arbitrary"),
        scalars=(Scalars("rows", (N,), jnp.int32), Scalars("roles", (N,), jnp.int32)),
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        scratch=(Scratch("state", (heads, K, V), _F32), Scratch("outputs", (T, heads, V), _F32)),
        body_vmem=4 * 4 * K * V,  # a head's state and its products while a token updates it
        flops=steps * (7 if delta else 5),
        aliases=(("initial_state", "final_state"),) if in_place and writes_state else (),
    )


def _kernel(*refs, plan: LaunchPlan, delta: bool):
    named = plan.bind(refs)
    n = pl.program_id(1)
    role = named["roles"][n]
    state, outputs = named["state"], named["outputs"]
    T, heads = outputs.shape[:2]
    if "initial_state" in named:
        state[...] = jnp.where(role == OWN_ROW, named["initial_state"][...], 0)
    else:
        state[...] = jnp.zeros(state.shape, _F32)

    def token(t, carry):
        q, k, decay = (named[name][t].astype(_F32).T for name in ("q", "k", "decay"))  # [K, heads]: keys along sublanes
        beta_k = named["beta_k"][t].astype(_F32).T if delta else None
        v = named["v"][t].astype(_F32)
        for h in range(heads):
            s = state[h] * decay[:, h:h + 1]
            if delta:
                s = s + beta_k[:, h:h + 1] * (v[h:h + 1] - jnp.sum(k[:, h:h + 1] * s, axis=0, keepdims=True))
            else:
                s = s + k[:, h:h + 1] * v[h:h + 1]
            state[h] = s
            outputs[t, h:h + 1, :] = jnp.sum(q[:, h:h + 1] * s, axis=0, keepdims=True)
        return carry

    lax.fori_loop(0, T, token, 0)
    named["o"][...] = outputs[...].astype(named["o"].dtype)
    if "final_state" not in named:
        return
    final = named["final_state"]

    @pl.when(role == OWN_ROW)
    def _():
        final[...] = state[...]

    if "initial_state" in named and plan.aliases:
        @pl.when(role == COPY_THROUGH)
        def _():
            final[...] = named["initial_state"][...]


def pool_rows(indices: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(rows, roles)`` of a pool call whose ``indices`` lie in ``[-1, P)``, distinct where non-negative (the core
    makes them so): a padding slot takes the nearest row before it that a sequence owns (after it, at the start)."""
    own = indices >= 0
    positions = jnp.arange(indices.shape[0])
    before = lax.cummax(jnp.where(own, positions, -1))
    source = jnp.where(before >= 0, before, jnp.argmax(own))
    rows = jnp.maximum(indices[source], 0)
    roles = jnp.where(own, OWN_ROW, jnp.where(jnp.any(own), ZERO_START, COPY_THROUGH))
    return rows.astype(jnp.int32), roles.astype(jnp.int32)


def run(q, k, decay, v, beta_k, initial_state, ssm_state_indices, *, output_final_state: bool, config: RecurrentConfig):
    """``(o, final_state)``: ``q`` (scaled), ``k``, ``decay``, ``beta_k`` (None without the delta rule) float32
    ``[N, T, HV, K]``, ``v`` ``[N, T, HV, V]``; ``initial_state`` None, ``[N, HV, K, V]``, or a float32 pool
    ``[P, HV, K, V]`` with ``ssm_state_indices`` ``[N]`` (then the final state is the pool, updated in place)."""
    N, T, HV, K = q.shape
    V = v.shape[-1]
    pooled = ssm_state_indices is not None
    if pooled:
        rows, roles = pool_rows(ssm_state_indices)
    else:
        rows, roles = jnp.arange(N, dtype=jnp.int32), jnp.full((N,), OWN_ROW, jnp.int32)
    shape = Shape(N, T, HV, K, V, 0 if initial_state is None else initial_state.shape[0])
    launch_plan = plan(shape, v.dtype, delta=beta_k is not None, writes_state=output_final_state, in_place=pooled)
    arrays = dict(rows=rows, roles=roles, q=q, k=k, decay=decay, beta_k=beta_k, v=v)
    if initial_state is not None:
        arrays["initial_state"] = initial_state.astype(_F32)
    results = launch.run(
        launch_plan, _kernel, arrays, target=launch.Target.lowered_for(), interpret=config.interpret, delta=beta_k is not None,
    )
    return results["o"], results.get("final_state")
