"""Every sample in the README runs as written: its Python blocks, in order, and its ``tops`` commands with the output it shows.

The Python blocks run in one fresh process, one after another in one namespace (the later ones use
what "Using it" defines), on eight CPU devices for the many-devices sample. A console sample
(a block starting ``$ tops ...``) is run in-process with the installed plugins and compared line
for line, but for the line of versions and devices ``tops plugins`` starts with. ``tops bench``'s
sample is a measurement, not a fixed output: the README says when it was taken, and
tests/test_bench.py checks the report's format.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from tops_core.cli import main
from tops_core.tpu.compile_only import without_cpu_backend_flags

README = pathlib.Path(__file__).parents[1] / "README.md"


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block, in order."""
    return [(m[1], m[2]) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)]


def console_samples() -> list[tuple[str, str]]:
    """``(command line, shown output)`` of every block that shows a ``tops`` command and what it printed."""
    samples = []
    for language, body in fenced_blocks(README.read_text()):
        if not language and body.startswith("$ tops "):
            command, _, shown = body.partition("\n")
            samples.append((command.removeprefix("$ "), shown))
    return samples


def test_the_python_samples_run_as_written(tmp_path):
    blocks = [body for language, body in fenced_blocks(README.read_text()) if language == "python"]
    environment = {name: value for name, value in os.environ.items() if not name.startswith("TOPS_")}
    # The test run's CPU compile flags (conftest.py: the same programs, compiled faster) until the first sample that
    # loads libtpu, which rejects them: the XLA_FLAGS it reads when it loads are a user's, the CPU backend's own
    # flags left out (the CPU backend read the variable when it started).
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    loads_libtpu = next(index for index, body in enumerate(blocks) if "topologies" in body)
    user_flags = f"import os; os.environ['XLA_FLAGS'] = {without_cpu_backend_flags(flags)!r}"
    script = "\n\n".join([*blocks[:loads_libtpu], user_flags, *blocks[loads_libtpu:]])
    environment.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=environment, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "INVALID_ARGUMENT" not in result.stderr, "libtpu's start-up noise, which the README says how to quiet"


@pytest.mark.parametrize("command, shown", [s for s in console_samples() if not s[0].startswith("tops bench")],
                         ids=lambda value: value if value.startswith("tops") else "")
def test_the_console_samples_show_what_tops_prints(clean_env, capsys, command, shown):
    code = main(shlex.split(command)[1:])
    printed = capsys.readouterr().out
    if command == "tops plugins":
        # The versions and the devices are this machine's.
        printed, shown = (text.split("\n", 2)[2] for text in (printed, shown))
    assert code == 0
    assert printed.rstrip("\n").splitlines() == shown.rstrip("\n").splitlines()


def test_the_bench_sample_is_there():
    assert any(command.startswith("tops bench") for command, _ in console_samples())
