"""What one chunk of the simple_gla backward does, and the operands and passes both backward kernels share.

With the notation of ``chunkwise`` (``b_i`` the cumulative log decay inside the chunk, ``b_C``
the chunk's, ``S`` the state entering it, ``D_ij = exp(b_i - b_j)`` for ``j <= i`` and 0 above)
and ``dS`` the gradient of the state *leaving* the chunk::

    dq_i  = scale * (sum_j D_ij (do_i . v_j) k_j + exp(b_i) do_i S^T)
    dk_j  = scale * sum_i D_ij (do_i . v_j) q_i + exp(b_C - b_j) v_j dS^T
    dv_j  = scale * sum_i D_ij (q_i . k_j) do_i + exp(b_C - b_j) k_j dS
    dS_in = exp(b_C) dS + scale * sum_i exp(b_i) q_i^T do_i

The gradient of token ``t``'s log decay sums the products its decay scales (docs/ops.md
"Precision of dg"): pairs ``j < t <= i`` inside the chunk, a query ``i >= t`` reading the state
``S``, a key ``j < t`` reaching ``dS``, and ``S`` carried across the whole chunk. Every term is a
product of decays ``<= 1``, so nothing large cancels (a suffix sum of ``q.dq - k.dk`` would). It
is computed as a row ``(1, C)`` by sums over sublanes, so no transpose is needed.

Every factor ``D``, ``exp(b_i)``, ``exp(b_C - b_j)``, ``exp(b_C)`` is one of the forward's
``ChunkGates``, computed by the same code (a constant decay's once per grid step); ``dg`` needs no
log-domain value beyond them.

A backward block always holds the *whole* padded ``V`` of a head (``grid.backward_geometry``): ``dq``
and ``dk`` sum over ``V``, and a value tile per grid point would have to reduce across grid points.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tops_core.ops.simple_gla import SimpleGLAGrads

from tops_plugins_tpu_pallas import blocks, grid
from tops_plugins_tpu_pallas.grid import Chunk, Work, start_sequence, step_chunks
from tops_plugins_tpu_pallas.mxu import COLUMNS_BY_COLUMNS, ROWS_BY_ROWS, SPLIT_BFLOAT16, SPLIT_BFLOAT16_STACKED, matmul, mxu_operand_dtype
from tops_plugins_tpu_pallas.simple_gla.chunkwise import (
    ChunkGates, advance_state, advance_state_work, constant_gates, gate_computations, gates_work, step_gates,
)
from tops_plugins_tpu_pallas.simple_gla.fused import gates_along_lanes, gates_as_rows, wide_mxu
from tops_plugins_tpu_pallas.plan import Blocked, LaunchPlan
from tops_plugins_tpu_pallas.layout import Geometry, caller_output, caller_state, heads_flattened, kernel_operands, padded_state

_F32 = jnp.float32


# -- operands -------------------------------------------------------------------------------------


def decay_gradients(geometry: Geometry) -> Blocked:
    """Per-token gradient of the log decay, float32 ``[B, H, steps, chunks per step, C]``: one row per chunk."""
    return blocks.token_rows("da", geometry)


def token_inputs(geometry: Geometry, dtype, gate_dtype, names: tuple[str, ...], gate_rows: bool = False) -> tuple[Blocked, ...]:
    """The blocked token arrays ``names`` (of q, k, v, do) and ``g`` when given, in that order; ``gate_rows``: ``g``
    laid out ``[B, H, T]`` (``with_gate_rows``)."""
    layouts = {"q": blocks.key_rows, "k": blocks.key_rows, "v": blocks.value_rows, "do": blocks.value_rows}
    inputs = tuple(layouts[name](name, geometry, dtype) for name in names)
    if gate_dtype is None:
        return inputs
    return (*inputs, (blocks.gate_rows if gate_rows else blocks.gates)(geometry, gate_dtype))


def plan_inputs(q, g, g_gamma, initial_state, dht) -> dict:
    """The keyword arguments of both backward kernels' ``plans`` for one call: which inputs are given, and their dtypes."""
    return dict(
        gate_dtype=None if g is None else g.dtype,
        initial_state_dtype=None if initial_state is None else initial_state.dtype,
        output_final_state=dht is not None,
        decayed=g is not None or g_gamma is not None,
    )


