"""``tpu_pallas.recurrent``, the decode kernel: how it maps a pool's padding slots onto the grid, and that mapping under
Pallas' faithful TPU interpreter (the fast one hides it: it writes every output block back at every grid point).

The kernel's accuracy on every case of the conformance kit, a state pool included, is the kit's
(``tests/test_conformance.py``); the pool's contract for every implementation is ``tests/test_pool.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tops_core
from jax.experimental.pallas import tpu as pltpu
from tops_core.conformance.compare import measure, tolerance

from tops_plugins_tpu_pallas import recurrent


def test_a_padding_slot_takes_the_row_of_the_sequence_before_it_or_after_it_at_the_start():
    rows, roles = recurrent.pool_rows(jnp.asarray([-1, -1, 4, -1, 7, 2, -1], jnp.int32))
    assert rows.tolist() == [4, 4, 4, 4, 7, 2, 2]
    own, zero = recurrent.OWN_ROW, recurrent.ZERO_START
    assert roles.tolist() == [zero, zero, own, zero, own, own, zero]
    rows, roles = recurrent.pool_rows(jnp.asarray([-1, -1], jnp.int32))  # no row written: the block passes through
    assert rows.tolist() == [0, 0] and roles.tolist() == [recurrent.COPY_THROUGH] * 2


def test_a_head_block_holds_every_head_or_a_multiple_of_8_within_the_block_bytes():
    assert recurrent.heads_per_block(8, 128, 128) == 8  # 512 KiB
    assert recurrent.heads_per_block(16, 128, 256) == 8  # 2 MiB for all 16: two blocks of 8
    assert recurrent.heads_per_block(12, 256, 256) is None  # 256 KiB a head: no multiple of 8 divides 12
    assert "HV=12 heads of K=256 x V=256" in recurrent.fits(12, 256, 256)


# Two blocks of 8 heads (V = 256) on the interpreter's two cores; padding slots first, between and last, and a call
# that writes no row. Uninitialised memory is NaN: a block a padding slot's grid points wrote back unwritten would
# show as NaN rows, one they wrote from the wrong sequence as a wrong row.
@pytest.mark.parametrize("indices", [[-1, 4, -1, -1, 7], [-1, -1, -1, -1, -1]], ids=["slots-around-rows", "no-row"])
def test_padding_slots_under_the_faithful_interpreter(indices, race_reports):
    B, T, H, HV, K, V, P = 5, 2, 1, 16, 8, 256, 12
    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    arrays = dict(q=normal(B, T, H, K), k=normal(B, T, H, K), v=normal(B, T, HV, V), g=-jnp.abs(normal(B, T, HV, K)),
                  beta=jax.nn.sigmoid(normal(B, T, HV)), initial_state=normal(P, HV, K, V),
                  ssm_state_indices=jnp.asarray(indices, jnp.int32))
    faithful = pltpu.InterpretParams(uninitialized_memory="nan", num_cores_or_threads=2, detect_races=True, random_seed=0)
    kda = tops_core.op("kda")
    with tops_core.use(interpret=True, strict=True):
        o, pool = jax.jit(lambda a: kda.forward(**a, output_final_state=True, use_qk_l2norm=True,
                                                implementation=("tpu_pallas.recurrent", {"interpret": faithful})))(arrays)
    o_ref, pool_ref = kda.forward(**arrays, output_final_state=True, use_qk_l2norm=True, implementation="ref.recurrent")
    assert len(race_reports) == 1 and not race_reports[0].races_found
    for name, got, want in (("o", o, o_ref), ("pool", pool, pool_ref)):
        result = measure(name, got, want, tolerance("float32", gradient=False))
        assert result.passed, result.describe()
    untouched = [row for row in range(P) if row not in indices]
    np.testing.assert_array_equal(np.asarray(pool)[untouched], np.asarray(arrays["initial_state"])[untouched])
