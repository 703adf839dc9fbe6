"""Reading what a compiled Mosaic kernel does from libtpu's dumps (``tops_core.tpu.llo``)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from tops_core.tpu import llo as tpu_llo

# A Mosaic final-LLO dump in the shape libtpu writes it (trimmed): a kernel on a grid of 3 whose
# body runs a loop of 5 trips around one bf16 MXU push, an exp and a transpose, then stores twice;
# and a helper function without a grid (an index map), which is not a kernel.
LLO = """module {
  func.func @kernel(%arg0: i32 {llo.type = i32}) attributes {dimension_semantics = [#xir.dimension_semantics<arbitrary>], iteration_bounds = array<i64: 3>, xir.main} {
    %16 = llo.constant {value = 0 : i32} : i32
    %17 = llo.constant {value = 1 : i32} : i32
    %18 = llo.constant {value = 5 : i32} : i32
    %scan3A:2 = scf.for %scan3A_0 = %16 to %18 step %17 iter_args(%a = %x) -> (vector<8x128xf32>)  : i32 {
      %get3A = llo.vector_load %arg1 masked %8 : i32 -> vector<8x128x2xbf16>
      "llo.vlatch"(%get3A) <{gain_latch_mode = #llo.gain_latch_mode<packed.bf16>, mxu_id = 0 : i32}> : (vector<8x128x2xbf16>) -> ()
      "llo.vmatmul"(%get3A) <{data_format = #llo.matmul_data_format<bf16>, mxu_id = 0 : i32}> : (vector<8x128x2xbf16>) -> ()
      %r = "llo.vmatres"() <{data_format = #llo.matmul_data_format<bf16>, mxu_id = 0 : i32}> : () -> vector<8x128xf32>
      %e = llo.vexp %r : vector<8x128xf32>
      %t = llo.vxpose %e : vector<8x128xf32>
      %s = llo.vadd.f32 %t, %a : vector<8x128xf32>
      scf.yield %s : vector<8x128xf32>
    } {in_layout = []}
    llo.vector_store %scan3A#0 into %arg3 : vector<8x128xf32> into i32
    llo.vector_store %scan3A#1 into %arg3 + %15 : vector<8x128xf32> into i32
    return {in_layout = []}
  }
  func.func @transform_0(%arg0: i32 {llo.type = i32}) -> (i32, i32) attributes {xir.core_type = #xir.core_type<tc>} {
    %0 = llo.vadd.f32 %arg0, %arg0 : vector<8x128xf32>
    return %0 : i32
  }
}
"""


def test_reads_a_kernels_grid_and_multiplies_loop_bodies_by_their_trips():
    (kernel,) = tpu_llo.read_mosaic(LLO)
    assert (kernel.name, kernel.grid, kernel.steps) == ("kernel", (3,), 3)
    step = kernel.per_step
    # Per trip: one push of a packed bf16 register (16 LHS rows), one weight load, one result, one exp,
    # one transpose, one vector add, one load; 5 trips; the two stores after the loop once.
    assert (step.mxu_pushes, step.mxu_rows, step.weight_loads, step.mxu_results) == (5, 80, 5, 5)
    assert (step.transcendentals, step.transposes, step.vector_alu, step.loads, step.stores) == (5, 5, 5, 5, 2)
    assert kernel.total == step * 3


# The backend's final bundles (trimmed): two bundles before a loop of 5 trips (exit test at its
# depth) of three bundles, in which a loop of 4 trips of two bundles is nested.
BUNDLES = """= control target key start
LB: loop body
= control target key end

     0   :  { %7 = vsyncpa [#allocation4], 0 }
   0x1   :  { %9 = vsyncpa [#allocation5], 0 }
   0x2 LB: > { %s1 = sadd.s32 1, %s0 }
   0x3 LB: >> { %v1 = vld [vmem:[#allocation6] sm:$0xff] }
   0x4   : >> { %p1 = scmp.ge.s32.totalorder %s2, 4 /* loop exit test */ }
   0x5   : > { %p2 = scmp.ge.s32.totalorder %s1, 5 /* loop exit test */ }
"""


def test_counts_issued_cycles_as_bundles_times_the_trips_of_their_loops():
    schedule = tpu_llo.read_bundles(BUNDLES, "kernel.1")
    assert schedule.bundles == 6
    assert schedule.loops == ((5, 2), (4, 2))  # (trips, bundles at that depth) outermost first
    assert schedule.cycles == 2 + 5 * (2 + 4 * 2)


# A grid loop of 5 trips (3 grid steps and the pipeline's two) whose body, three bundles with a loop of 4 trips of
# one bundle in it, a forward branch skips on the pipeline's trips.
PIPELINED = """= control target key start
LB: loop body
= control target key end

     0   :  { %7 = vsyncpa [#allocation4], 0 }
   0x1 LB: > { %s1 = sadd.s32 1, %s0 }
   0x2   : > { %2 = sbr.rel (%p1_p0) target = $region9 }
   0x3   : > { %v1 = vld [vmem:[#allocation6_spill] sm:$0xff]  ;;  %v9 = vpop.f32.mrf.mxu0 } /* Start region 8 */
   0x4 LB: >> { %v2 = vadd.f32 %v1, %v1  ;;  %vm1 = vmand %vm2, %vm3  ;;  %v5 = vexp2.f32 %v2 }
   0x5   : >> { %p2 = scmp.ge.s32.totalorder %s2, 4 /* loop exit test */ }
   0x6   : > { %v3 = vmul.f32 %v2, %v2  ;;  %4 = vst [vmem:[#allocation7_spill] sm:$0xff] /*vst_source=*/%v3  ;;  %6 = vxpose.xlu0.b32 %v3 } /* End region 8 */
   0x7   : > { %s3 = sadd.s32 1, %s1  ;;  %v8 = vld [vmem:[%s3] sm:$0xff] } /* Start/End empty region 9 */
   0x8   : > { %p3 = scmp.ge.s32.totalorder %s1, 5 /* loop exit test */ }
"""


def test_counts_the_grid_loops_body_once_per_step_it_computes():
    schedule = tpu_llo.read_bundles(PIPELINED, "kernel.1")
    assert schedule.loops == ((5, 6), (4, 2))
    body = 1 + 4 * 2 + 1  # the bundles the branch skips, one trip of the grid loop
    assert (schedule.body_cycles, schedule.cycles) == (body, 1 + 5 * (4 + body))
    steps = tpu_llo.MosaicKernel("kernel", (3,), tpu_llo.UnitCounts())
    assert tpu_llo.DumpedKernel("kernel.1", steps, schedule).cycles == 1 + 5 * 4 + 3 * body
    # Two TensorCores sharing the 6 steps of a grid run 3 each; a loop that does not match the grid is left as it is.
    assert tpu_llo.DumpedKernel("kernel.1", dataclasses.replace(steps, grid=(6,)), schedule).cycles == 1 + 5 * 4 + 3 * body
    assert tpu_llo.DumpedKernel("kernel.1", dataclasses.replace(steps, grid=(4,)), schedule).cycles == schedule.cycles


# A loop of 3 trips of two bundles, with a loop in it whose trip count is traced (no constant exit test: the compiler
# compares with a register), of one bundle.
TRACED = """= control target key start
LB: loop body
= control target key end

     0   :  { %7 = vsyncpa [#allocation4], 0 }
   0x1 LB: > { %s1 = sadd.s32 1, %s0 }
   0x2 LB: >> { %v2 = vadd.f32 %v1, %v1  ;;  %p2 = scmp.ge.s32.totalorder %s2, %s9 }
   0x3   : > { %p3 = scmp.ge.s32.totalorder %s1, 3 /* loop exit test */ }
"""


def test_a_loop_of_traced_trips_counts_once_and_says_so():
    schedule = tpu_llo.read_bundles(TRACED, "kernel.1")
    assert schedule.loops == ((3, 2), (1, 1))
    assert (schedule.cycles, schedule.traced_loop_cycles) == (1 + 3 * (2 + 1), 3)
    assert tpu_llo.read_bundles(BUNDLES).traced_loop_cycles == 0


def test_counts_what_the_schedule_issues_by_slot_spills_included():
    kernel = tpu_llo.DumpedKernel("kernel.1", tpu_llo.MosaicKernel("kernel", (3,), tpu_llo.UnitCounts()), tpu_llo.read_bundles(PIPELINED))
    # The body, 3 times: a spilled register reloaded, an MXU result popped, 4 trips of an add and an exp (the mask
    # operation beside them takes no counted slot), a multiply, a spill and a transpose. Every one of the 5 trips: a load.
    body = tpu_llo.Issued(vector_alu=5, loads=1, stores=1, spill_loads=1, spill_stores=1, xlu=1, eup=4, result_pops=1)
    assert kernel.issued == body * 3 + tpu_llo.Issued(loads=5)


def matmul_kernel(rows: int, depth: int, columns: int, dtype: str, repeats: int):
    """A Pallas kernel summing ``repeats`` products ``(rows x depth) @ (depth x columns)`` on a grid of 3 (a ``DumpingCompiler`` factory)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    precision = lax.Precision.HIGHEST if dtype == "float32" else lax.Precision.DEFAULT

    def kernel(x_ref, w_ref, o_ref):
        def one(_, total):
            return total + jnp.dot(x_ref[...], w_ref[...], precision=precision, preferred_element_type=jnp.float32)

        o_ref[...] = lax.fori_loop(0, repeats, one, jnp.zeros((rows, columns), jnp.float32))

    def call(x, w):
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((rows, columns), jnp.float32), grid=(3,),
            in_specs=[pl.BlockSpec((rows, depth), lambda i: (0, 0)), pl.BlockSpec((depth, columns), lambda i: (0, 0))],
            out_specs=pl.BlockSpec((rows, columns), lambda i: (0, 0)), name="matmuls",
        )(x, w)

    return call, jax.ShapeDtypeStruct((rows, depth), dtype), jax.ShapeDtypeStruct((depth, columns), dtype)


EDGES = {"v4": 128, "v5e": 128, "v5p": 128, "v6e": 256}  # MXU edges (Pallas' TPU hardware reference)
PASSES = {"bfloat16": 1, "float32": 6}  # a float32 product at HIGHEST is six bf16 passes


# A 128-wide and the 256-wide MXU by default; v4 and v5p (128 wide too) with -m slow.
@pytest.mark.parametrize("generation", [g if g in ("v5e", "v6e") else pytest.param(g, marks=pytest.mark.slow) for g in sorted(EDGES)])
def test_mxu_rows_of_a_compiled_kernel_match_its_products_on_every_generation(generation, monkeypatch):
    pytest.importorskip("libtpu", reason="compiling for TPU without one needs libtpu")
    from tops_core.tpu import compile_only

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the child imports this module's factory
    edge = EDGES[generation]
    with compile_only.DumpingCompiler() as compiler:
        for rows, depth, columns, dtype in ((64, 256, 256, "bfloat16"), (128, 128, 64, "float32")):
            dumped = compiler.compile(generation, "test_tpu_llo:matmul_kernel", rows=rows, depth=depth, columns=columns, dtype=dtype, repeats=5)
            (kernel,) = dumped.kernels
            assert kernel.mosaic.grid == (3,)
            # Every LHS row streams through one MXU per (depth, columns) tile of the weights, per pass.
            tiles = math.ceil(depth / edge) * math.ceil(columns / edge)
            assert kernel.mosaic.per_step.mxu_rows == 5 * rows * tiles * PASSES[dtype], (rows, depth, columns, dtype)
            assert kernel.schedule.cycles > kernel.schedule.bundles > 0
            # The grid loop: the 3 steps and the pipeline's two trips, which skip the body (5 products, one per trip of its own loop).
            assert kernel.schedule.loops[0][0] == 3 + tpu_llo.PIPELINE_TRIPS
            assert kernel.cycles == kernel.schedule.cycles - tpu_llo.PIPELINE_TRIPS * kernel.schedule.body_cycles
            assert kernel.schedule.body_cycles > 5
            # The schedule pops each result once, and may first sum several products in the MXU's result buffer
            # (float32's six passes on v6e: half as many pops as Mosaic's results).
            assert 0 < kernel.issued.result_pops <= kernel.mosaic.total.mxu_results


def looped_kernel(traced: bool):
    """A Pallas kernel with a loop of 5 trips, its trip count a constant or read from SMEM (traced) (a ``DumpingCompiler`` factory)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def kernel(trips_ref, x_ref, o_ref):
        def one(_, total):
            return jnp.tanh(total) + x_ref[...]

        o_ref[...] = lax.fori_loop(0, trips_ref[0] if traced else 5, one, jnp.zeros((8, 128), jnp.float32))

    def call(trips, x):
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), grid=(3,),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec((8, 128), lambda i: (0, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)), name="loops",
        )(trips, x)

    return call, jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((8, 128), jnp.float32)


def test_a_compiled_loop_of_traced_trips_is_told_apart_from_a_constant_one(monkeypatch):
    # libtpu's bundles give a constant loop its trip count in the exit test; a traced one compares with a register.
    pytest.importorskip("libtpu", reason="compiling for TPU without one needs libtpu")
    from tops_core.tpu import compile_only

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the child imports this module's factory
    with compile_only.DumpingCompiler() as compiler:
        (traced,) = compiler.compile("v6e", "test_tpu_llo:looped_kernel", traced=True).kernels
        (constant,) = compiler.compile("v6e", "test_tpu_llo:looped_kernel", traced=False).kernels
    assert 0 < traced.traced_loop_cycles < traced.cycles
    assert constant.traced_loop_cycles == 0