def operands(q, k, v, do, g, g_gamma, initial_state, dht, geometry: Geometry) -> dict[str, jax.Array]:
    """The arrays both backward kernels read, by operand name (absent inputs left out)."""
    arrays = kernel_operands(q, k, v, g, g_gamma, initial_state, geometry)
    arrays["do"] = heads_flattened(do, geometry.padded_value_dim)
    if dht is not None:
        arrays["dht"] = padded_state(dht.astype(_F32), geometry)
    return arrays


def caller_gradients(results: dict[str, jax.Array], q, k, v, g, g_gamma, initial_state, geometry: Geometry) -> SimpleGLAGrads:
    """The kernels' outputs in the caller's shapes and dtypes; ``dg_gamma`` sums the float32 per-token gradient."""
    keys = dataclasses.replace(geometry, value_dim=geometry.key_dim)  # dq, dk: the layout of o, K wide
    dg = dg_gamma = dinitial_state = None
    if "da" in results:
        B, T, H = geometry.batch, geometry.seq_len, geometry.heads
        da = results["da"].reshape(B, H, -1)[:, :, :T]
        if g is not None:
            dg = jnp.swapaxes(da, 1, 2).astype(g.dtype)
        if g_gamma is not None:
            dg_gamma = jnp.sum(da, axis=(0, 2)) if g_gamma.ndim == 1 else jnp.sum(da)
            dg_gamma = dg_gamma.astype(g_gamma.dtype)
    if initial_state is not None:
        dinitial_state = caller_state(results["dinitial_state"], geometry).astype(initial_state.dtype)
    return SimpleGLAGrads(
        dq=caller_output(results["dq"], keys), dk=caller_output(results["dk"], keys), dv=caller_output(results["dv"], geometry),
        dg=dg, dg_gamma=dg_gamma, dinitial_state=dinitial_state,
    )


# -- the forward states the backward needs --------------------------------------------------------


def with_gate_rows(arrays: dict[str, jax.Array], g: jax.Array | None, geometry: Geometry) -> dict[str, jax.Array]:
    """``arrays`` (``operands``) with ``g`` transposed to ``[B, H, T]`` where the backward's kernels (the checkpoints walk,
    the fused backward's gradients) take their gates along lanes, as the fused forward does (``fused.gates_as_rows``).
    Modelled, B=2 T=4096 H=8 K=V=128 bf16 with ``g``, from ``(C, 1)`` columns to rows: the walk (no ``C x C`` decays)
    v5e 102.7 -> 60.9 us, v6e 64.9 -> 50.1 us."""
    return {**arrays, **gates_as_rows(g, geometry.chunk_size)}


def checkpoints_plan(
    geometry: Geometry, dtype, *, gate_dtype, initial_state_dtype, every_chunk: bool, cut_at_starts: bool = False,
) -> LaunchPlan:
    """A forward walk writing the state entering every chunk (``every_chunk``), or else the state leaving every time
    step but the last (``grid.segment_ends``; ``geometry`` then has more than one), walking those steps alone: the last
    step's keys and values reach no state a backward reads. ``cut_at_starts``: a packed call without ``g``, whose gates
    the walk cuts at each chunk's first and last sequence start (``blocks.sequence_cuts``)."""
    start = (blocks.state("initial_state", geometry, initial_state_dtype),) if initial_state_dtype is not None else ()
    gated = gate_dtype is not None
    inputs = token_inputs(geometry, dtype, gate_dtype, ("k", "v"), gates_along_lanes(gated, geometry.chunk_size))
    scalars = (blocks.decay(geometry), *(blocks.sequence_cuts(geometry)[0] if cut_at_starts else ()))
    walked = geometry if every_chunk else grid.segments_but_the_last(geometry)
    work = advance_state_work(walked) * (walked.batch * walked.heads * walked.num_chunks)
    work = work + gates_work(walked, gated, attention=False) * gate_computations(walked, gated)
    checkpoints = grid.state_checkpoints(geometry) if every_chunk else grid.segment_ends(geometry)
    plan = grid.grid_plan(
        "simple_gla_backward_checkpoints", geometry, scalars, (*inputs, *start), (checkpoints,), work,
        4 * 3 * geometry.padded_key_dim * geometry.padded_value_dim,
    )
    return dataclasses.replace(plan, grid=blocks.grid(walked))


