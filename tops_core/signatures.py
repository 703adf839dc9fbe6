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
    """An op's name, the optional inputs and boolean options a call spec can name (``features``),
    and the inputs whose rank may vary (``variable_ndims``)."""

    name: str
    features: frozenset[str]
    variable_ndims: frozenset[str] = frozenset()


SIMPLE_GLA = Signature(
    "simple_gla", frozenset({"g", "g_gamma", "initial_state", "cu_seqlens", "output_final_state"}), frozenset({"g_gamma"}),
)
KDA = Signature(
    "kda",
    frozenset({
        "initial_state", "cu_seqlens", "output_final_state", "use_qk_l2norm", "grouped_value_heads",
        "use_gate", "A_log", "dt_bias", "lower_bound", "use_beta_sigmoid", "allow_neg_eigval",
    }),
)

SIGNATURES: dict[str, Signature] = {signature.name: signature for signature in (SIMPLE_GLA, KDA)}


def known_op(name: str, source: str) -> Signature:
    """The signature of op ``name``; a ValueError naming ``source`` and the known ops when there is none."""
    try:
        return SIGNATURES[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r} in {source}; known ops: {', '.join(sorted(SIGNATURES))}") from None
