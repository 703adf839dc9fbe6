"""What a compiled Mosaic kernel does on a TPU, read from the compiler's own dumps.

libtpu writes two dumps when it starts with ``LIBTPU_INIT_ARGS=dump_flags(directory)`` (the flags
are read once, when libtpu loads, so ``compile_only.DumpingCompiler`` compiles in a child process):

- **Mosaic's final LLO** (``*-post-finalize-llo.txt``): the kernel body as instructions on whole
  vector registers, before the TPU backend schedules it. ``read_mosaic`` counts them by unit:
  MXU pushes (and the rows each push streams through the systolic array), weight loads, results,
  EUP transcendentals (``exp``), XLU transposes, other vector ALU operations, vector loads and
  stores. Loops with constant bounds multiply their bodies; a conditional body (``scf.if``) is
  counted as if it always ran, so the counts are an upper bound on what one grid step runs.
- **The TPU backend's final VLIW bundles** (``*-final_bundles.txt``): the scheduled program, one
  bundle issued per cycle when nothing stalls. ``read_bundles`` sums the bundles of every loop
  times its trip count (the compiler's own ``loop exit test``): the cycles one TensorCore issues
  for the whole kernel, dependency chains included, stalls (DMA waits, results not yet ready)
  excluded. A grid whose parallel axes are split over a chip's two TensorCores (v5p) runs half its
  steps on each, and the grid loop says so. The grid loop runs two more trips than the steps it
  computes (Mosaic's pipeline: the first only starts the first step's copies in, the last only
  waits for the last step's copies out), and a branch skips the kernel's body on those two:
  ``DumpedKernel.cycles`` counts that body once per step it computes.

Both readers are generic: they read the dump of any Mosaic kernel. The file formats are libtpu's
internal debug output (checked with libtpu 0.0.52), not a stable interface; a format they do not
recognise gives no kernels rather than wrong ones.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import pathlib
import re

MOSAIC_SUFFIX = "-post-finalize-llo.txt"
BUNDLES_SUFFIX = "-final_bundles.txt"
PIPELINE_TRIPS = 2
"""The grid loop's trips that compute no step: the first starts the first step's copies in, the last waits for the last step's copies out."""


def dump_flags(directory: str) -> str:
    """libtpu flags that dump Mosaic's final LLO and the backend's final bundles into ``directory`` (and nothing else)."""
    return (
        f"--xla_mosaic_dump_to={directory} --xla_jf_dump_to={directory} --xla_jf_dump_llo_text=true "
        "--xla_jf_dump_llo_pass_label_regex=^final_bundles$ --xla_jf_dump_hlo_text=false"
    )


class _Sums:
    """Counts that add field by field and scale (a dataclass's fields, in order, are its ``__dict__``: no copies, as
    ``dataclasses.astuple`` makes, which took most of the time a dump is read in)."""

    def __add__(self, other):
        return type(self)(*map(operator.add, self.__dict__.values(), other.__dict__.values()))

    def __mul__(self, times: int):
        return type(self)(*(a * times for a in self.__dict__.values()))


@dataclasses.dataclass(frozen=True)
class UnitCounts(_Sums):
    """Vector instructions by the unit that runs them (each on one vector register, 8 x 128 32-bit words).

    ``mxu_rows``: the LHS rows the pushes stream through the systolic arrays (8 per 32-bit register,
    16 per packed bf16 one); the MXU's time is proportional to them.
    """

    mxu_pushes: int = 0
    mxu_rows: int = 0
    weight_loads: int = 0
    mxu_results: int = 0
    transcendentals: int = 0
    transposes: int = 0
    vector_alu: int = 0
    loads: int = 0
    stores: int = 0


@dataclasses.dataclass(frozen=True)
class Issued(_Sums):
    """The vector instructions a scheduled program issues, by the VLIW slots they take (the backend's mnemonics).

    Unlike ``UnitCounts`` (Mosaic's instructions, before the backend) these hold what the backend adds, register
    spills to VMEM and back, and lack what it folds away (a product's sum with a zero accumulator, which the MXU's
    result buffer takes; several products summed there before one pop, as float32's passes on v6e). Read off libtpu
    0.0.52's bundles, the most of each kind in one bundle are the chip's slots in ``generations``: mask-register
    operations (``_MASKS``) and moves to scalars (``vstv``) issue beside them, and are not counted here.
    ``result_pops``: every ``vpop`` (the MXU's results, the EUP's, the XLU's), which share two slots.
    """

    vector_alu: int = 0
    loads: int = 0
    stores: int = 0
    spill_loads: int = 0  # of ``loads``: the register allocator's reloads
    spill_stores: int = 0
    xlu: int = 0  # transposes, lane permutes and broadcasts, cross-lane reductions
    eup: int = 0  # transcendental pushes
    result_pops: int = 0


