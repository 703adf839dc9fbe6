"""The core's folder keeps the runtime apart from the tooling, and its modules import downwards only."""

import ast
import pathlib
import subprocess
import sys

import tops_core
from tops_core.ops import CONTRACTS
from tops_core.signatures import SIGNATURES

CORE = pathlib.Path(tops_core.__file__).parent


def test_every_signature_has_its_contract_and_back():
    assert set(SIGNATURES) == set(CONTRACTS)
    for name, contract in CONTRACTS.items():
        signature = SIGNATURES[name]
        assert (contract.name, contract.features, contract.variable_ndims) == (
            signature.name, signature.features, signature.variable_ndims)


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_registry_and_the_policy_learn_op_names_below_the_contracts():
    # They used to import tops_core.ops lazily, inside functions, to break an import circle.
    for module in ("registry.py", "policy.py", "signatures.py", "dispatch.py", "implementation.py", "capabilities.py"):
        imported = _imported_modules(CORE / module)
        assert not any(name == "tops_core.ops" or name.startswith("tops_core.ops.") for name in imported), module


def test_importing_tops_core_loads_no_tooling():
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, tops_core; print('\\n'.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    tooling = [name for name in loaded if name.startswith(("tops_core.tpu.", "tops_core.cli", "tops_core.bench", "tops_core.conformance"))]
    assert tooling == ["tops_core.tpu.generations"], tooling  # chip figures size the runtime's kernels too
