"""The call spec: the static facts about one call that implementation selection depends on."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tops_core.tpu.generations import GENERATIONS

PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """A hashable description of a call, made only of static facts (never a traced value).

    ``features`` names the optional inputs that are present and the boolean options that are on
    (for simple_gla: ``g``, ``g_gamma``, ``initial_state``, ``cu_seqlens``,
    ``output_final_state``). ``ndims`` records the rank of inputs whose rank may vary
    (``g_gamma`` may be a scalar or ``[H]``). ``value_heads``: the heads of ``v`` and of the state,
    ``heads`` (of ``q`` and ``k``) times the group size of grouped value heads; ``None`` means
    ``heads``. ``chip``: the TPU generation (a key of
    ``tops_core.tpu.generations.GENERATIONS``) the call is lowered for when it is lowered for a TPU
    and the generation is known, else None; what platform ``tpu``'s decision may size kernels by.
    """

    op: str
    platform: str
    dtype: str
    batch: int
    seq_len: int
    heads: int
    key_dim: int
    value_dim: int
    num_seqs: int
    features: frozenset[str] = frozenset()
    ndims: tuple[tuple[str, int], ...] = ()
    interpret: bool = False
    chip: str | None = None
    value_heads: int | None = None

    def __post_init__(self):
        if self.platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS}, got {self.platform!r}")
        if self.chip is not None and self.chip not in GENERATIONS:
            raise ValueError(f"chip must be None or one of {sorted(GENERATIONS)}, got {self.chip!r}")
        object.__setattr__(self, "features", frozenset(self.features))
        object.__setattr__(self, "ndims", tuple(sorted(dict(self.ndims).items())))
        if self.value_heads is None:
            object.__setattr__(self, "value_heads", self.heads)
        if self.value_heads % self.heads:
            raise ValueError(f"value_heads must be a multiple of heads, got {self.value_heads} and {self.heads}")
        if self.value_heads != self.heads:  # a fact of the shapes, matched like any feature
            object.__setattr__(self, "features", self.features | {"grouped_value_heads"})
        elif "grouped_value_heads" in self.features:
            raise ValueError(f"grouped_value_heads needs value_heads > heads, got value_heads = heads = {self.heads}")

    def ndim(self, name: str) -> int | None:
        return dict(self.ndims).get(name)

    def describe(self) -> str:
        heads = f"H={self.heads}" + (f" HV={self.value_heads}" if self.value_heads != self.heads else "")
        shape = f"B={self.batch} T={self.seq_len} {heads} K={self.key_dim} V={self.value_dim}"
        if "cu_seqlens" in self.features:
            shape += f" N={self.num_seqs}"
        parts = [f"{shape} {self.dtype} on {self.platform}" + (f" ({self.chip})" if self.chip and self.platform == "tpu" else "")]
        if self.interpret:
            parts.append("interpret mode")
        features = []
        for name in sorted(self.features):
            ndim = self.ndim(name)
            features.append(name if ndim is None else f"{name} (ndim {ndim})")
        parts.append("with " + ", ".join(features) if features else "no optional inputs")
        return "; ".join(parts)


DECODE_STEP_TOKENS = 16
"""The longest call a token-by-token implementation ranks first for: a decode step or a speculative draft. A longer
one is a prefill, which the chunked kernels serve with matrix products over whole chunks."""


def decode_step_priority(priority: int) -> Callable[[CallSpec], tuple[int, str]]:
    """The rank of an implementation that runs a call token by token: ``priority`` up to ``DECODE_STEP_TOKENS`` tokens,
    else 1 (for ``Implementation.priority``)."""

    def rank(spec: CallSpec) -> tuple[int, str]:
        if spec.seq_len <= DECODE_STEP_TOKENS:
            return priority, f"T={spec.seq_len} <= {DECODE_STEP_TOKENS}: a decode step, token by token with no chunk padding"
        return 1, f"T={spec.seq_len} > {DECODE_STEP_TOKENS}: a prefill, which the chunked kernels serve faster"

    rank.__doc__ = f"{priority} up to {DECODE_STEP_TOKENS} tokens (a decode step), else 1 (a prefill, which the chunked kernels rank above)"
    return rank