def checkpoints_kernel(*refs, plan: LaunchPlan, geometry: Geometry, every_chunk: bool):
    refs = plan.bind(refs)
    head, step = pl.program_id(1), pl.program_id(3)
    start_sequence(refs, step)

    constant = constant_gates(refs, head, geometry, attention=False)
    state = refs["state"][...]
    chunks = step_chunks(geometry, step)
    # Every chunk's gates before the state's chain through them: chunk by chunk, each chunk's gates waited on the chain.
    along_lanes = gates_along_lanes("g" in refs, geometry.chunk_size)
    every_gates = step_gates(chunks, refs, head, constant, attention=False, along_lanes=along_lanes, step=step)
    for chunk, gates in zip(chunks, every_gates):
        if every_chunk:
            refs["checkpoints"][chunk.index] = state
        k = chunk.read(refs["k"])
        # Along lanes the keys are transposed, as the fused forward's are: their decays are a row (ChunkGates.along_lanes).
        keys = k.T if along_lanes else k
        state = advance_state(state, keys, chunk.read(refs["v"]), gates, decay_gradient_operands(k.dtype), keys_transposed=along_lanes)
    refs["state"][...] = state
    if not every_chunk:
        refs["segment_ends"][...] = state


# -- one chunk --------------------------------------------------------------------------------------


def decay_gradient_operands(input_dtype):
    """``matmul``'s operands for the products ``dg`` is built from: states, ``dS``, decayed queries and keys, the pairs' sums.

    ``dg_gamma`` sums every token's ``dg``, terms that nearly cancel under a weak decay, so one bf16
    rounding of a float32 operand (8 bits) costs it 0.2 relative on README.md's weak-decay case.
    bf16 inputs are exact in bf16, so splitting the float32 operand alone into two bf16 parts
    (``SPLIT_BFLOAT16``) keeps about 16 bits in two native passes. float32 inputs: ``mxu_operand_dtype``.
    """
    return SPLIT_BFLOAT16 if jnp.dtype(input_dtype) == jnp.bfloat16 else mxu_operand_dtype(input_dtype)


@dataclasses.dataclass(frozen=True)
class StatePasses:
    """How a gradients kernel's products with a float32 operand take the MXU (``matmul``'s operands): ``chain``
    recomputing the states and stepping ``dS``, ``reads`` the rows' reads of the entering state (``do S^T``), ``writes``
    their way to the leaving one (``v dS^T``), ``pair_sums`` the pairs' sums of every token's decay gradient."""

    chain: object
    reads: object
    writes: object
    pair_sums: object


def state_passes(input_dtype, chip: str | None, per_token: bool, constant_decay: bool = False) -> StatePasses:
    """``StatePasses`` for bf16 inputs on a 256-deep MXU (v6e), where one pass takes both halves of a split float32 operand
    stacked along the contraction (``SPLIT_BFLOAT16_STACKED``), and where only ``dg_gamma`` is wanted (not ``per_token``)
    ``do S^T`` takes one bf16 pass; else ``decay_gradient_operands`` for all. ``pair_sums``: one bf16 pass on v6e where
    every token's decay gradient is wanted and none is summed (no ``constant_decay``, ``g_gamma``, whose gradient sums
    them): there the MXU binds the kernel with ``g``, and the pairs' sums in two passes are one of its 12 rows per token.
    Each token's ``dg`` is then rounded once in bf16, which a sum over tokens that nearly cancels would magnify (the next
    paragraph) but one token's does not: on the kit's bf16 ``g`` case ``dg`` misses the float64 reference by 5.2e-4 (2.7e-6
    in two passes; tolerance 1e-2), under the weak decay by 3.2e-4, across gates of ``-inf`` by 8.3e-4, under strong
    decays by 7.1e-4. Modelled with ``g`` on v6e (products first, scale in the decays): 194256 -> 189650 cycles, MXU rows
    per token 12 -> 11.

    Modelled, the fused backward's gradients kernel on v6e (B=2 T=4096 H=8 K=V=128 bf16; cycles, MXU rows per token):
    with ``g_gamma``, states and ``dS`` stacked, reads and writes split: 183326, 11.97; reads in one pass, writes stacked:
    **152270, 9.97** (reads one pass alone 200654: Mosaic's schedule moves by tens of percent with the products' forms,
    so each form here is the measured best, not a rule). With ``g``: 253538 -> **245393** with all three stacked (reads
    in one pass: 260177). On v5e (128 deep) no form measured beat two passes: reads in one pass, with ``dv`` last
    (``value_gradient_last``), ``g`` 300326 -> 308532, ``g_gamma`` 271184 -> 275776. ``do S^T`` in one pass costs
    ``dg_gamma`` on the kit's weak bf16 decay 9.8e-6 -> 1.0e-3 against the float64 reference (tolerance 1e-2); ``v dS^T``
    in one pass would miss it (1.4e-2), as ``decay_gradient_operands`` says."""
    split = decay_gradient_operands(input_dtype)
    if split != SPLIT_BFLOAT16 or not wide_mxu(chip):
        return StatePasses(split, split, split, split)
    return StatePasses(
        SPLIT_BFLOAT16_STACKED, SPLIT_BFLOAT16_STACKED if per_token else jnp.bfloat16, SPLIT_BFLOAT16_STACKED,
        jnp.bfloat16 if per_token and not constant_decay else split,
    )


