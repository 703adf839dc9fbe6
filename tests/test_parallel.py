"""``tops_core.parallel.shard`` in this one-device process: what it accepts, and that a split call is still the call.

The splits over several devices are in ``test_sharded.py`` (a worker with 8 CPU devices); here a
mesh of the one device runs the same code paths: a split sequence of one block still goes
through the state exchange, which must then change nothing.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import tops_core
from tests import fakes
from tops_core import parallel
from tops_core.tpu.compile_only import Collective, collectives

sg = tops_core.op("simple_gla")


@pytest.fixture
def mesh():
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "seq"))


def test_shard_names_mesh_axes_once_each(mesh):
    with pytest.raises(ValueError, match=r"sequence='time' names no axis of the mesh \(axes: data, seq\)"):
        with parallel.shard(mesh, sequence="time"):
            pass
    with pytest.raises(ValueError, match="a mesh axis divides two dimensions"):
        with parallel.shard(mesh, batch="data", heads=("seq", "data")):
            pass
    with pytest.raises(ValueError, match="pass a mesh, or set one with jax.set_mesh"):
        with parallel.shard(batch="data"):
            pass


def test_the_split_holds_inside_the_block_only(mesh):
    assert parallel.current() is None
    with parallel.shard(mesh, batch="data", sequence=("seq",)) as split:
        assert parallel.current() is split
        assert (split["b"], split["t"], split["h"]) == (("data",), ("seq",), ())
    assert parallel.current() is None


def test_a_split_on_one_device_changes_nothing_forward_or_backward(registry, mesh):
    fakes.register("scan")
    q, k, v, g, g_gamma = fakes.inputs()
    h0 = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 8, 5))

    def loss(q, k, v, g, g_gamma, h0):
        o, ht = sg.forward(q, k, v, g=g, g_gamma=g_gamma, initial_state=h0, output_final_state=True)
        return jnp.sum(o * jnp.sin(o)) + jnp.sum(ht * jnp.cos(ht))

    whole = jax.jit(jax.value_and_grad(loss, argnums=range(6)))(q, k, v, g, g_gamma, h0)

    def split_loss(*args):
        with parallel.shard(mesh, batch="data", sequence="seq"):
            return loss(*args)

    split = jax.jit(jax.value_and_grad(split_loss, argnums=range(6)))(q, k, v, g, g_gamma, h0)
    for got, want in zip(jax.tree.leaves(split), jax.tree.leaves(whole)):
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


def test_a_split_call_under_vmap(registry, mesh):
    fakes.register("scan")
    q, k, v, _, g_gamma = fakes.inputs()

    def output(q):
        with parallel.shard(mesh, batch="data"):
            return sg.forward(q, k, v, g_gamma=g_gamma)[0]

    stacked = jnp.stack([q, 2 * q])
    np.testing.assert_allclose(jax.jit(jax.vmap(output))(stacked), jax.vmap(lambda q: sg.forward(q, k, v, g_gamma=g_gamma)[0])(stacked), rtol=1e-6)


def test_an_op_without_a_sequence_parallel_algorithm_refuses_to_split_the_sequence_and_says_why(mesh, monkeypatch):
    # Every op here has one; an op added through the registry need not (OpContract.sequence_parallel).
    kda = tops_core.op("kda")
    monkeypatch.setattr(type(kda), "sequence_parallel", None)
    x = jnp.ones((1, 8, 2, 4))
    with pytest.raises(ValueError, match="cannot split the sequence over mesh axis 'seq': kda has no sequence-parallel algorithm; shard the batch or the heads"):
        with parallel.shard(mesh, sequence="seq"):
            kda.forward(x, x, x, x, jnp.ones((1, 8, 2)))


def test_inputs_typed_over_explicit_mesh_axes_carry_their_split(registry):
    fakes.register("scan")
    explicit = Mesh(np.array(jax.devices()[:1]), ("data",), axis_types=(AxisType.Explicit,))
    q, k, v, _, g_gamma = fakes.inputs()
    placed = [jax.device_put(x, NamedSharding(explicit, PartitionSpec("data"))) for x in (q, k, v)]
    with jax.set_mesh(explicit):
        o, _ = jax.jit(lambda q, k, v: sg.forward(q, k, v, g_gamma=g_gamma))(*placed)
        assert "shard_map" in jax.jit(lambda q, k, v: sg.forward(q, k, v, g_gamma=g_gamma)).trace(*placed).jaxpr.pretty_print()
    np.testing.assert_allclose(o, sg.forward(q, k, v, g_gamma=g_gamma)[0], rtol=1e-6)


def test_unsharded_inputs_split_over_explicit_mesh_axes(registry):
    # jax.make_mesh's axes are Explicit: shard_map refuses an input whose type does not match its
    # in_specs there, so the op reshards its inputs to the split (forward, gradient, explicit backward).
    fakes.register("scan")
    explicit = jax.make_mesh((1, 1), ("data", "seq"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    q, k, v, g, g_gamma = fakes.inputs()

    def loss(q, k, v, g):
        return jnp.sum(sg.forward(q, k, v, g=g, g_gamma=g_gamma)[0] ** 2)

    def split(function):
        def run(*args, **kwargs):
            with parallel.shard(explicit, batch="data", sequence="seq"):
                return function(*args, **kwargs)
        return run

    whole = jax.value_and_grad(loss, argnums=range(4))(q, k, v, g)
    for got, want in zip(jax.tree.leaves(jax.jit(jax.value_and_grad(split(loss), argnums=range(4)))(q, k, v, g)), jax.tree.leaves(whole)):
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    grads = split(sg.backward)(q, k, v, q[..., :5], g=g, g_gamma=g_gamma)
    want = sg.backward(q, k, v, q[..., :5], g=g, g_gamma=g_gamma)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-6)


def test_collectives_read_from_compiled_hlo():
    text = """HloModule m
ENTRY %main (p: f32[2,8,128,128]) -> f32[2,8,128,128] {
  %p = f32[2,8,128,128]{3,2,1,0:T(8,128)} parameter(0)
  %collective-permute-start = (f32[2,8,128,128]{3,2,1,0:T(8,128)}, f32[2,8,128,128]{3,2,1,0:T(8,128)}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%p), channel_id=1, source_target_pairs={{0,1}}
  %collective-permute-done = f32[2,8,128,128]{3,2,1,0:T(8,128)} collective-permute-done(%collective-permute-start)
  %all-reduce.1 = (f32[], f32[4]{0}) all-reduce(%a, %b), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  ROOT %psum.7 = f32[8]{0:T(128)} all-reduce(%c), channel_id=3, replica_groups={{0,1,2,3}}, to_apply=%add
}
"""
    assert collectives(text) == (
        Collective("collective-permute", "f32[2,8,128,128]", 2 * 8 * 128 * 128 * 4),
        Collective("all-reduce", "f32[], f32[4]", 4 + 16),
        Collective("all-reduce", "f32[8]", 32),
    )
