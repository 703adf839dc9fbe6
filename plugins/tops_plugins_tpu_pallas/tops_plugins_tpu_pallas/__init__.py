"""Pallas TPU kernels for the tops ops: ``tpu_pallas.fused``, ``tpu_pallas.chunk`` and, for packed
sequences (``cu_seqlens``), ``tpu_pallas.varlen`` (simple_gla); ``tpu_pallas.fused`` and, packed,
``tpu_pallas.varlen`` for kda (``kda/``) and, on kda's machinery with their own chunk math, for gla (``gla/``) and
gated_delta_rule (``gated_delta_rule/``); ``tpu_pallas.recurrent`` for every op, decode steps on a state pool in place.

Each simple_gla kernel has its own backward (``backward_fused``, ``backward_split``, ``backward_varlen``), and so have
the other ops' fused and packed kernels (``kda.backward``, one for both). All run natively on TPU and, with interpret
mode on, in Pallas' TPU interpreter anywhere else.
"""


import dataclasses
import functools

import jax
import tops_core
from tops_core.tpu.generations import GENERATIONS

from tops_plugins_tpu_pallas import gated_delta_rule, gla, grid, kda, launch, recurrent, simple_gla
from tops_plugins_tpu_pallas.simple_gla import backward_fused, backward_split, backward_varlen, chunk, fused, varlen

TOPS_CORE_API_VERSION = 1

ASSUMED_TENSORCORES = 2
"""TensorCores a call can spread over when no TPU is attached to ask (v4, v5p, v7x have 2 per chip)."""


def _tensorcores(chip: str | None) -> tuple[int, str]:
    if chip is not None:
        cores = GENERATIONS[chip].tensorcores
        return cores, f"{cores} TensorCore(s) per {chip} chip"
    if jax.default_backend() == "tpu":
        cores = getattr(jax.devices()[0], "num_cores", 1)
        return cores, f"{cores} TensorCore(s) per device on this TPU"
    return ASSUMED_TENSORCORES, f"{ASSUMED_TENSORCORES} TensorCores assumed (no TPU attached)"


def _prefer_fused(spec: tops_core.CallSpec) -> tuple[bool, str]:
    """The rule between the two kernels, and the facts it rests on.

    The fused kernel walks time sequentially, so its only parallelism is one (batch, head, value
    block) per core. With at least as many of those as TensorCores it keeps every core busy and
    moves the fewest bytes; with fewer, a core would idle, and the two-stage kernel, whose output
    stage is parallel over time too, is worth writing and re-reading the chunk states.
    """
    config = fused.resolved(FUSED_CONFIG, spec.key_dim, spec.chip)
    geometry = grid.geometry_of(spec.batch, spec.seq_len, spec.heads, spec.key_dim, spec.value_dim, config)
    units = spec.batch * spec.heads * geometry.value_tiles
    cores, where = _tensorcores(spec.chip)
    relation = ">=" if units >= cores else "<"
    return units >= cores, f"B*H*value blocks = {units} {relation} {where}"


def _fused_priority(spec: tops_core.CallSpec) -> tuple[int, str]:
    """200 when B*H*value blocks fill every TensorCore, else 180 (below chunk's 190)"""
    prefer, facts = _prefer_fused(spec)
    if prefer:
        return 200, f"{facts}: fused fills every core, ranks above chunk"
    return 180, f"{facts}: fused would idle a core, ranks below chunk"


def _chunk_priority(spec: tops_core.CallSpec) -> tuple[int, str]:
    """190: below fused when B*H*value blocks fill every TensorCore, above it otherwise"""
    prefer, facts = _prefer_fused(spec)
    if prefer:
        return 190, f"{facts}: fused fills every core, chunk ranks below it"
    return 190, f"{facts}: chunk's output stage and its backward's dq/dk pass are parallel over time, ranks above fused"


FUSED_CONFIG = fused.FusedConfig()
CHUNK_CONFIG = chunk.ChunkConfig()


