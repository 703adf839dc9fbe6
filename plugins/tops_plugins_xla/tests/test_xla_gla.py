"""xla.chunk for gla beyond the conformance grid: flash-linear-attention's own recurrence (extreme decays and
traced boundaries: ``test_xla_extremes.py``)."""

import jax
import jax.numpy as jnp
import numpy as np

import tops_core
from tops_core.conformance.compare import measure, tolerance

GLA = tops_core.op("gla")


def naive_recurrent_gla(q, k, v, gk, initial_state=None, output_final_state=False):
    """flash-linear-attention's fla/ops/gla/naive.py, ported to NumPy: its names and steps, float64, scale K ** -0.5."""
    B, T, H, K = q.shape
    scale = K**-0.5
    h = np.zeros((B, H, K, v.shape[-1]))
    if initial_state is not None:
        h = h + initial_state
    o = np.zeros(v.shape)
    for i in range(T):
        q_i, k_i, v_i, gk_i = q[:, i] * scale, k[:, i], v[:, i], np.exp(gk[:, i])
        h = h * gk_i[..., None] + k_i[..., None] * v_i[..., None, :]
        o[:, i] = (q_i[..., None] * h).sum(-2)
    return o, h if output_final_state else None


def test_matches_flash_linear_attention_naive_gla():
    rng = np.random.default_rng(0)
    B, T, H, K, V = 2, 130, 2, 32, 16
    q, k, v = rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, H, V))
    gk, h0 = -np.logaddexp(0, -rng.standard_normal((B, T, H, K))) / 8, rng.standard_normal((B, H, K, V))
    want_o, want_state = naive_recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    with jax.enable_x64(True):
        o, state = GLA.forward(*(jnp.asarray(x) for x in (q, k, v, gk)), initial_state=jnp.asarray(h0), output_final_state=True,
                               implementation="xla.chunk")
        for name, got, want in (("o", o, want_o), ("final_state", state, want_state)):
            assert measure(name, got, jnp.asarray(want), tolerance("float64", gradient=False)).passed, name


def test_under_vmap_each_member_gets_its_own_decays():
    """vmap over calls whose chunks differ in the dense form's choice (mild gates in one, ``-10`` per token in the other):
    the choice, batched, runs both forms and keeps each member's own, forward and every gradient."""
    rng = np.random.default_rng(3)
    B, T, H, K, V = 1, 96, 2, 16, 8
    q, k = (jnp.asarray(rng.standard_normal((2, B, T, H, K)) * K**-0.5, jnp.float32) for _ in range(2))
    v, do = (jnp.asarray(rng.standard_normal((2, B, T, H, V)), jnp.float32) for _ in range(2))
    g = jnp.asarray(np.stack([np.full((B, T, H, K), -0.05), np.full((B, T, H, K), -10.0)]), jnp.float32)

    def loss(impl, q, k, v, g, do):
        return jnp.sum(GLA.forward(q, k, v, g, implementation=impl)[0] * do)

    batched = jax.jit(jax.vmap(jax.value_and_grad(lambda *a: loss("xla.chunk", *a), argnums=(0, 1, 2, 3))))(q, k, v, g, do)
    for member in range(2):
        got = jax.tree.map(lambda x: x[member], batched)
        want = jax.value_and_grad(lambda *a: loss("ref.recurrent", *a), argnums=(0, 1, 2, 3))(q[member], k[member], v[member], g[member], do[member])
        assert measure("loss", got[0], want[0], tolerance("float32", gradient=False)).passed
        for name, x, ref in zip(("dq", "dk", "dv", "dg"), got[1], want[1]):
            measurement = measure(name, x, ref, tolerance("float32", gradient=True))
            assert measurement.passed, measurement.describe()