@dataclasses.dataclass(frozen=True)
class MosaicKernel:
    """One kernel's Mosaic LLO: its grid and what one grid step runs."""

    name: str
    grid: tuple[int, ...]
    per_step: UnitCounts

    @property
    def steps(self) -> int:
        return math.prod(self.grid)

    @property
    def total(self) -> UnitCounts:
        return self.per_step * self.steps


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One kernel's scheduled VLIW program: ``bundles`` written, ``cycles`` issued (loops times their trip counts).

    ``loops``: ``(trip count, bundles at that depth)`` for each loop, outermost first.
    """

    name: str
    bundles: int
    cycles: int
    loops: tuple[tuple[int, int], ...]
    issued: Issued = Issued()  # on every trip of every loop, as ``cycles``
    traced_loop_cycles: int = 0  # of ``cycles``, those inside loops whose trip count is traced (no constant exit test): once each
    body_cycles: int = 0  # one trip of the outermost loop's body: the bundles its largest forward branch skips (``_body``)
    body_issued: Issued = Issued()


# -- Mosaic's final LLO -------------------------------------------------------------------

_TRANSCENDENTAL = re.compile(r"^v(exp|exp2|log|log2|pow2|rcp|rsqrt|sqrt|tanh|sin|cos|erf|logistic|sigmoid)\b")
_FREE = {"vbitcast", "vmatprep.mubr"}  # a reinterpretation; the first half of a push's operand (v6e)
_OP = re.compile(r'^\s*(?:%[\w#.-]+(?:, %[\w#.-]+)* = )?"?llo\.([\w.]+)"?')
_VECTOR = re.compile(r"vector<((?:\d+x)+)\w+>")
_FUNC = re.compile(r"func\.func @([\w.-]+)\(")
_GRID = re.compile(r"iteration_bounds = array<i64: ([\d, ]+)>")
_CONSTANT = re.compile(r"^\s*(%[\w#.-]+) = llo\.constant \{value = (-?\d+) : [su]?i\d+\}")
_FOR = re.compile(r"scf\.for %\S+ = (%[\w#.-]+) to (%[\w#.-]+) step (%[\w#.-]+)")


def _unit(op: str, line: str) -> UnitCounts | None:
    if op in _FREE or not op.startswith("v"):
        return None  # scalar-unit instructions (s...) and free ones
    if op.startswith("vmatmul"):
        vector = _VECTOR.search(line.split(":")[-1]) or _VECTOR.search(line)
        dims = [int(d) for d in vector[1].rstrip("x").split("x")] if vector else [8]
        return UnitCounts(mxu_pushes=1, mxu_rows=dims[0] * (dims[2] if len(dims) > 2 else 1))
    if op.startswith(("vlatch", "vmatpush", "vmatprep.subr")):
        return UnitCounts(weight_loads=1)
    if op.startswith(("vmatres", "vdwg")):
        return UnitCounts(mxu_results=int(op.startswith("vmatres")))
    if _TRANSCENDENTAL.match(op):
        return UnitCounts(transcendentals=1)
    if op.startswith("vxpose"):
        return UnitCounts(transposes=int(op == "vxpose"))
    if op == "vector_load":
        return UnitCounts(loads=1)
    if op == "vector_store":
        return UnitCounts(stores=1)
    return UnitCounts(vector_alu=1)


def read_mosaic(text: str) -> list[MosaicKernel]:
    """The kernels (functions with a grid) of one Mosaic final-LLO dump, with what one grid step runs."""
    kernels = []
    name, grid, counts, constants, stack = None, (), UnitCounts(), {}, []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("}"):
            if stack:
                stack.pop()
            if not stack and name is not None:
                if grid:
                    kernels.append(MosaicKernel(name, grid, counts))
                name = None
            if stripped.endswith("{"):  # } else {
                stack.append(1)
            continue
        func = _FUNC.search(line)
        if func:
            name, counts, constants = func[1], UnitCounts(), {}
            bounds = _GRID.search(line)
            grid = tuple(int(b) for b in bounds[1].split(",")) if bounds else ()
            stack = [1]
            continue
        if name is None:
            continue
        constant = _CONSTANT.match(line)
        if constant:
            constants[constant[1]] = int(constant[2])
            continue
        if stripped.endswith("{"):
            loop = _FOR.search(line)
            trip = 1
            if loop:
                start, stop, step = (constants.get(loop[i]) for i in (1, 2, 3))
                if None not in (start, stop, step) and step > 0:
                    trip = max(0, -(-(stop - start) // step))
            stack.append(trip)
            continue
        op = _OP.match(line)
        unit = _unit(op[1], line) if op else None
        if unit is not None:
            counts = counts + unit * math.prod(stack)
    return kernels


# -- the backend's final bundles -------------------------------------------------------------

_BUNDLE = re.compile(r"^\s*(?:0x[0-9a-f]+|0)\s+(?:(\w+):|:)\s*(>*)\s*\{")
_EXIT_TEST = re.compile(r"scmp\.\w+\.s32\.totalorder %[\w]+, (\d+) /\* loop exit test \*/")
_BRANCH = re.compile(r"sbr\.rel \(!?%\w+\) target = \$region(\d+)")
_INSTRUCTION = re.compile(r"^\s*(?:%\S+ = )?(v[\w.]*)")
_XLU = ("vxpose", "vperm", "vrot.lane", "vbcast")
_MASKS = ("vmand", "vmor", "vmxor", "vmneg", "vmmov", "vmpackc", "vcmask", "vsmask")
_NOT_SLOTTED = (*_MASKS, "vstv", "vdwg", "vdelay", "vsync", "vwait", "vtrace", "vset", "vint", "vpush")  # and the MXU's own (vmat...)
_HLO_NAME = re.compile(r"^hlo: (\S+)", re.MULTILINE)
_BUNDLES_FILE = re.compile(r"^\d+-(.+)-\d+" + re.escape(BUNDLES_SUFFIX) + "$")  # <id>-<HLO instruction>-<pass number>-final_bundles.txt


def _issued(bundle: str) -> Issued:
    """One bundle's vector instructions (a line of the dump, ``{ a ;; b ;; ... }``) by slot (``Issued``)."""
    counts = {field.name: 0 for field in dataclasses.fields(Issued)}
    inside = bundle[bundle.index("{") + 1 :]
    for instruction in inside[: inside.rfind("}")].split(";;"):
        match = _INSTRUCTION.match(instruction)
        if not match:
            continue
        op, spilled = match[1], "_spill]" in instruction
        if op.startswith("vld"):
            counts["loads"] += 1
            counts["spill_loads"] += spilled
        elif op.startswith("vst") and not op.startswith("vstv"):
            counts["stores"] += 1
            counts["spill_stores"] += spilled
        elif op.startswith("vpop"):
            counts["result_pops"] += 1
        elif _TRANSCENDENTAL.match(op):
            counts["eup"] += 1
        elif op.startswith(_XLU) or ".xlane" in op:
            counts["xlu"] += 1
        elif not op.startswith(("vmat", *_NOT_SLOTTED)):
            counts["vector_alu"] += 1
    return Issued(**counts)


