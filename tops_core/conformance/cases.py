"""The case grid of the conformance kit, derived from an implementation's capability declarations.

Supported cases start from a *base* call that uses everything the implementation declares, with
a ``scale`` other than the default, then vary one factor at a time (gates, ranks, optional state,
kda's grouped value heads and the forms of its gate and beta, head dims, T, packing, strong decay,
one strongly decaying token in each 64 per key, a steady decay of ``-39.5`` over every 32 tokens per key, gates of ``-inf``, weak decay in bf16, dtype, config sweep). Unsupported cases are the base plus exactly one factor outside
the declarations; each must be rejected by the matcher.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tops_core.callspec import CallSpec
from tops_core.capabilities import FLOAT_DTYPES, DimRule
from tops_core.implementation import Implementation
from tops_core.ops import op

HEAD_DIMS = (64, 100, 128)
OUT_OF_RANGE_DIMS = (64, 100, 128, 256, 32, 96, 512)
GATES = {"simple_gla": ("g", "g_gamma"), "kda": (), "gla": (), "gated_delta_rule": ()}
# Boundaries inside a chunk and on one (64), at token 0, empty sequences first, inside and last, one-token
# sequences, a sequence over several chunks; cases that change T resize the last sequence. The first
# packing holds every one of these and runs by default; the others, each a few of them, with -m slow. The
# last starts sequences on rows 31, 32, 63, 64 and 97 of the first chunks (every 32-row word of a chunk's rows,
# where a kernel may keep one bit per row).
# An implementation that requires cu_seqlens takes the second as its base case's packing.
PACKINGS = ((0, 1, 70, 0, 57, 130, 3, 0), (0, 1, 70, 57), (130, 0, 3), (64, 200, 1, 0), (31, 1, 31, 1, 33, 40, 1))
BASE_PACKING = PACKINGS[1]
SCALE = 0.37
"""The base case's ``scale``: not ``K ** -0.5`` for any head dim of the grid, so an implementation that
ignores the argument (or recomputes the default) fails. Every case derived from the base keeps it."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of the grid, described by static facts only."""

    op: str
    name: str
    dtype: str = "float32"
    batch: int = 2
    seq_len: int = 100
    heads: int = 2
    value_heads: int | None = None
    """``v``'s and the state's heads (a multiple of ``heads``, with ``grouped_value_heads``); None becomes ``heads``."""
    key_dim: int = 64
    value_dim: int = 64
    features: frozenset[str] = frozenset()
    ndims: tuple[tuple[str, int], ...] = ()
    seqlens: tuple[int, ...] | None = None
    strong_decay: bool = False
    weak_decay: bool = False
    single_strong_token: bool = False
    """Per-key gates ``0`` but on one token of every 64 per key, ``-39.5``: chunks of 64 that decay by ``exp(-39.5)``, at the
    edge of what one reference point per chunk keeps within ``exp(+-40)`` (gla's fast paths); see ``data``."""
    steady_sub_chunk_decay: bool = False
    """Per-key gates ``-39.5 / 32`` on every token: every 32 tokens decay by ``exp(-39.5)``, at the edge of what one
    reference point per 32 tokens keeps within ``exp(+-40)``, and every 64 by ``exp(-79)``, past it (gla's fast paths
    on sub-chunks); see ``data``."""
    reset: bool = False
    """Some gates are ``-inf`` (``exp(-inf) = 0``: the state is reset there); see ``data.forward_inputs``."""
    scale: float | None = None
    pool_rows: int | None = None
    """The states come as a pool of this many rows, picked by ``ssm_state_indices`` (see ``data.pool_indices``)."""
    config: tuple[tuple[str, Any], ...] = ()
    slow: bool = False
    """Breadth beyond what the default run needs (another aligned T, more head dims): marked ``slow`` by the kit."""

    def __post_init__(self):
        if self.value_heads is None:
            object.__setattr__(self, "value_heads", self.heads)
        if self.seqlens is not None and sum(self.seqlens) != self.seq_len:
            # A packed case given another T keeps its packing and resizes the last sequence to fit.
            last = self.seq_len - sum(self.seqlens[:-1])
            if last < 0:
                raise ValueError(f"{self.name}: packing {self.seqlens} does not fit T = {self.seq_len}")
            object.__setattr__(self, "seqlens", (*self.seqlens[:-1], last))

    def spec(self, platform: str, interpret: bool) -> CallSpec:
        num_seqs = len(self.seqlens) if self.seqlens is not None else self.batch
        return CallSpec(
            op=self.op, platform=platform, dtype=self.dtype, batch=self.batch, seq_len=self.seq_len,
            heads=self.heads, key_dim=self.key_dim, value_dim=self.value_dim, num_seqs=num_seqs,
            features=self.features, ndims=self.ndims, interpret=interpret, value_heads=self.value_heads,
        )

    def with_features(self, name: str, features: frozenset[str], **changes: Any) -> Case:
        ndims = tuple((k, v) for k, v in self.ndims if k in features)
        if "g_gamma" in features and "g_gamma" not in dict(ndims):
            ndims += (("g_gamma", 1),)
        if "cu_seqlens" in features and self.seqlens is None:
            changes = {"batch": 1, "seqlens": BASE_PACKING, "seq_len": sum(BASE_PACKING)} | changes
        if "cu_seqlens" not in features:
            changes = {"seqlens": None} | changes
        if "grouped_value_heads" in features and self.value_heads == self.heads:
            changes = {"value_heads": 2 * changes.get("heads", self.heads)} | changes
        if "grouped_value_heads" not in features:
            changes = {"value_heads": None} | changes
        return dataclasses.replace(self, name=name, features=frozenset(features), ndims=ndims, **changes)