def _fits_vmem(config, forward, backward=None, forward_config=None, op_inputs=None, backward_config=None):
    """A capability predicate: reject shapes whose launch plans (default config) exceed the VMEM budget of the chip.

    ``forward`` and ``backward`` (when the implementation has its own): ``(geometry_of, build_plans)``
    of each; one implementation serves both, so both must fit. The plans are fitted
    as the kernels fit them (``launch.fit``: fewer chunks per step), for the budget of the call's
    chip (``CallSpec.chip``; 16 MiB when it is not known). The whole padded K sits in every block,
    so a large K is what can overflow VMEM. The spec does not carry the dtypes of ``g`` and
    ``initial_state``; float32 (the larger) is assumed. ``forward_config(config, K, chip)``: the config
    the forward runs with for the call, when a field's default depends on it (``fused.resolved``); ``backward_config``
    likewise for the backward.
    ``op_inputs(spec)``: the plans' further arguments for the op's own optional inputs. The grid's
    heads are the value heads (``CallSpec.value_heads``); with several per query/key head (kda's family) the
    backward walks each group in one grid point's VMEM, so the geometry gets ``groups``.
    """

    def predicate(spec: tops_core.CallSpec) -> str | None:
        """blocks and scratch of the default config (forward, and backward where it has one) must fit the chip's VMEM budget (bounds K)"""
        target = launch.Target.of(spec.chip)
        directions = [(forward, config if forward_config is None else forward_config(config, spec.key_dim, spec.chip))]
        if backward is not None:
            directions.append((backward, config if backward_config is None else backward_config(config, spec.key_dim, spec.chip)))
        groups = spec.value_heads // spec.heads
        for (geometry_of, build_plans), direction_config in directions:
            geometry = geometry_of(spec.batch, spec.seq_len, spec.value_heads, spec.key_dim, spec.value_dim, direction_config,
                                   **({"groups": groups} if groups > 1 else {}))
            try:
                launch.fit(build_plans, geometry, spec.dtype, target, **_plan_inputs(spec), **(op_inputs(spec) if op_inputs else {}))
            except ValueError as error:
                return f"K={spec.key_dim}: {error}"
        return None

    return predicate


def _plan_inputs(spec: tops_core.CallSpec) -> dict:
    """The plans' arguments for a call spec's optional inputs; the spec does not carry the dtypes of ``g`` and
    ``initial_state``, so float32 (the larger) is assumed."""
    return dict(
        gate_dtype="float32" if "g" in spec.features else None,
        initial_state_dtype="float32" if "initial_state" in spec.features else None,
        output_final_state="output_final_state" in spec.features,
    )


def _varlen_priority(spec: tops_core.CallSpec) -> tuple[int, str]:
    """200: the Pallas kernel for packed sequences (fused and chunk do not take cu_seqlens)"""
    return 200, f"packed input, N = {spec.num_seqs} sequences: the one Pallas kernel that takes cu_seqlens"


def _capabilities(predicate, features: set[str], *, packed: bool = False, ndims=()) -> tops_core.Capabilities:
    """Every kernel here: TPU (and the interpreter), bf16 and float32, ``features``; a packed one requires cu_seqlens."""
    return tops_core.Capabilities(
        platforms={"tpu"},
        interpretable=True,
        dtypes={"bfloat16", "float32"},
        features=features | {"cu_seqlens"} if packed else features,
        requires={"cu_seqlens"} if packed else set(),
        ndims=ndims,
        predicate=predicate,
    )


_SIMPLE_GLA_FEATURES = {"g", "g_gamma", "initial_state", "output_final_state"}
_G_GAMMA_RANKS = {"g_gamma": {0, 1}}  # a scalar is broadcast to [H] before the kernel


