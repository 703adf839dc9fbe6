"""Compile for a TPU on a host without one, and read what the compiled program does.

With ``libtpu`` installed (``pip install libtpu``; the ``test`` extra has it), JAX describes the
devices of a TPU topology that is not attached (``jax.experimental.topologies``), and programs
lowered for such a device really compile: XLA's TPU compiler lays out the arrays, Mosaic compiles
the Pallas kernels. Nothing runs. ``compile_for`` places abstract arguments on such a device and
compiles; ``ProgramFacts`` reads the compiled program: its Mosaic kernels, the relayout copies XLA
put around them, which implementation each op came from (the dispatcher names its calls
``<implementation>.<direction>``), and XLA's cost analysis (which includes the kernels' own
``pl.CostEstimate``).

``DumpingCompiler`` compiles in a child process whose libtpu dumps what it compiled
(``llo``): Mosaic's LLO and the backend's scheduled bundles of every kernel, read back and
deleted after each compile. libtpu reads its flags once, when it loads, so the dumps need a process
of their own; the child also keeps libtpu out of the calling process.

On a host without a TPU, libtpu's start-up prints warnings (it cannot find the TPU's accelerator
type and worker hostnames) and takes a lock shared by every process that loads it;
``quiet_libtpu()`` sets, before libtpu loads, the environment that tells it instead, and does
nothing on a host with a TPU attached.
"""

from __future__ import annotations

import base64
import dataclasses
import glob
import importlib
import json
import math
import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import jax

from tops_core.tpu import fast_paths, llo
from tops_core.tpu.generations import GENERATIONS

NO_TPU_ENVIRONMENT = {
    "TPU_ACCELERATOR_TYPE": "v6e-1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_SKIP_MDS_QUERY": "1",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}
"""What libtpu asks a cloud metadata server for, given instead; and several processes may compile at once."""

_GOOGLE_PCI_VENDOR = "0x1ae0"


def tpu_attached() -> bool:
    """Whether a TPU chip sits on this host's PCI bus (what JAX itself checks before starting libtpu)."""
    return any(pathlib.Path(path).read_text().strip() == _GOOGLE_PCI_VENDOR for path in glob.glob("/sys/bus/pci/devices/*/vendor"))


def quiet_libtpu() -> None:
    """On a host without a TPU, set ``NO_TPU_ENVIRONMENT`` (where unset); effective only before libtpu loads."""
    if not tpu_attached():
        for name, value in NO_TPU_ENVIRONMENT.items():
            os.environ.setdefault(name, value)


class CompileOnlyUnavailable(RuntimeError):
    """No compile-only TPU device here (libtpu is missing, or would not start)."""


def device(generation: str) -> jax.Device:
    """The first device of a compile-only topology of ``generation`` (a key of ``GENERATIONS``)."""
    from jax.experimental import topologies

    quiet_libtpu()
    try:
        return topologies.get_topology_desc(topology_name=GENERATIONS[generation].topology, platform="tpu").devices[0]
    except Exception as error:  # noqa: BLE001 - libtpu missing or failing to start: the caller decides
        raise CompileOnlyUnavailable(f"no compile-only {generation} TPU ({error}); pip install libtpu") from error


def lower_for(generation: str, function: Callable, *args: Any, donate_argnums: tuple[int, ...] = ()) -> jax.stages.Lowered:
    """``jax.jit(function, donate_argnums=...)`` lowered for a ``generation`` TPU; ``args`` are arrays or
    ``ShapeDtypeStruct``s (pytrees).

    The chip is JAX's default device while tracing, as on a TPU host, so the ops know the
    generation they are lowered for (``tops_core.target_chip``) and size their kernels for it.
    """
    chip = device(generation)
    placement = jax.sharding.SingleDeviceSharding(chip)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placement), args)
    with jax.default_device(chip):
        return jax.jit(function, donate_argnums=donate_argnums).lower(*abstract)


