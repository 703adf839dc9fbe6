"""Reading a compiled TPU program: kernels, their cost estimates, relayouts in whole tiles, loops, who ran."""

from tops_core.tpu.compile_only import ProgramFacts

# An optimised TPU module in the shape XLA prints it (trimmed): a kernel between relayouts of its
# operands, a lane-padding fusion, a memory-space prefetch, and a loop.
HLO = """HloModule jit_f, is_scheduled=true

%fused_pad (param_0: bf16[8,64,16,100]) -> bf16[8,64,16,128] {
  %param_0 = bf16[8,64,16,100]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %constant = bf16[] constant(0)
  ROOT %pad = bf16[8,64,16,128]{3,2,1,0:T(8,128)(2,1)} pad(%param_0, %constant), padding=0_0x0_0x0_0x0_28
}

%fused_scale (param_0.1: f32[8,64,16]) -> f32[8,64,16] {
  %param_0.1 = f32[8,64,16]{2,1,0:T(8,128)} parameter(0)
  ROOT %multiply = f32[8,64,16]{2,1,0:T(8,128)} multiply(%param_0.1, %param_0.1)
}

%body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p = (s32[], f32[16]{0:T(128)}) parameter(0)
  %copy.9 = f32[16]{0:T(128)} copy(%p)
  ROOT %t = (s32[], f32[16]{0:T(128)}) tuple(%p, %copy.9)
}

ENTRY %main (q: bf16[8,64,16,100], g: f32[8,64,16]) -> bf16[8,64,2048] {
  %q = bf16[8,64,16,100]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %g = f32[8,64,16]{1,2,0:T(8,128)} parameter(1)
  %copy.1 = f32[8,64,16]{2,1,0:T(8,128)} copy(%g)
  %fusion.1 = bf16[8,64,16,128]{3,2,1,0:T(8,128)(2,1)} fusion(%q), kind=kLoop, calls=%fused_pad
  %fusion.2 = f32[8,64,16]{2,1,0:T(8,128)} fusion(%copy.1), kind=kLoop, calls=%fused_scale
  %reshape.3 = bf16[8,64,2048]{2,1,0:T(8,128)(2,1)} reshape(%fusion.1), metadata={op_name="jit(f)/tpu_pallas.fused.forward/reshape"}
  %copy-start = (f32[8,64,16]{2,1,0:T(8,128)S(1)}, f32[8,64,16]{2,1,0:T(8,128)}, u32[]) copy-start(%fusion.2)
  %copy-done = f32[8,64,16]{2,1,0:T(8,128)S(1)} copy-done(%copy-start)
  %while = (s32[], f32[16]{0:T(128)}) while(%init), condition=%cond, body=%body
  ROOT %kernel = bf16[8,64,2048]{2,1,0:T(8,128)(2,1)} custom-call(%reshape.3, %copy-done), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"cost_estimate":{"flops":"1000","transcendentals":"10","bytes_accessed":"4096"}}}, metadata={op_name="jit(f)/jit(_differentiable)/tpu_pallas.fused.forward/pallas_call"}
}
"""


def test_reads_kernels_relayouts_in_whole_tiles_loops_and_implementations():
    facts = ProgramFacts.read(HLO, {"flops": 1200.0, "bytes accessed": 9000.0})
    assert facts.kernels == 1
    assert (facts.kernel_cost.flops, facts.kernel_cost.transcendentals, facts.kernel_cost.bytes_accessed) == (1000, 10, 4096)
    # The entry's copy of g, the padding fusion and the reshape; not the multiply fusion, the
    # prefetch into VMEM, nor the copy inside the loop's body.
    assert facts.relayouts == ("copy f32[8,64,16]", "fusion bf16[8,64,16,128]", "reshape bf16[8,64,2048]")
    g_copy = 8 * 64 * 128 * 4  # 16 values in a minor dimension take a 128-lane tile
    padded, flat = 8 * 64 * 16 * 128 * 2, 8 * 64 * 2048 * 2
    assert facts.relayout_bytes == 2 * (g_copy + padded + flat)
    assert facts.hbm_bytes == 4096 + facts.relayout_bytes
    assert facts.loops == 1
    assert facts.implementations == {"tpu_pallas.fused.forward"}
    assert (facts.flops, facts.bytes_accessed, facts.transcendentals) == (1200.0, 9000.0, 0.0)