def _explain_fused_config(config: fused.FusedConfig, spec: tops_core.CallSpec, direction: str) -> str:
    """``explain``'s line on what the fields a ``FusedConfig`` leaves None come to for the call."""
    if direction == "backward":
        left = " (None: the backward's, on every chip)" if config.chunk_size is None else ""
        return f"chunk_size={backward_fused.chunk_size_of(config)}{left}; {_backward_segments(config, spec)}"
    resolved = fused.resolved(config, spec.key_dim, spec.chip)
    geometry = grid.geometry_of(spec.batch, spec.seq_len, spec.heads, spec.key_dim, spec.value_dim, resolved)
    geometry, _ = launch.fit(fused.plans, geometry, spec.dtype, launch.Target.of(spec.chip), **_plan_inputs(spec))
    return f"{fused.explain(config, spec.dtype, spec.key_dim, spec.chip)}; {geometry.describe_steps()}"


def _backward_segments(config: fused.FusedConfig, spec: tops_core.CallSpec) -> str:
    """How the fused backward splits the call's sequence into segments, as it fits the chip's VMEM, and what it walks."""
    geometry = backward_fused.geometry_of(spec.batch, spec.seq_len, spec.heads, spec.key_dim, spec.value_dim, config)
    geometry, _ = launch.fit(backward_fused.plans, geometry, spec.dtype, launch.Target.of(spec.chip), **_plan_inputs(spec))
    tokens = f"segments of {geometry.rows_per_step} tokens"
    past = geometry.chunks_past_end
    beyond = f", {past} chunk{'s' if past > 1 else ''} of the last past the end" if past else ""
    if geometry.time_steps == 1:
        return f"{tokens}: one, no checkpoints walk{beyond}"
    return f"{tokens}: {geometry.time_steps}, the checkpoints walk over the first {geometry.time_steps - 1}{beyond}"


FUSED = tops_core.Implementation(
    op="simple_gla",
    name="fused",
    forward=fused.forward,
    backward=backward_fused.backward,
    capabilities=_capabilities(_fits_vmem(
        FUSED_CONFIG, (grid.geometry_of, fused.plans), (backward_fused.geometry_of, backward_fused.plans), forward_config=fused.resolved,
    ), _SIMPLE_GLA_FEATURES, ndims=_G_GAMMA_RANKS),
    priority=_fused_priority,
    config=FUSED_CONFIG,
    serves_pools=True,
    # The chunk v6e's forward takes, which interpret mode (no chip) would not run; a backward of several segments,
    # which the default cases (one segment each) never walk; and a padded grid (T=600: 10 chunks of 64 in three steps
    # of 4, forward and backward, the last running past the end).
    config_sweep=({"chunk_size": 256}, {"chunk_size": 64, "backward_num_steps": 1}, {"chunk_size": 64, "num_steps": 4, "backward_num_steps": 4}),
    explain_config=_explain_fused_config,
    description=(
        "one pallas_call: state in VMEM along a sequential time axis, num_steps chunks per grid step; "
        "backward: state checkpoints per step, then dS in VMEM along the reverse time axis"
    ),
)

CHUNK = tops_core.Implementation(
    op="simple_gla",
    name="chunk",
    forward=chunk.forward,
    backward=backward_split.backward,
    capabilities=_capabilities(
        _fits_vmem(CHUNK_CONFIG, (chunk.geometry_of, chunk.plans), (backward_split.geometry_of, backward_split.plans)),
        _SIMPLE_GLA_FEATURES, ndims=_G_GAMMA_RANKS,
    ),
    priority=_chunk_priority,
    config=CHUNK_CONFIG,
    config_sweep=({"chunk_size": 64, "num_steps": 4},),  # T=600: three steps of 4 chunks, the last two past the end
    description=(
        "two pallas_calls: chunk states in time order, then outputs parallel over time; "
        "backward: states, then dS in reverse time order, then dq, dk, dg parallel over time"
    ),
)