def attention(decays, q, k) -> jax.Array:
    """The forward's masked, decayed ``(C, C)`` scores ``D_ij (q_i . k_j)`` (float32); ``decays`` is ``D``, or ``scale * D``
    for scaled scores (``ChunkForm.scale_in_decays``)."""
    return query_by_key(q, k) * decays


def query_by_key(q, k) -> jax.Array:
    """``(C, C)``: ``q_i . k_j`` (float32), undecayed."""
    return matmul(q, k, mxu_operand_dtype(q.dtype), ROWS_BY_ROWS)


def value_gradient(gates: ChunkGates, attention, k, do, dstate, scale: float | None) -> jax.Array:
    """``dv`` of the chunk's rows, float32 ``(C, V_pad)``; ``dstate`` is the gradient of the state leaving it, ``scale``
    None where ``attention`` is scaled already."""
    return attention_value_gradient(attention, do, scale) + state_value_gradient(gates, k, dstate)


def attention_value_gradient(attention, do, scale: float | None) -> jax.Array:
    """The intra-chunk part of ``dv``: ``scale * sum_i D_ij (q_i . k_j) do_i`` (``scale`` None: in ``attention``)."""
    product = matmul(attention, do, mxu_operand_dtype(do.dtype), COLUMNS_BY_COLUMNS)
    return product if scale is None else scale * product


def state_value_gradient(gates: ChunkGates, k, dstate) -> jax.Array:
    """The state's part of ``dv``: ``exp(b_C - b_j) k_j dS`` (``gates.key`` is 0 on rows it does not decay into ``dstate``)."""
    return gates.key * matmul(k, dstate, mxu_operand_dtype(k.dtype))


def state_reads(gates: ChunkGates, do, entering, operands=None) -> jax.Array:
    """``(C, K)``: ``exp(b_i) do_i S^T``, what the rows' reading of the entering state adds to ``dq`` (before ``scale``);
    ``operands`` None: ``decay_gradient_operands``."""
    operands = decay_gradient_operands(do.dtype) if operands is None else operands
    return gates.query * matmul(do, entering, operands, ROWS_BY_ROWS)


def state_writes(gates: ChunkGates, v, dstate, operands=None) -> jax.Array:
    """``(C, K)``: ``exp(b_C - b_j) v_j dS^T``, what the rows' writing into the leaving state adds to ``dk``; ``operands``
    as ``state_reads``'."""
    operands = decay_gradient_operands(v.dtype) if operands is None else operands
    return gates.key * matmul(v, dstate, operands, ROWS_BY_ROWS)