def compile_for(generation: str, function: Callable, *args: Any, donate_argnums: tuple[int, ...] = ()) -> jax.stages.Compiled:
    """``lower_for``'s program compiled."""
    return lower_for(generation, function, *args, donate_argnums=donate_argnums).compile()


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(?P<name>\S+) = (?P<shape>.*?) (?P<opcode>[a-z][\w-]*)\((?P<rest>.*)$")
_KERNEL_ESTIMATE = re.compile(r'^\s*(?:ROOT )?%(\S+) = .*custom_call_target="tpu_custom_call".*?"cost_estimate":(\{[^}]*\})', re.MULTILINE)
_RELAYOUT_OPCODES = {"copy", "transpose", "reshape", "pad", "slice", "concatenate"}
_DATA_MOVEMENT = _RELAYOUT_OPCODES | {"parameter", "bitcast", "constant", "broadcast", "tuple", "get-tuple-element"}


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """What kernels told XLA they cost (``pl.CostEstimate``), summed."""

    flops: int = 0
    transcendentals: int = 0
    bytes_accessed: int = 0

    def __add__(self, other: KernelCost) -> KernelCost:
        return KernelCost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclasses.dataclass(frozen=True)
class ProgramFacts:
    """What a compiled program does, read from its optimised HLO and XLA's cost analysis.

    ``relayouts``: instructions of the entry computation (around the kernels, not inside a
    loop) that only copy data into another layout or shape: a ``copy``, ``transpose``,
    non-bitcast ``reshape``, ``pad``, ``slice`` or ``concatenate``, or a fusion of nothing but
    such moves. XLA's moves between memory spaces (``copy-start``/``copy-done``) are not
    relayouts. ``relayout_bytes`` counts each as reading and writing its result, in whole TPU
    tiles (a minor dimension of 16 takes 128 lanes). ``loops``: ``while`` loops, whose body
    XLA's cost analysis counts once, not once per iteration (the costs then understate the
    program). ``implementations``: the ``<implementation>.<direction>`` names the dispatcher gave
    its calls. ``kernel_costs``: each Mosaic kernel's own cost estimate (flops, transcendentals,
    bytes) by its HLO instruction's name; ``kernel_cost`` their sum. ``flops``, ``transcendentals``, ``bytes_accessed``: XLA's cost
    analysis of the whole program, which adds what XLA does around the kernels; its bytes also
    count XLA's prefetches of whole arrays into VMEM, which small programs get.
    """

    kernels: int
    kernel_costs: tuple[tuple[str, KernelCost], ...]
    relayouts: tuple[str, ...]
    relayout_bytes: int
    loops: int
    implementations: frozenset[str]
    flops: float
    transcendentals: float
    bytes_accessed: float

    @property
    def kernel_cost(self) -> KernelCost:
        return sum((cost for _, cost in self.kernel_costs), KernelCost())

    @property
    def hbm_bytes(self) -> int:
        """The kernels' bytes and the relayout copies', as if every array lived in HBM."""
        return self.kernel_cost.bytes_accessed + self.relayout_bytes

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> ProgramFacts:
        cost = compiled.cost_analysis()
        return cls.read(compiled.as_text(), cost[0] if isinstance(cost, list) else cost)

    @classmethod
    def read(cls, text: str, cost: dict[str, float]) -> ProgramFacts:
        """The facts of an optimised HLO module's text and XLA's cost analysis of it."""
        computations, entry = _computations(text)
        relayouts, moved = [], 0
        for line in computations[entry]:
            match = _INSTRUCTION.match(line)
            if match is None:
                continue
            opcode = match["opcode"]
            if opcode == "fusion":
                callee = re.search(r"calls=%([\w.-]+)", line)
                only_moves = callee and all(
                    (m := _INSTRUCTION.match(inner)) is None or m["opcode"] in _DATA_MOVEMENT for inner in computations.get(callee[1], [])
                )
                if not only_moves:
                    continue
            elif opcode not in _RELAYOUT_OPCODES:
                continue
            relayouts.append(f"{opcode} {match['shape'].split('{')[0]}")
            moved += 2 * _array_bytes(match["shape"])
        estimates = tuple(
            (name, KernelCost(*(int(field[key]) for key in ("flops", "transcendentals", "bytes_accessed"))))
            for name, field in ((m[1], json.loads(m[2])) for m in _KERNEL_ESTIMATE.finditer(text))
        )
        return cls(
            kernels=text.count('custom_call_target="tpu_custom_call"'),
            kernel_costs=estimates,
            relayouts=tuple(relayouts),
            relayout_bytes=moved,
            loops=sum(1 for body in computations.values() for line in body if (m := _INSTRUCTION.match(line)) and m["opcode"] == "while"),
            implementations=frozenset(re.findall(r"/([a-z][a-z0-9_]*\.[a-z][a-z0-9_]*\.(?:forward|backward))(?:/|\")", text)),
            flops=float(cost.get("flops", 0.0)),
            transcendentals=float(cost.get("transcendentals", 0.0)),
            bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        )


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    """The instruction lines of every computation in an HLO module, by name, and the entry's name."""
    computations: dict[str, list[str]] = {}
    current, entry = None, ""
    for line in text.splitlines():
        header = re.match(r"^(ENTRY )?%([\w.-]+) .*\{\s*$", line)
        if header:
            current = computations.setdefault(header[2], [])
            entry = header[2] if header[1] else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return computations, entry


_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_SHAPE = re.compile(r"\(?(?P<dtype>\w+)\[(?P<dims>[\d,]*)\](?:\{(?P<order>[\d,]*)(?::T\((?P<tile>\d+),(?P<lanes>\d+)\))?)?")


def _array_bytes(shape: str) -> int:
    """Bytes an HLO array occupies, such as ``f32[8,4096,16]{2,1,0:T(8,128)}``: its two most minor
    dimensions rounded up to its (first-level) tile, here 8 rows by 128 lanes (so 8x the 16 values)."""
    match = _SHAPE.match(shape)
    if match is None or match["dtype"] not in _ITEM_BYTES:
        return 0
    dims = [int(d) for d in match["dims"].split(",") if d]
    if match["tile"] and len(dims) >= 2:
        order = [int(d) for d in match["order"].split(",")]  # minor to major
        minor, second = order[0], order[1]
        dims[minor] = -(-dims[minor] // int(match["lanes"])) * int(match["lanes"])
        rows = int(match["tile"])
        dims[second] = -(-dims[second] // rows) * rows
    count = 1
    for size in dims:
        count *= size
    return count * _ITEM_BYTES[match["dtype"]]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program: its opcode (``all-reduce``, ``collective-permute``...,
    an asynchronous one's ``-start`` dropped), the array it moves and that array's bytes."""

    opcode: str
    shape: str
    bytes: int


_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter", "collective-broadcast")


def collectives(text: str) -> tuple[Collective, ...]:
    """The collectives of an optimised HLO module's text (any platform), each counted once.

    The bytes are the logical size of the array a device sends or contributes: the operand of an
    asynchronous ``-start`` (the first element of its result tuple), the result otherwise.
    """
    found = []
    for line in text.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        opcode = match["opcode"].removesuffix("-start")
        if opcode not in _COLLECTIVES or match["opcode"].endswith("-done"):
            continue
        shapes = [_SHAPE.match(part) for part in re.findall(r"\w+\[[\d,]*\]", match["shape"])]
        moved = shapes[:1] if match["opcode"].endswith("-start") else shapes
        size = sum(_ITEM_BYTES.get(m["dtype"], 0) * math.prod(int(d) for d in m["dims"].split(",") if d) for m in moved if m)
        found.append(Collective(opcode, ", ".join(f"{m['dtype']}[{m['dims']}]" for m in moved if m), size))
    return tuple(found)


@dataclasses.dataclass(frozen=True)
class Dumped:
    """A program compiled by ``DumpingCompiler``: what ``ProgramFacts`` reads, every kernel as libtpu
    dumped it, and the TensorCores of the device it was compiled for (a v4 device is one of its chip's two).
    A program without a Mosaic kernel is only lowered: no facts, no kernels. ``fast_arms``: the fast arms its kernels
    choose from their data (``fast_paths.choose``), by name."""

    facts: ProgramFacts | None
    kernels: tuple[llo.DumpedKernel, ...]
    cores: int
    fast_arms: tuple[str, ...] = ()


def without_cpu_backend_flags(flags: str) -> str:
    """``XLA_FLAGS`` less the CPU backend's own flags (``--xla_cpu_...``): libtpu parses the same variable
    with its own XLA, which does not know them, and aborts on a flag it does not know."""
    return " ".join(flag for flag in flags.split() if not flag.startswith("--xla_cpu_"))


def child_environment(environment: dict[str, str] | None = None) -> dict[str, str]:
    """The variables of a child process that compiles for compile-only TPUs: the caller's, ``JAX_PLATFORMS=cpu``,
    ``environment`` over them, ``XLA_FLAGS`` without the CPU backend's flags, and libtpu's no-TPU environment where
    no TPU is attached."""
    variables = {**os.environ, "JAX_PLATFORMS": "cpu", **(environment or {})}
    variables["XLA_FLAGS"] = without_cpu_backend_flags(variables.get("XLA_FLAGS", ""))
    return variables if tpu_attached() else {**NO_TPU_ENVIRONMENT, **variables}


class LineWorker:
    """A Python child process on CPU (libtpu's no-TPU environment unless a TPU is attached): one request
    per line in, one answer per line out.

    ``DumpingCompiler`` and the tests' workers use it to keep libtpu (its dump flags, its start-up
    warnings) or a host device count out of the calling process. ``command``: the interpreter's
    arguments (a script or ``-m module``); ``environment``: variables over the caller's.
    """

    def __init__(self, command: list[str], environment: dict[str, str] | None = None):
        variables = child_environment(environment)
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._process = subprocess.Popen(
            [sys.executable, *command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=variables,
        )

    def ask(self, request: str) -> str | None:
        """The answer line to ``request`` (one line), or None when the process has stopped (``stderr_tail`` says why)."""
        self._process.stdin.write(request + "\n")
        self._process.stdin.flush()
        return self._process.stdout.readline() or None

    def stderr_tail(self, size: int = 4000) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-size:]

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            self._process.wait(timeout=60)
        self._stderr.close()


class DumpingCompiler:
    """Compiles for compile-only TPUs in a child process whose libtpu dumps every Mosaic kernel (``llo``).

    ``compile(generation, factory, **arguments)`` imports ``factory`` (``"package.module:function"``)
    in the child, calls it with ``arguments`` (JSON values) to get ``(function, *args)``, compiles
    ``function`` for ``generation`` as ``compile_for`` does and reads the dumps, which are deleted
    before the next compile; the directory goes when the compiler closes. Use it as a context manager.
    An error in the child is raised here: ``CompileOnlyUnavailable`` as it is (no libtpu), anything
    else as a ``RuntimeError`` with the child's traceback.
    """

    def __init__(self):
        self.directory = tempfile.mkdtemp(prefix="tops-tpu-dump-")
        self._worker = LineWorker(["-m", "tops_core.tpu.compile_only"], {"LIBTPU_INIT_ARGS": llo.dump_flags(self.directory)})

    def compile(self, generation: str, factory: str, **arguments: Any) -> Dumped:
        line = self._worker.ask(json.dumps({"generation": generation, "factory": factory, "arguments": arguments}))
        if line is None:
            raise CompileOnlyUnavailable(f"the dumping compiler stopped: {self._worker.stderr_tail(2000)}")
        reply = pickle.loads(base64.b64decode(line))
        if isinstance(reply, CompileOnlyUnavailable):
            raise reply
        if isinstance(reply, str):
            raise RuntimeError(f"compiling {factory}({arguments}) for {generation} failed in the dumping compiler:\n{reply}")
        return reply

    def close(self) -> None:
        self._worker.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> DumpingCompiler:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _serve_dumping_compiler() -> None:
    """The child of ``DumpingCompiler``: one JSON request per line in, one base64 pickle per line out."""
    import traceback

    directory = pathlib.Path(re.search(r"--xla_mosaic_dump_to=(\S+)", os.environ["LIBTPU_INIT_ARGS"])[1])
    for line in sys.stdin:
        request = json.loads(line)
        try:
            module, name = request["factory"].split(":")
            function, *args = getattr(importlib.import_module(module), name)(**request["arguments"])
            with fast_paths.recording() as choices:
                lowered = lower_for(request["generation"], function, *args)
            if "tpu_custom_call" in lowered.as_text():
                reply: Any = Dumped(ProgramFacts.of(lowered.compile()), tuple(llo.read_directory(directory)),
                                    device(request["generation"]).num_cores, fast_arms=tuple(dict.fromkeys(choices)))
            else:  # no Mosaic kernel to dump: XLA's own code is not compiled (and not dumped), which takes long
                reply = Dumped(None, (), device(request["generation"]).num_cores)
        except CompileOnlyUnavailable as error:
            reply = error
        except Exception:  # noqa: BLE001 - reported to the parent, which raises it
            reply = traceback.format_exc()
        finally:
            for path in directory.iterdir():
                path.unlink()
        print(base64.b64encode(pickle.dumps(reply)).decode(), flush=True)


if __name__ == "__main__":
    from tops_core.tpu.compile_only import _serve_dumping_compiler as serve  # this module's classes, not __main__'s, in the pickles

    serve()