# VMEM hardly depends on N (boundaries in SMEM, states in HBM, the forward's first gates N floats a head): one
# sequence's plans stand for any N.
_PACKED_FITS_VMEM = _fits_vmem(
    varlen.VarlenConfig(),
    (grid.geometry_of, functools.partial(varlen.plans, num_seqs=1)),
    (backward_varlen.geometry_of, functools.partial(backward_varlen.plans, num_seqs=1)),
    forward_config=varlen.forward_config,
)
# Without states the packed call runs fused's kernels on reset gates (varlen.reset_gates), with fused's own defaults.
_UNPACKED_FITS_VMEM = _fits_vmem(
    varlen.unpacked_config(varlen.VarlenConfig()), (grid.geometry_of, fused.plans), (backward_fused.geometry_of, backward_fused.plans),
    forward_config=fused.resolved,
)


def _packed_fits_vmem(spec: tops_core.CallSpec) -> str | None:
    """the packed kernels' plans must fit the chip's VMEM budget, and without states the fused kernels' with g (bounds K)"""
    if {"initial_state", "output_final_state"} & spec.features:
        return _PACKED_FITS_VMEM(spec)
    return _UNPACKED_FITS_VMEM(dataclasses.replace(spec, features=spec.features | {"g"}))


VARLEN = tops_core.Implementation(
    op="simple_gla",
    name="varlen",
    forward=varlen.forward,
    backward=backward_varlen.backward,
    capabilities=_capabilities(_packed_fits_vmem, _SIMPLE_GLA_FEATURES, packed=True, ndims=_G_GAMMA_RANKS),
    priority=_varlen_priority,
    config=varlen.VarlenConfig(),
    # A padded grid (the base packing's T=261: 5 chunks of 64 in two steps of 3, forward and backward) and T=600's.
    config_sweep=({"chunk_size": 64, "num_steps": 4, "backward_num_steps": 4},),
    serves_pools=True,
    description=(
        "without states, fused's kernels with the state reset where each sequence starts (g = -inf there); with them, "
        "one pallas_call over packed sequences: cu_seqlens in SMEM, states by DMA at every boundary; "
        "backward: fused's two walks, dS reset to dht at every sequence end and written to dinitial_state at its start"
    ),
)


KDA_FUSED_CONFIG = kda.fused.KdaFusedConfig()

_BY_CHIP = {"forward_config": kda.fused.resolved, "backward_config": kda.fused.resolved}
"""``_fits_vmem``'s configs for the kernels on kda's grid: each direction at the chunk the call's chip takes."""


_SOLVES_FOR_WRITES = {r.op: r.delta_rule for r in (kda.chunkwise.KDA, gla.chunkwise.GLA, gated_delta_rule.chunkwise.GATED_DELTA_RULE)}
"""Whether each op on kda's grid solves for its writes (the delta rule), so that its backward has a form to choose."""


def _explain_kda_grid_config(config, spec: tops_core.CallSpec, direction: str) -> str:
    """``explain``'s line on the chunk a call on kda's grid walks and, for the delta rule's backward, whether its gradients
    kernel takes the WY form, each with the rule behind it where the config leaves it None."""
    lowered_for = spec.chip or "chip not known"
    line = f"chunk_size={grid.chunk_size_of(config, spec.chip)}"
    if config.chunk_size is None:
        by_chip = "".join(f"{size} on {chip}, else " for chip, size in config.TPU_CHUNK_SIZE_BY_CHIP.items())
        line += f" (None: {by_chip or 'on every chip '}{config.CHUNK_SIZE}; {lowered_for})"
    if direction == "backward" and _SOLVES_FOR_WRITES[spec.op]:
        line += f", wy_gradients={kda.fused.wy_gradients_of(config, spec.chip)}"
        if config.wy_gradients is None:
            line += f" (None: on a {kda.fused.WY_GRADIENTS_MXU}-wide MXU; {lowered_for})"
    return line


def _kda_inputs(spec: tops_core.CallSpec) -> dict:
    """dt_bias's block, float32 assumed (as for g); A_log sits in SMEM."""
    return {"dt_bias_dtype": "float32"} if "dt_bias" in spec.features else {}