def read_bundles(text: str, name: str = "") -> Schedule:
    """The issued cycles of one kernel's final-bundle dump: every bundle times the trip counts of its enclosing loops.

    A loop starts at a bundle labelled ``LB`` with one more ``>`` of depth than its surroundings;
    its trip count is the constant of the first ``loop exit test`` at its depth (1 when none is
    found: a loop whose trip count is traced, such as a packed kernel's loop over the sequences
    with a boundary in a chunk, counts once, whatever it runs; ``Schedule.traced_loop_cycles``
    says how much of the total such loops are).
    """
    bundles = []
    for line in text.splitlines():
        match = _BUNDLE.match(line)
        if match:
            bundles.append((match[1], len(match[2]), line))
    open_loops: dict[int, int | None] = {}  # depth -> trip count of the innermost loop seen at that depth (None: traced)
    loops: list[list[int]] = []
    current: dict[int, list[int]] = {}
    times = []  # each bundle's cycles: 1 times the trips of its loops
    traced = 0
    for index, (label, depth, line) in enumerate(bundles):
        if label == "LB":
            open_loops[depth] = _trip_count(bundles, index, depth)
            current[depth] = [open_loops[depth] or 1, 0]
            loops.append(current[depth])
        if depth in current:
            current[depth][1] += 1
        enclosing = [open_loops.get(level, 1) for level in range(1, depth + 1)]
        times.append(math.prod(trip or 1 for trip in enclosing))
        traced += times[-1] if None in enclosing else 0
    issued = [_issued(line) for _, _, line in bundles]
    hlo = _HLO_NAME.search(text)
    outer = tuple((trip, count) for trip, count in loops)
    body = _body(bundles, outer[0]) if outer else range(0)
    per_trip = [each // outer[0][0] for each in times[body.start:body.stop]] if outer else []
    return Schedule(
        name or (hlo[1] if hlo else ""), len(bundles), sum(times), outer,
        issued=sum((counts * each for counts, each in zip(issued, times)), Issued()), traced_loop_cycles=traced,
        body_cycles=sum(per_trip),
        body_issued=sum((counts * each for counts, each in zip(issued[body.start:body.stop], per_trip)), Issued()),
    )


def _body(bundles: list[tuple[str | None, int, str]], outermost: tuple[int, int]) -> range:
    """The bundles of the outermost loop that its largest forward conditional branch skips, when they are most of the
    loop (the kernel's body, which the grid loop's pipeline trips skip); none otherwise."""
    _, loop_bundles = outermost
    largest = (0, 0)
    for index, (_, depth, line) in enumerate(bundles):
        branch = _BRANCH.search(line)
        if depth != 1 or not branch:
            continue
        target = re.compile(rf"\bregion {branch[1]}\b")
        end = next((later for later in range(index + 1, len(bundles)) if target.search(bundles[later][2])), None)
        if end is not None and end - index > largest[1] - largest[0]:
            largest = (index + 1, end)
    start, end = largest
    return range(start, end) if 2 * (end - start) >= loop_bundles else range(0)


def _trip_count(bundles: list[tuple[str | None, int, str]], start: int, depth: int) -> int | None:
    for label, level, line in bundles[start:]:
        if level < depth and level != 0:
            break
        if level == depth:
            test = _EXIT_TEST.search(line)
            if test:
                return int(test[1])
    return None


# -- a dump directory ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DumpedKernel:
    """A kernel as both dumps describe it; ``name`` is its HLO instruction's (``<pallas_call name>.<n>``)."""

    name: str
    mosaic: MosaicKernel
    schedule: Schedule

    @property
    def cycles(self) -> int:
        """The cycles one TensorCore issues for the kernel: the schedule's, less the body on the grid loop's two
        pipeline trips where the loop's trips are the grid's steps (or half of them, split over two TensorCores)
        and two more; the schedule's as it is otherwise."""
        return self.schedule.cycles - self._pipeline_trips() * self.schedule.body_cycles

    @property
    def traced_loop_cycles(self) -> int:
        """Of ``cycles``, those in loops of traced trip counts (each counted once), the pipeline trips taken out in
        proportion."""
        return round(self.schedule.traced_loop_cycles * self.cycles / max(self.schedule.cycles, 1))

    @property
    def issued(self) -> Issued:
        """The instructions one TensorCore issues for the kernel, by slot; the body counted as in ``cycles``."""
        return self.schedule.issued + self.schedule.body_issued * -self._pipeline_trips()

    def _pipeline_trips(self) -> int:
        trips = self.schedule.loops[0][0] if self.schedule.loops else 0
        computed = trips - PIPELINE_TRIPS in {self.mosaic.steps, -(-self.mosaic.steps // 2)}
        return PIPELINE_TRIPS if self.schedule.body_cycles and computed else 0


def read_directory(directory: str | pathlib.Path) -> list[DumpedKernel]:
    """Every Mosaic kernel dumped in ``directory``, matched with its final bundles by name.

    The bundle dump is named after the kernel's HLO instruction (``simple_gla_fused.1``), the
    Mosaic dump holds the kernel's own name (``simple_gla_fused``); kernels of the same name are
    matched in the order the compiler wrote them.
    """
    directory = pathlib.Path(directory)
    mosaic: dict[str, list[MosaicKernel]] = {}
    for path in sorted(directory.glob(f"*{MOSAIC_SUFFIX}")):
        for kernel in read_mosaic(path.read_text()):
            mosaic.setdefault(kernel.name, []).append(kernel)
    dumped = []
    for path in sorted(directory.glob(f"*{BUNDLES_SUFFIX}")):
        named = _BUNDLES_FILE.match(path.name)
        if not named:
            continue
        schedule = read_bundles(path.read_text(), named[1])
        base = re.sub(r"\.\d+$", "", schedule.name)
        if mosaic.get(base):
            dumped.append(DumpedKernel(schedule.name, mosaic[base].pop(0), schedule))
    return dumped
