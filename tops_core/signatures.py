"""Each op's name and the optional inputs a call of it can name.

The registry checks what a plugin registers against these, and the policy checks the op names a
user forces; the op contracts (``tops_core.ops``) are built on them. This module sits below all
three, so none of them imports another to learn an op's name. Adding an op: its signature here,
its contract in ``tops_core.ops``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Signature:
    """An op's name, the optional inputs and options a call spec can name (``features``), the inputs
    whose rank may vary (``variable_ndims``), and what a feature needs beside it (``needs``: a call
    with the feature has at least one of those).

    A feature is an input that is given, an option that is on (or set), or a fact of the shapes
    (kda's ``grouped_value_heads``: more value heads than query/key heads).
    """

    name: str
    features: frozenset[str]
    variable_ndims: frozenset[str] = frozenset()
    needs: tuple[tuple[str, frozenset[str]], ...] = ()

    def missing(self, features: frozenset[str]) -> list[str]:
        """What a set of features lacks to be a valid call, one sentence per unmet need."""
        return [f"{feature} requires {' or '.join(sorted(needed))}" for feature, needed in self._unmet(features)]

    def completed(self, features: frozenset[str]) -> frozenset[str]:
        """``features`` plus, for each unmet need, the first feature (by name) that meets it."""
        while unmet := self._unmet(features):
            features = features | {min(unmet[0][1])}
        return features

    def closed(self, features: frozenset[str]) -> frozenset[str]:
        """``features`` less every feature whose needs they no longer meet (after one was removed)."""
        while unmet := self._unmet(features):
            features = features - {feature for feature, _ in unmet}
        return features

    def _unmet(self, features: frozenset[str]) -> list[tuple[str, frozenset[str]]]:
        """The needs of ``features`` that none of them meets."""
        return [(feature, needed) for feature, needed in self.needs if feature in features and not features & needed]


SIMPLE_GLA = Signature(
    "simple_gla", frozenset({"g", "g_gamma", "initial_state", "cu_seqlens", "output_final_state"}), frozenset({"g_gamma"}),
)
KDA = Signature(
    "kda",
    frozenset({
        "initial_state", "cu_seqlens", "output_final_state", "use_qk_l2norm", "grouped_value_heads",
        "use_gate", "A_log", "dt_bias", "lower_bound", "use_beta_sigmoid", "allow_neg_eigval",
    }),
    needs=(
        ("use_gate", frozenset({"A_log", "lower_bound"})),
        ("A_log", frozenset({"use_gate"})),
        ("dt_bias", frozenset({"use_gate"})),
        ("allow_neg_eigval", frozenset({"use_beta_sigmoid"})),
    ),
)

GLA = Signature("gla", frozenset({"initial_state", "cu_seqlens", "output_final_state"}))
GATED_DELTA_RULE = Signature(
    "gated_delta_rule",
    frozenset({"initial_state", "cu_seqlens", "output_final_state", "use_qk_l2norm", "grouped_value_heads"}),
)

SIGNATURES: dict[str, Signature] = {signature.name: signature for signature in (SIMPLE_GLA, KDA, GLA, GATED_DELTA_RULE)}


def known_op(name: str, source: str) -> Signature:
    """The signature of op ``name``; a ValueError naming ``source`` and the known ops when there is none."""
    try:
        return SIGNATURES[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r} in {source}; known ops: {', '.join(sorted(SIGNATURES))}") from None