_KDA_OPTIONS = {"use_qk_l2norm", "grouped_value_heads", "use_gate", "A_log", "dt_bias", "lower_bound", "use_beta_sigmoid", "allow_neg_eigval"}

PADDED_GRID = {"num_steps": 4}
"""The kit's sweep for the kernels on kda's grid: the interpreter walks one chunk per step by default (``grid.steps_of``),
a TPU several; at 4, T=600's 10 chunks of 64 take three steps, the last with the ragged chunk and two past the end (the
packed base's T=261, two steps of 3, one past the end)."""

WY_GRADIENTS = {"wy_gradients": True, "num_steps": 4}
"""The delta rule's gradients kernel in the WY form (``KdaFusedConfig.wy_gradients``), which a call lowered for v6e takes
and the interpreter (no chip) would not: the kit runs it in a config of its own, at 4 chunks per step, so that
gated_delta_rule's unpacked cases walk their states both ways (``kda.backward.walks_every_chunk``): in the gradients
kernel where one segment is the whole sequence (T=100, the strong cases' 256), from the walk's checkpoints where it is
not (T=600); kda's always from the walk's."""

GATES_AS_COLUMNS = {"chunk_size": 64}
"""gated_delta_rule's gate read as each chunk's ``(C, 1)`` column: its kernels read it along lanes at chunks of 128 and more
(``Recurrence.gates_along_lanes``), the interpreter's chunk, and as columns at 64, where v5e and v5p walk its packed
bfloat16 backward with initial states (``gated_delta_rule.fused.backward_config``)."""

KDA_FUSED = tops_core.Implementation(
    op="kda",
    name="fused",
    forward=kda.fused.forward,
    backward=kda.backward.backward,
    # No cu_seqlens: the matcher rejects packed calls with that reason (tpu_pallas.varlen takes them).
    capabilities=_capabilities(
        _fits_vmem(
            KDA_FUSED_CONFIG, (kda.fused.geometry_of, kda.fused.plans), (kda.backward.geometry_of, kda.backward.plans),
            op_inputs=_kda_inputs, **_BY_CHIP,
        ),
        {"initial_state", "output_final_state"} | _KDA_OPTIONS,
    ),
    priority={"tpu": 200},
    config=KDA_FUSED_CONFIG,
    # v6e's chunk and its backward's WY form, which the interpreter (no chip) would not take
    config_sweep=(PADDED_GRID, {"chunk_size": 128}, WY_GRADIENTS),
    explain_config=_explain_kda_grid_config,
    serves_pools=True,
    residuals=True,
    description=(
        "one pallas_call: state in VMEM along a sequential time axis, exact per-chunk inverse; "
        "backward: the state and inverse entering every chunk, then each chunk's VJP with dS in VMEM along the reverse "
        "time axis"
    ),
)


KDA_VARLEN = tops_core.Implementation(
    op="kda",
    name="varlen",
    forward=kda.varlen.forward,
    backward=kda.backward.backward,
    capabilities=_capabilities(
        # VMEM does not depend on N (boundaries in SMEM, states in HBM): one sequence's plans stand for any N.
        _fits_vmem(
            KDA_FUSED_CONFIG, (kda.varlen.geometry_of, functools.partial(kda.varlen.plans, num_seqs=1)),
            (kda.backward.geometry_of, functools.partial(kda.backward.plans, num_seqs=1)), op_inputs=_kda_inputs, **_BY_CHIP,
        ),
        {"initial_state", "output_final_state"} | _KDA_OPTIONS, packed=True,
    ),
    priority=_varlen_priority,
    config=KDA_FUSED_CONFIG,
    config_sweep=(PADDED_GRID, WY_GRADIENTS),
    explain_config=_explain_kda_grid_config,
    serves_pools=True,
    residuals=True,
    description=(
        "fused's pallas_call over packed sequences: cu_seqlens in SMEM, every key's decay 0 on each sequence's first token "
        "(the state reset), per-sequence states moved by DMA where each sequence starts and ends; "
        "backward: fused's, dS from dht where each sequence ends and dinitial_state written where it starts"
    ),
)