def query_key_gradients(
    gates: ChunkGates, attention, q, k, v, do, entering, dstate, scale: float, with_decay: bool, summed_over=None,
    passes: StatePasses | None = None, products: InputProducts | None = None, decays=None, scaled: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``dq``, ``dk`` (float32 ``(C, K_pad)``) and, ``with_decay``, the decay gradient row ``(1, C)`` of the chunk:
    every token's, or with ``summed_over`` (``summed_tokens``) a row whose sum is theirs (``summed_decay_gradient``).

    ``entering`` is the forward state entering the chunk, ``dstate`` the gradient of the one leaving it; ``passes``
    (``state_passes``) None: ``decay_gradient_operands`` for every product with a float32 operand; ``products``: the
    chunk's ``input_products`` where they were traced already, else None; ``decays``: the chunk's decays as ``attention``
    took them (None: ``gates.decays``), ``scale * D`` where ``scaled`` (``ChunkForm.scale_in_decays``).
    """
    if products is None:
        # do v^T is traced before the state's terms: the other way round, the same instructions issued
        # 10% more cycles on v5e (the scheduler keeps much of the order of the MXU pushes as traced).
        scores = output_by_value(do, v)
        reads = state_reads(gates, do, entering, passes and passes.reads)
        writes = state_writes(gates, v, dstate, passes and passes.writes)
    else:
        scores, reads, writes = products.output_by_value, products.reads, products.writes
    # The carried state's term is traced last, where the row takes it: traced first, the fused gradients kernel on v6e
    # with g issued 187746 -> 196645 cycles.
    across = (lambda: gates.chunk * jnp.sum(entering * dstate)) if with_decay else None
    pair_sums = passes.pair_sums if passes is not None else None
    return query_key_gradients_of(
        gates.decays if decays is None else decays, attention, scores, q, k, reads, writes, across, scale, summed_over,
        pair_sums, scaled,
    )


def per_token_decay_gradient(gated: bool, chip: str | None, split: bool = False) -> bool:
    """Whether a backward kernel computes every token's decay gradient: where the caller gave ``g`` (``gated``), and on
    a 128-wide MXU in the kernels that compute every gradient of a chunk (fused's, and varlen's with states; not the
    ``split`` backward's query/key kernel), where the pair sums' ``C x C x C`` product issued fewer cycles than
    ``summed_decay_gradient``'s weighted sums. Else only the row's sum, all ``dg_gamma`` needs. Modelled (B=2 T=4096
    H=8 K=V=128 bf16 ``g_gamma``; packed: 16 sequences in T=8192), per-token -> summed: on v6e the backward's kernels
    against their floor fused 2.20x -> 1.88x, split 3.51x -> 3.24x, packed without states 2.43x -> 2.31x; on v5e, with
    ``value_gradient_last``, cycles of the kernel that computes the decay gradient: fused 271184 -> 292300, packed
    without states 303812 -> 322481, packed with states 763794 -> 779794, split's query/key kernel 236659 -> 174575."""
    return gated or (not split and not wide_mxu(chip))


def summed_tokens(chunk: Chunk, per_token: bool):
    """``query_key_gradients``' ``summed_over`` for ``chunk``: None where every token's decay gradient is wanted
    (``per_token_decay_gradient``), else the chunk's real tokens."""
    if per_token:
        return None
    return chunk.rows.size if chunk.valid_rows is None else chunk.valid_rows


@dataclasses.dataclass(frozen=True)
class ChunkForm:
    """How a gradients kernel computes every gradient of a chunk (``chunk_gradients``: fused's, varlen's) on the chip it
    is lowered for, each choice measured there: ``per_token`` (``per_token_decay_gradient``), ``passes``
    (``state_passes``), ``values_last`` (``value_gradient_last``), ``products_first`` (``input_products_first``), and
    ``scale_in_decays``: ``scale`` taken once into the chunk's decays, which every product of its scores is scaled by
    (the scores, their gradient, ``dv``'s and the pairs' sums), rather than into each of those; on v6e (products first,
    with ``g``: 201314 -> 194256 cycles), not on the 128-wide chips (v5e ``g`` 300326 -> 318199, v5p 151082 -> 160138)."""

    per_token: bool
    passes: StatePasses
    values_last: bool
    products_first: bool
    scale_in_decays: bool


def chunk_form(input_dtype, chip: str | None, gated: bool, constant_decay: bool) -> ChunkForm:
    """``ChunkForm`` for inputs of ``input_dtype`` on ``chip``; ``gated``: the caller gave ``g``, ``constant_decay``: and
    ``g_gamma``."""
    per_token = per_token_decay_gradient(gated, chip)
    return ChunkForm(
        per_token=per_token, passes=state_passes(input_dtype, chip, per_token, constant_decay),
        values_last=value_gradient_last(chip), products_first=input_products_first(chip), scale_in_decays=wide_mxu(chip),
    )


@dataclasses.dataclass(frozen=True)
class InputProducts:
    """A chunk's products of its inputs and of the states around it (``input_products``): the first products its
    gradients take, which wait on none of its other work."""

    query_by_key: jax.Array
    output_by_value: jax.Array
    reads: jax.Array
    writes: jax.Array


def input_products(gates: ChunkGates, q, k, v, do, entering, dstate, passes: StatePasses) -> InputProducts:
    """``InputProducts`` of one chunk: ``q k^T``, ``do v^T``, ``state_reads`` and ``state_writes``, the state's first.
    Traced with ``q k^T`` first, the fused gradients kernel on v6e with ``g`` issued 187746 -> 189650 cycles (the state's
    products between the others: 190002 to 192210)."""
    reads, writes = state_reads(gates, do, entering, passes.reads), state_writes(gates, v, dstate, passes.writes)
    return InputProducts(query_by_key(q, k), output_by_value(do, v), reads, writes)


def input_products_first(chip: str | None) -> bool:
    """Whether ``reversed_gradients`` traces every chunk's ``input_products`` before any chunk's other work: on a 256-wide
    MXU (v6e), where Mosaic's schedule then overlaps one chunk's products with another's work. Modelled (B=2 T=4096 H=8
    K=V=128 bf16; packed: 16 sequences in T=8192), cycles of the gradients kernel on v6e, chunk by chunk -> products
    first: ``g`` 245393 -> **201314**, ``g_gamma`` 152270 -> **147470**, packed without states 161547 -> **158969**,
    with both 677165 -> **659764**. On v5e ``g`` was worse (300326 -> 318006); on v6e a pipeline of a few chunks'
    products ahead (2 to 8 chunks, or three stages) was no better than all of them, and chaotic: from 203105 to 249999
    cycles with ``g``."""
    return wide_mxu(chip)


def chunk_gradients(
    gates: ChunkGates, chunk: Chunk, q, k, v, do, entering, dstate, scale: float, with_decay: bool, form: ChunkForm,
    products: InputProducts | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """``dq``, ``dk``, ``dv`` (float32) and the decay gradient row of one chunk (``query_key_gradients``; ``gates`` with
    their decays), in ``form``; ``products``: its ``input_products`` where they were traced already, else None."""
    decays = scale * gates.decays if form.scale_in_decays else gates.decays
    scores = attention(decays, q, k) if products is None else products.query_by_key * decays
    summed_over = summed_tokens(chunk, form.per_token)
    values_scale = None if form.scale_in_decays else scale
    if not form.values_last:
        dv = value_gradient(gates, scores, k, do, dstate, values_scale)
    dq, dk, da = query_key_gradients(
        gates, scores, q, k, v, do, entering, dstate, scale, with_decay, summed_over, form.passes, products, decays,
        form.scale_in_decays,
    )
    if form.values_last:
        dv = value_gradient(gates, scores, k, do, dstate, values_scale)
    return dq, dk, dv, da


def reversed_gradients(chunks: list[Chunk], every_gates: list[ChunkGates], refs: dict, entering, leaving: list, scale: float,
                       with_decay: bool, form: ChunkForm):
    """``chunk_gradients`` of a grid step's ``chunks`` from the last to the first, as ``(chunk, (dq, dk, dv, da))``: the
    gradients kernels' last pass. ``entering(chunk)``: the forward state entering the chunk; ``leaving``: the gradient of
    the state leaving each. Where ``form.products_first``, every chunk's ``input_products`` are traced first."""
    def inputs(chunk):
        return [chunk.read(refs[name]) for name in ("q", "k", "v", "do")]

    backwards = list(reversed(chunks))
    products = {
        chunk.index: input_products(every_gates[chunk.index], *inputs(chunk), entering(chunk), leaving[chunk.index], form.passes)
        for chunk in backwards
    } if form.products_first else {}
    for chunk in backwards:
        gates = every_gates[chunk.index].with_decays()
        yield chunk, chunk_gradients(
            gates, chunk, *inputs(chunk), entering(chunk), leaving[chunk.index], scale, with_decay, form, products.get(chunk.index),
        )


def value_gradient_last(chip: str | None) -> bool:
    """Whether ``chunk_gradients`` traces ``dv`` after ``dq`` and ``dk``: on a 128-wide MXU (every chip but v6e), where
    Mosaic's schedule then issues fewer cycles. Modelled (B=2 T=4096 H=8 K=V=128 bf16; packed: 16 sequences in
    T=8192), cycles of the gradients kernel, ``dv`` first -> last: v5e ``g`` 336647 -> 300326, ``g_gamma`` 278556 ->
    271184, packed without states 339345 -> 303812, packed with both states 786416 -> 763794; v5p ``g`` 169074 ->
    151082; v4 ``g`` 541377 -> 467358. On v6e every one is worse (``g`` 245393 -> 295713, ``g_gamma`` 152270 ->
    216942)."""
    return not wide_mxu(chip)


def output_by_value(do, v) -> jax.Array:
    """``(C, C)``: ``do_i . v_j`` (float32), which ``dq``, ``dk`` and the decay gradient share."""
    return matmul(do, v, mxu_operand_dtype(do.dtype), ROWS_BY_ROWS)


def query_key_gradients_of(
    decays, attention, output_by_value, q, k, reads, writes, across, scale: float, summed_over=None, pair_sums=None,
    scaled: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``dq``, ``dk`` and the decay gradient row (None when ``across`` is) from the state's terms of every row.

    ``decays`` and ``attention`` are ``scale`` times ``D`` and the scores where ``scaled``; ``output_by_value`` is
    ``output_by_value(do, v)``; ``reads`` and ``writes`` are ``state_reads`` and ``state_writes`` of the chunk's entering
    and leaving state; ``across`` a function giving the decay of the state carried across the whole chunk, times
    ``sum(S * dS)`` (``(1, 1)``); ``summed_over`` as ``query_key_gradients``'; ``pair_sums``: the operands of the pairs' sums
    (``StatePasses.pair_sums``; None: ``decay_gradient_operands``).
    """
    operands = mxu_operand_dtype(q.dtype)
    C = q.shape[0]
    dattention = output_by_value * decays
    if scaled:
        dq = matmul(dattention, k, operands) + scale * reads
        dk = matmul(dattention, q, operands, COLUMNS_BY_COLUMNS) + writes
    else:
        dq = scale * (matmul(dattention, k, operands) + reads)
        dk = scale * matmul(dattention, q, operands, COLUMNS_BY_COLUMNS) + writes
    if across is None:
        return dq, dk, None

    rows = lax.broadcasted_iota(jnp.int32, (C, C), 0)  # i (or j) along sublanes
    tokens = lax.broadcasted_iota(jnp.int32, (C, C), 1)  # t along lanes
    pairs = attention * output_by_value if scaled else scale * attention * output_by_value  # (i, j)
    if summed_over is not None:
        return dq, dk, summed_decay_gradient(pairs, q, k, reads, writes, across(), scale, summed_over)
    # (i, t): sum over j < t of pairs; then over i >= t. The 0/1 matrix is exact in bf16.
    pair_sums = decay_gradient_operands(q.dtype) if pair_sums is None else pair_sums
    keys_before = matmul(pairs, (rows < tokens).astype(jnp.bfloat16), pair_sums)
    query_reads_state, key_reaches_end = state_products(q, k, reads, writes, scale)
    # Row r gives token t, where r >= t, its pairs with earlier keys and its query's read of the entering state, and
    # where r < t its key's way to the leaving state: one select and one sum over sublanes for the three.
    terms = jnp.where(rows >= tokens, keys_before + query_reads_state, key_reaches_end)
    return dq, dk, jnp.sum(terms, axis=0, keepdims=True) + across()


def summed_decay_gradient(pairs, q, k, reads, writes, across, scale: float, tokens) -> jax.Array:
    """A ``(1, C)`` row whose sum is that of ``query_key_gradients_of``'s row over the chunk's ``tokens`` real tokens:
    each product weighted by how many tokens' decays scale it, a pair ``(i, j)`` by ``i - j``, a query ``i`` reading the
    entering state by ``i + 1``, a key ``j`` reaching the leaving one by ``tokens - 1 - j``, the state carried across by
    ``tokens``. No cumulative sums: ``dg_gamma`` needs only the total, and the per-token row's pair sums are a
    ``C x C x C`` product in two split-bf16 passes (``per_token_decay_gradient`` says where this is cheaper)."""
    C = pairs.shape[0]
    rows, lanes = lax.broadcasted_iota(jnp.int32, (C, C), 0), lax.broadcasted_iota(jnp.int32, (C, C), 1)
    index = lax.broadcasted_iota(jnp.int32, (C, 1), 0).astype(_F32)
    # Weighted rows summed over sublanes (no lane sum per row): a (1, K_pad) row, summed to one value.
    weighted = (index + 1) * (scale * q.astype(_F32) * reads) + (tokens - 1 - index) * (k.astype(_F32) * writes)
    states = jnp.sum(jnp.sum(weighted, axis=0, keepdims=True), axis=1, keepdims=True) + tokens * across
    within = jnp.sum(pairs * (rows - lanes).astype(_F32), axis=0, keepdims=True)
    return within + jnp.where(lanes[:1] == 0, states, 0.0)


def state_decay_gradients(q, k, reads, writes, scale: float, later, earlier) -> tuple[jax.Array, jax.Array]:
    """The decay gradient rows ``(1, C)`` of a state's reads and of its writes: token ``t``'s decay scales query ``i``'s
    read of the state entering where ``later[i, t]`` (``i >= t``), and key ``j``'s way to the state leaving where
    ``earlier[j, t]`` (``j < t``); ``reads`` and ``writes`` are ``state_reads`` and ``state_writes``."""
    query_reads_state, key_reaches_end = state_products(q, k, reads, writes, scale)
    later_queries = jnp.sum(jnp.where(later, query_reads_state, 0.0), axis=0, keepdims=True)
    earlier_keys = jnp.sum(jnp.where(earlier, key_reaches_end, 0.0), axis=0, keepdims=True)
    return later_queries, earlier_keys


def state_products(q, k, reads, writes, scale: float) -> tuple[jax.Array, jax.Array]:
    """``(C, 1)`` each: what query ``i``'s read of the entering state and key ``j``'s way to the leaving state add to the
    decay gradient of every token whose decay scales them (``reads`` and ``writes``: ``state_reads``, ``state_writes``)."""
    return scale * jnp.sum(q.astype(_F32) * reads, axis=1, keepdims=True), jnp.sum(k.astype(_F32) * writes, axis=1, keepdims=True)


def state_gradient_entering(gates: ChunkGates, q, do, dstate, scale: float, operands=None) -> jax.Array:
    """The gradient of the state entering the chunk, from the one leaving it; ``operands`` None: ``decay_gradient_operands``."""
    return gates.chunk * dstate + state_gradient_of_reads(gates, q, do, scale, operands)


def state_gradient_of_reads(gates: ChunkGates, q, do, scale: float, operands=None) -> jax.Array:
    """What the chunk's rows' reads of the entering state add to its gradient, ``scale * sum_i exp(b_i) q_i^T do_i``: the
    part of ``state_gradient_entering`` that does not wait on the ``dS`` chain."""
    decayed_queries = q.astype(_F32) * gates.query
    operands = decay_gradient_operands(q.dtype) if operands is None else operands
    return scale * matmul(decayed_queries, do, operands, COLUMNS_BY_COLUMNS)


# -- work, counted op by op from the functions above -----------------------------------------------


def _sizes(geometry: Geometry) -> tuple[int, int, int]:
    return geometry.chunk_size, geometry.padded_key_dim, geometry.padded_value_dim


def gating_work(geometry: Geometry, gated: bool) -> Work:
    """Every ``ChunkGates`` one walk over the grid computes (``chunkwise.gate_computations``)."""
    return gates_work(geometry, gated) * gate_computations(geometry, gated)


def attention_work(geometry: Geometry) -> Work:
    C, K, _ = _sizes(geometry)
    return Work(flops=2 * C * C * K)


def value_gradient_work(geometry: Geometry) -> Work:
    C, K, V = _sizes(geometry)
    return Work(flops=2 * C * C * V + 2 * C * K * V)


def query_key_gradients_work(geometry: Geometry, with_decay: bool) -> Work:
    """do v^T, from the state, to the state, dq's and dk's intra-chunk products; with the decay, the pair sums."""
    C, K, V = _sizes(geometry)
    work = Work(flops=2 * C * C * V + 4 * C * K * V + 4 * C * C * K)
    return work + Work(flops=2 * C * C * C) if with_decay else work


def state_gradient_work(geometry: Geometry) -> Work:
    C, K, V = _sizes(geometry)
    return Work(flops=2 * C * K * V)


def body_vmem(geometry: Geometry) -> int:
    """Float32 values one chunk of the backward holds at once (upper estimate).

    q, k, v, do, dq, dk, dv as float32 ``(C, K_pad or V_pad)``; six ``C x C`` matrices; the
    entering state, its gradient and a new one ``(K_pad, V_pad)``.
    """
    C, K, V = _sizes(geometry)
    return 4 * (4 * C * K + 3 * C * V + 6 * C * C + 3 * K * V)
