"""Op contracts, one module per op. Adding an op: its signature in ``tops_core.signatures``, its
contract module here, and the contract listed below."""

from tops_core.ops.base import OpContract
from tops_core.ops.gated_delta_rule import GatedDeltaRule
from tops_core.ops.gla import GLA
from tops_core.ops.kda import KDA
from tops_core.ops.simple_gla import SimpleGLA

CONTRACTS: dict[str, OpContract] = {contract.name: contract for contract in (SimpleGLA(), KDA(), GLA(), GatedDeltaRule())}


def op(name: str) -> OpContract:
    """The op contract named ``name``: call ``.forward``, ``.backward`` or ``.explain`` on it."""
    try:
        return CONTRACTS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(sorted(CONTRACTS))}") from None