def _delta_rule_family(
    op: str, kernels, features: set[str], label: str, config=KDA_FUSED_CONFIG, packed_explain_config=None, config_sweep=(),
    packed_config_sweep=(), residuals: bool = False,
) -> tuple[tops_core.Implementation, ...]:
    """``tpu_pallas.fused`` and, packed, ``tpu_pallas.varlen`` for an op on kda's machinery (``kernels``: its module with
    ``forward``, ``packed_forward``, ``backward``, ``plans`` and ``backward_plans``), kda's priorities and ``config``
    (a ``KdaFusedConfig``); ``packed_explain_config``: the packed one's ``explain_config``, if any; ``config_sweep`` and
    ``packed_config_sweep``: the unpacked and the packed one's configs for the kit besides ``PADDED_GRID``; ``residuals``:
    the forwards hand their backward what it would recompute (``Implementation.residuals``, ``grid.handed_on``)."""
    unpacked = tops_core.Implementation(
        op=op,
        name="fused",
        forward=kernels.forward,
        backward=kernels.backward,
        capabilities=_capabilities(
            _fits_vmem(config, (kernels.geometry_of, kernels.plans), (kernels.geometry_of, kernels.backward_plans), **_BY_CHIP),
            features,
        ),
        priority={"tpu": 200},
        config=config,
        config_sweep=(PADDED_GRID, *config_sweep),
        explain_config=_explain_kda_grid_config,
        serves_pools=True,
        residuals=residuals,
        description=(
            f"one pallas_call on kda's fused grid: state in VMEM along a sequential time axis, {label}; backward: the "
            "states walked per segment (per chunk with the delta rule over several segments or packed), then each chunk's "
            "VJP with dS in VMEM along the reverse time axis"
        ),
    )
    packed = tops_core.Implementation(
        op=op,
        name="varlen",
        forward=kernels.packed_forward,
        backward=kernels.backward,
        capabilities=_capabilities(
            _fits_vmem(
                config, (kernels.geometry_of, functools.partial(kernels.plans, num_seqs=1)),
                (kernels.geometry_of, functools.partial(kernels.backward_plans, num_seqs=1)), **_BY_CHIP,
            ),
            features, packed=True,
        ),
        priority=_varlen_priority,
        config=config,
        config_sweep=(PADDED_GRID, *packed_config_sweep),
        explain_config=packed_explain_config or _explain_kda_grid_config,
        serves_pools=True,
        residuals=residuals,
        description=(
            "fused's pallas_call over packed sequences: cu_seqlens in SMEM, the state reset on each sequence's first token, "
            "per-sequence states moved by DMA where each sequence starts and ends; backward: fused's, dS from dht where each "
            "sequence ends and dinitial_state written where it starts"
        ),
    )
    return unpacked, packed


GLA_FUSED, GLA_VARLEN = _delta_rule_family(
    "gla", gla.fused, {"initial_state", "output_final_state"}, "kda's per-key decays and query pairs without the delta rule",
    gla.fused.GlaFusedConfig(), config_sweep=({"chunk_size": 128},),  # v6e's chunk, which the interpreter (no chip) would not walk
)


def _explain_packed_gated_delta_rule_config(config, spec: tops_core.CallSpec, direction: str) -> str:
    """``explain``'s line on the chunks a packed gated_delta_rule call walks: the backward's own on some chips
    (``gated_delta_rule.fused.backward_config``)."""
    if direction == "backward":
        states = "initial_state" in spec.features
        walked = gated_delta_rule.fused.backward_config(config, spec.dtype, packed_with_initial_states=states, chip=spec.chip)
        if walked.chunk_size != config.chunk_size:
            return (
                f"chunk_size={walked.chunk_size} (the backward's own: {spec.chip}'s compiler, libtpu 0.0.52, rejects the packed "
                f"bfloat16 gradients kernel with initial states at {grid.chunk_size_of(config, spec.chip)})"
            )
    return _explain_kda_grid_config(config, spec, direction)