@dataclasses.dataclass(frozen=True)
class Grid:
    supported: tuple[Case, ...]
    unsupported: tuple[Case, ...]


def _dims(rule: DimRule) -> list[int]:
    accepted = [d for d in HEAD_DIMS if rule.accepts(d)]
    if accepted:
        return accepted
    smallest = -(-max(rule.min, 1) // rule.multiple_of) * rule.multiple_of
    return [smallest] if rule.accepts(smallest) else []


def grid(impl: Implementation) -> Grid:
    """The supported and unsupported cases for one implementation."""
    contract = op(impl.op)
    caps = impl.capabilities
    declared = caps.features
    gates = frozenset(GATES[impl.op])
    toggles = contract.features - gates - {"cu_seqlens"}

    gate_options = []
    for subset in ((), ("g",), ("g_gamma",), ("g", "g_gamma")):
        subset = frozenset(subset)
        if subset <= gates and subset <= declared and (caps.requires & gates) <= subset:
            gate_options.append(subset)
    base_gates = max(gate_options, key=len)
    signature = contract.signature
    base_features = signature.closed(base_gates | (toggles & declared) | caps.requires)
    key_dims, value_dims = _dims(caps.key_dim), _dims(caps.value_dim)
    base_dtype = "float32" if "float32" in caps.dtypes else sorted(caps.dtypes)[0]
    # Grouped value heads keep the base's work: one query/key head serving two value heads.
    heads = {"heads": 1, "value_heads": 2} if "grouped_value_heads" in base_features else {}
    base = Case(impl.op, "base", dtype=base_dtype, key_dim=key_dims[0], value_dim=value_dims[0], scale=SCALE, **heads).with_features(
        "base", base_features)

    supported = [base]
    for subset in gate_options:
        if subset != base_gates:
            supported.append(base.with_features(f"gates={'+'.join(sorted(subset)) or 'none'}", (base_features - gates) | subset))
    accepted_ndims = caps.accepted_ndims("g_gamma")
    if "g_gamma" in base_features and (accepted_ndims is None or 0 in accepted_ndims):
        # Packed-only, with -m slow: the scalar is broadcast before any kernel, as for the unpacked sibling.
        supported.append(dataclasses.replace(base, name="g_gamma-scalar", ndims=(("g_gamma", 0),), slow="cu_seqlens" in caps.requires))
    # An implementation that requires cu_seqlens runs every case packed, so its option toggles, its other head dims
    # and its second packing repeat what its packed base, strong, reset and bf16 cases already hold packed: slow.
    packed_only = "cu_seqlens" in caps.requires
    # Unpacked, the default run takes the other side of the base's shape and of its plain options in one case ("edges":
    # the first other head dims, off the 128-lane tile; the ragged T that crosses a chunk; no initial state; no l2norm):
    # a failure there names its factors, each of which runs alone with -m slow.
    unpacked = "cu_seqlens" not in base_features
    edge_toggles = (toggles & base_features & {"initial_state", "use_qk_l2norm"}) - caps.requires if unpacked else set()
    for toggle in sorted((toggles & base_features) - caps.requires):
        # Without the final state only drops an output the base case checks; the other forms of kda's gate
        # and beta than the base's bounded gate with A_log and dt_bias and beta logits with negative
        # eigenvalues: slow, but for the softplus gate (without lower_bound) and the precomputed gate; one
        # value head per query/key head: slow, the strong and reset cases' form; three per head (below): slow.
        changes = {"heads": 2} if toggle == "grouped_value_heads" else {}
        slow = packed_only or toggle in edge_toggles or toggle in (
            "output_final_state", "A_log", "dt_bias", "use_beta_sigmoid", "allow_neg_eigval", "grouped_value_heads")
        supported.append(base.with_features(f"without-{toggle}", signature.closed(base_features - {toggle}), slow=slow, **changes))
    states = {"initial_state", "output_final_state"}
    if states <= base_features - caps.requires:
        # No state in or out, the usual training call: a packed kernel may take another path for it (simple_gla's varlen
        # runs fused's kernels then, a constant decay's without per-token gates), so it runs by default, and with each
        # gate option, where every case is packed.
        for subset in gate_options if packed_only else [base_gates]:
            name = "without-states" if subset == base_gates else f"without-states,gates={'+'.join(sorted(subset)) or 'none'}"
            features = signature.closed((base_features - states - gates) | subset)
            supported.append(base.with_features(name, features, slow=not packed_only))
    if "grouped_value_heads" in base_features:
        supported.append(dataclasses.replace(base, name="grouped_value_heads=3", value_heads=3, slow=True))
    for key_dim in key_dims[1:]:
        value_dim = key_dim if caps.value_dim.accepts(key_dim) else value_dims[-1]
        supported.append(dataclasses.replace(base, name=f"K={key_dim},V={value_dim}", key_dim=key_dim, value_dim=value_dim, slow=True))
    if key_dims[0] != value_dims[-1]:
        supported.append(dataclasses.replace(base, name=f"K={key_dims[0]},V={value_dims[-1]}", value_dim=value_dims[-1], slow=True))
    if "cu_seqlens" not in base_features:
        for seq_len in (1, 128, 130):
            supported.append(dataclasses.replace(base, name=f"T={seq_len}", seq_len=seq_len, batch=1 if seq_len > 100 else 2, slow=True))
        key_dim = key_dims[1] if len(key_dims) > 1 else key_dims[0]
        value_dim = key_dim if caps.value_dim.accepts(key_dim) else value_dims[-1]
        factors = [f"K={key_dim},V={value_dim}", "T=130", *(f"without-{toggle}" for toggle in sorted(edge_toggles))]
        supported.append(base.with_features(
            "edges:" + ",".join(factors), signature.closed(base_features - edge_toggles), key_dim=key_dim, value_dim=value_dim,
            seq_len=130, batch=1,
        ))
    if "cu_seqlens" in declared:
        for index, seqlens in enumerate(PACKINGS):
            name = "varlen=" + "+".join(map(str, seqlens))
            supported.append(base.with_features(
                name, base_features | {"cu_seqlens"}, batch=1, seqlens=seqlens, seq_len=sum(seqlens), slow=packed_only or index > 0))
    # A state pool (ssm_state_indices): the sequences' rows scattered over a larger pool, one a padding slot.
    if {"initial_state", "output_final_state"} <= base_features:
        in_place = impl.serves_pools and caps.key_dim.accepts(128) and caps.value_dim.accepts(128)
        # Where the rows can be served in place, that path runs by default and the gathered rows (the core's
        # ``ops.pool`` around the dense call, which every implementation that does not serve pools runs by default)
        # with -m slow.
        pool = dataclasses.replace(base, name="state-pool", pool_rows=2 * base.spec("cpu", False).num_seqs + 1, slow=in_place)
        supported.append(pool)
        if in_place:
            # Whole lanes, where a kernel that serves pools may read and write the rows in place rather than gathered
            # (packed-only, with -m slow: its unpacked sibling's in-place pool runs by default).
            supported.append(dataclasses.replace(pool, name="state-pool,K=128,V=128", key_dim=128, value_dim=128, slow=packed_only))
    # The strong and reset cases are kda's plain call (one value head per query/key head; the log decays and
    # beta given as they are), which the default run checks nowhere else.
    plain_features = signature.closed(base_features - {"use_gate", "lower_bound", "use_beta_sigmoid", "grouped_value_heads"})
    plain = base.with_features(base.name, plain_features, heads=2)
    strong = _strong_decay_cases(plain, plain.features, gate_options, gates)
    supported += strong
    supported += _reset_cases(plain, plain.features, gate_options, gates)
    if not gates:  # gates per key (kda, gla)
        supported.append(dataclasses.replace(plain, name="single-strong-token-g", single_strong_token=True, seq_len=256, batch=1))
        supported.append(dataclasses.replace(plain, name="steady-sub-chunk-decay-g", steady_sub_chunk_decay=True, seq_len=256, batch=1))
    for dtype in sorted(caps.dtypes - {base_dtype}):
        # Packed-only, bfloat16 runs with -m slow (the unpacked sibling's and xla.chunk's run by default); float16, which only
        # the XLA implementations declare, too (its rounding is bfloat16's with a narrower range: their bfloat16 runs).
        supported.append(dataclasses.replace(base, name=dtype, dtype=dtype, slow=packed_only or dtype == "float16"))
        if dtype == "bfloat16":
            # The strong decays and bfloat16 each run by default; together with -m slow.
            supported += [dataclasses.replace(case, name=f"bfloat16-{case.name}", dtype=dtype, slow=True) for case in strong[:1]]
            # Their point is the decay gradient's cancellation: a forward-only implementation runs them with -m slow.
            weak = [dataclasses.replace(case, slow=impl.backward is None) for case in _weak_decay_cases(base, base_features, gate_options, gates)]
            supported += weak
            if packed_only and states <= base_features - caps.requires:
                # The usual packed training call, in bfloat16: no state in or out, the other path a packed kernel may
                # take (above), which the float32 cases alone would check nowhere in bfloat16.
                supported.append(base.with_features(f"{dtype}-without-states", signature.closed(base_features - states), dtype=dtype))
                supported += [case.with_features(f"{case.name},without-states", signature.closed(case.features - states)) for case in weak]
    for overrides in impl.config_sweep:
        label = "config=" + ",".join(f"{k}={v}" for k, v in sorted(overrides.items()))
        config = tuple(sorted(overrides.items()))
        # T=600 crosses chunks of up to 256 twice and ends ragged (T=130, with -m slow, once); the strong cases
        # fill a whole chunk of 256. Where every case is packed, the base packing alone by default.
        crossing = [dataclasses.replace(base, name=f"T={seq_len}", seq_len=seq_len, batch=1, slow=seq_len == 130) for seq_len in (130, 600)]
        for case in [base, *crossing, *strong]:
            slow = case.slow or (packed_only and case is not base)
            supported.append(dataclasses.replace(case, name=f"{label}-{case.name}", config=config, slow=slow))

    return Grid(tuple(supported), tuple(_unsupported_cases(impl, contract, base, base_features)))


def _strong_decay_cases(base: Case, base_features: frozenset[str], gate_options: list, gates: frozenset[str]) -> list[Case]:
    """Decays that overflow a naive ``exp`` of the masked triangle: g_gamma = -1, or g near -1 and below."""
    cases = []
    for gate in ("g_gamma", "g"):
        options = [s for s in gate_options if gate in s]
        if options:
            features = (base_features - gates) | min(options, key=len)
            cases.append(base.with_features(f"strong-{gate}", features, strong_decay=True, seq_len=256, batch=1))
    if not gates:
        cases.append(dataclasses.replace(base, name="strong-g", strong_decay=True, seq_len=256, batch=1))
    return cases


def _reset_cases(base: Case, base_features: frozenset[str], gate_options: list, gates: frozenset[str]) -> list[Case]:
    """Gates of ``-inf`` (a legal way to cut a sequence: the state is reset): the results are finite, and the
    reference's, forward and gradients. The strong cases' shape (B = 1, T = 256: resets in the first, a middle
    and the last chunk of 64): a process that runs both compiles their programs once."""
    cases = []
    for gate in ("g", "g_gamma"):
        options = [s for s in gate_options if gate in s]
        if options:
            cases.append(base.with_features(f"reset-{gate}", (base_features - gates) | min(options, key=len), reset=True, seq_len=256, batch=1))
    if not gates:
        cases.append(dataclasses.replace(base, name="reset-g", reset=True, seq_len=256, batch=1))
    return cases


def _weak_decay_cases(base: Case, base_features: frozenset[str], gate_options: list, gates: frozenset[str]) -> list[Case]:
    """bf16 under a weak decay (g_gamma = -2**-8, or g near -0.003), one head, 8 sequences: the decay gradient sums
    per-token terms that nearly cancel, so it shows a float32 intermediate rounded to bf16 on its way (a single bf16
    pass for the state products of the Pallas backward misses dg_gamma's tolerance here)."""
    cases = []
    for gate in ("g_gamma", "g"):
        options = [s for s in gate_options if gate in s]
        if options:
            features = (base_features - gates) | min(options, key=len)
            batch = 1 if "cu_seqlens" in features else 8  # a packed case keeps its sequences, the last resized
            cases.append(base.with_features(
                f"bfloat16-weak-{gate}", features, dtype="bfloat16", weak_decay=True, heads=1, batch=batch, seq_len=128,
            ))
    return cases


def _unsupported_cases(impl: Implementation, contract, base: Case, base_features: frozenset[str]) -> list[Case]:
    caps = impl.capabilities
    signature = contract.signature
    cases = []
    for feature in sorted(contract.features - caps.features):
        cases.append(base.with_features(f"unsupported-{feature}", signature.completed(base_features | {feature})))
    for feature in sorted(caps.requires):
        cases.append(base.with_features(f"missing-required-{feature}", signature.closed(base_features - {feature})))
    for dtype in sorted(set(FLOAT_DTYPES) - caps.dtypes):
        cases.append(dataclasses.replace(base, name=f"unsupported-{dtype}", dtype=dtype))
    for name in sorted(contract.variable_ndims & base_features):
        accepted = caps.accepted_ndims(name)
        for ndim in sorted({0, 1} - (accepted if accepted is not None else {0, 1})):
            cases.append(dataclasses.replace(base, name=f"unsupported-{name}.ndim={ndim}", ndims=((name, ndim),)))
    for field, rule in (("key_dim", caps.key_dim), ("value_dim", caps.value_dim)):
        outside = next((d for d in OUT_OF_RANGE_DIMS if not rule.accepts(d)), None)
        if outside is not None:
            cases.append(dataclasses.replace(base, name=f"unsupported-{field}={outside}", **{field: outside}))
    return cases
