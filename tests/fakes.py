"""Plain-jax implementations registered in-process by the core tests (not kernels, not the oracle).

``scan_forward`` is a float32 token-by-token scan of the simple_gla recurrence (docs/ops.md) without
varlen; ``vjp_backward`` differentiates it with ``jax.vjp``. They let the core tests exercise
dispatch, custom_vjp wiring, jit and vmap without any plugin installed.
"""

import dataclasses

import jax
import jax.numpy as jnp

import tops_core
from tops_core import Capabilities, Implementation, SimpleGLAGrads

FEATURES = {"g", "g_gamma", "initial_state", "output_final_state"}


def scan_forward(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, config):
    B, T, H, K = q.shape
    V = v.shape[-1]
    decay = jnp.zeros((B, T, H), jnp.float32)
    if g is not None:
        decay = decay + g
    if g_gamma is not None:
        decay = decay + g_gamma
    state = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def step(state, inputs):
        q_t, k_t, v_t, a_t = inputs
        state = jnp.exp(a_t)[..., None, None] * state + k_t[..., :, None] * v_t[..., None, :]
        return state, scale * jnp.einsum("bhk,bhkv->bhv", q_t, state)

    time_major = [x.swapaxes(0, 1).astype(jnp.float32) for x in (q, k, v, decay)]
    state, o = jax.lax.scan(step, state, time_major)
    return o.swapaxes(0, 1).astype(v.dtype), state if output_final_state else None


def vjp_backward(q, k, v, do, *, g, g_gamma, scale, initial_state, dht, cu_seqlens, config):
    def run(q, k, v, g, g_gamma, initial_state):
        return scan_forward(q, k, v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                            output_final_state=True, cu_seqlens=None, config=None)

    (o, ht), pullback = jax.vjp(run, q, k, v, g, g_gamma, initial_state)
    dq, dk, dv, dg, dg_gamma, dh0 = pullback((do, jnp.zeros_like(ht) if dht is None else dht))
    return SimpleGLAGrads(dq, dk, dv, dg, dg_gamma, dh0)


def states_of(q, k, v, *, g, g_gamma, initial_state):
    """The state after every token, ``[B, H, T, K, V]`` float32: what ``keeping_forward`` hands its backward."""
    B, T, H, K = q.shape
    decay = jnp.zeros((B, T, H), jnp.float32)
    for gate in (g, g_gamma):
        decay = decay if gate is None else decay + gate
    state = jnp.zeros((B, H, K, v.shape[-1]), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def step(state, inputs):
        k_t, v_t, a_t = inputs
        state = jnp.exp(a_t)[..., None, None] * state + k_t[..., :, None] * v_t[..., None, :]
        return state, state

    _, states = jax.lax.scan(step, state, [x.swapaxes(0, 1).astype(jnp.float32) for x in (k, v, decay)])
    return jnp.moveaxis(states, 0, 2)


def keeping_forward(q, k, v, *, residuals=False, **kwargs):
    """``scan_forward``, which with ``residuals=True`` also hands on every token's state (``Implementation.residuals``)."""
    outputs = scan_forward(q, k, v, **kwargs)
    if not residuals:
        return outputs
    return outputs, {"states": states_of(q, k, v, g=kwargs["g"], g_gamma=kwargs["g_gamma"], initial_state=kwargs["initial_state"])}


def backward_from_states(q, k, v, do, *, residuals=None, **kwargs):
    """``vjp_backward``, but ``dq = scale do S_t^T`` from the forward's states when it hands them on: a backward given
    zeros in their place would return a zero ``dq``."""
    grads = vjp_backward(q, k, v, do, **kwargs)
    if residuals is None:
        return grads
    dq = kwargs["scale"] * jnp.einsum("bthv,bhtkv->bthk", do.astype(jnp.float32), residuals["states"])
    return dataclasses.replace(grads, dq=dq.astype(q.dtype))


@dataclasses.dataclass(frozen=True)
class FakeConfig:
    chunk_size: int = 64


def implementation(name="scan", *, forward=scan_forward, backward=vjp_backward, priority=None, residuals=False, **capabilities):
    capabilities.setdefault("features", FEATURES)
    capabilities.setdefault("ndims", {"g_gamma": {0, 1}})
    return Implementation(
        op="simple_gla", name=name, forward=forward, backward=backward,
        capabilities=Capabilities(**capabilities), priority=priority if priority is not None else {"cpu": 10},
        config=FakeConfig(), description=f"test fake {name}", residuals=residuals,
    )


def register(name="scan", plugin="fake", **kwargs):
    return tops_core.register(implementation(name, **kwargs), plugin=plugin)


def inputs(B=2, T=12, H=3, K=8, V=5, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = (jax.random.normal(keys[0], (B, T, H, K)) * K**-0.5).astype(dtype)
    k = (jax.random.normal(keys[1], (B, T, H, K)) * K**-0.5).astype(dtype)
    v = jax.random.normal(keys[2], (B, T, H, V)).astype(dtype)
    g = jax.nn.log_sigmoid(jax.random.normal(keys[3], (B, T, H))) / 16
    g_gamma = -(2.0 ** (-8.0 * jnp.arange(1, H + 1) / H))
    return q, k, v, g, g_gamma