GATED_DELTA_RULE_FUSED, GATED_DELTA_RULE_VARLEN = _delta_rule_family(
    "gated_delta_rule", gated_delta_rule.fused, {"initial_state", "output_final_state", "use_qk_l2norm", "grouped_value_heads"},
    "the pair products of its gate per head dense and kda's exact per-chunk inverse",
    gated_delta_rule.fused.GatedDeltaRuleFusedConfig(), _explain_packed_gated_delta_rule_config,
    config_sweep=(WY_GRADIENTS, GATES_AS_COLUMNS), packed_config_sweep=(WY_GRADIENTS, GATES_AS_COLUMNS), residuals=True,
)


def _recurrent_fits(delta: bool):
    """A capability predicate of ``tpu_pallas.recurrent`` for an op with (``delta``) or without the delta rule."""

    def predicate(spec: tops_core.CallSpec) -> str | None:
        """a block of all value heads, or of a multiple of 8 of them, must hold their float32 states within 1 MiB, and a sequence's tokens with them the chip's VMEM budget"""
        too_large = recurrent.fits(spec.value_heads, spec.key_dim, spec.value_dim)
        if too_large:
            return too_large
        states = spec.batch if "initial_state" in spec.features else 0
        shape = recurrent.Shape(spec.batch, spec.seq_len, spec.value_heads, spec.key_dim, spec.value_dim, states)
        return recurrent.fits_vmem(
            shape, spec.dtype, delta=delta, writes_state="output_final_state" in spec.features, target=launch.Target.of(spec.chip),
        )

    return predicate


def _recurrent(op: str, forward, features: set[str], label: str, delta_rule: bool = False) -> tops_core.Implementation:
    return tops_core.Implementation(
        op=op,
        name="recurrent",
        forward=forward,
        capabilities=_capabilities(_recurrent_fits(delta_rule), features),
        priority=tops_core.decode_step_priority(310),  # above xla.recurrent's 300
        config=recurrent.RecurrentConfig(),
        serves_pools=True,
        description=(
            f"{label} token by token in one pallas_call, for decode steps (forward only): each state read once and written "
            "once, from and to its row of a state pool in place"
        ),
    )


RECURRENT = _recurrent("simple_gla", simple_gla.recurrent.forward, _SIMPLE_GLA_FEATURES, "simple_gla")
KDA_RECURRENT = _recurrent(
    "kda", kda.recurrent.forward, {"initial_state", "output_final_state"} | _KDA_OPTIONS, "KDA", kda.chunkwise.KDA.delta_rule,
)
GLA_RECURRENT = _recurrent("gla", gla.recurrent.forward, {"initial_state", "output_final_state"}, "GLA", gla.chunkwise.GLA.delta_rule)
GATED_DELTA_RULE_RECURRENT = _recurrent(
    "gated_delta_rule", gated_delta_rule.recurrent.forward,
    {"initial_state", "output_final_state", "use_qk_l2norm", "grouped_value_heads"}, "the gated delta rule",
    gated_delta_rule.chunkwise.GATED_DELTA_RULE.delta_rule,
)


@tops_core.hookimpl
def tops_register_implementations(register):
    """Register the simple_gla kernels, and kda's, gla's and gated_delta_rule's (unpacked and packed), each with its own
    backward, and every op's decode kernel."""
    register(FUSED)
    register(CHUNK)
    register(VARLEN)
    register(KDA_FUSED)
    register(KDA_VARLEN)
    register(GLA_FUSED)
    register(GLA_VARLEN)
    register(GATED_DELTA_RULE_FUSED)
    register(GATED_DELTA_RULE_VARLEN)
    register(RECURRENT)
    register(KDA_RECURRENT)
    register(GLA_RECURRENT)
    register(GATED_DELTA_RULE_RECURRENT)
