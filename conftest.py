"""Settings for every test run in this repository (the plugins' tests included)."""

import os

# The tests compile hundreds of small programs for the CPU and run each once or twice, so LLVM's
# optimisation of the machine code costs more than it saves: -O0 halves the compile time of the
# larger ones (kda's chunked backward: 6.1 s -> 3.0 s). XLA's own HLO passes still run, so the
# programs compute the same operations; the compile-only TPU programs are not affected. For the same
# reason the CPU backend's older fusion emitter, which compiles a fusion in a fraction of the new
# emitters' time (a kda kit case: 4.7 s -> 2.3 s); the workers that load libtpu drop the CPU flags
# (``compile_only.without_cpu_backend_flags``).
os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
]))

# The README's test command runs the tests in parallel worker processes (pytest-xdist), and more
# than one of them may load libtpu for the compile-only TPU checks; libtpu refuses a second process
# on the same host unless told that is intended. Compile-only use shares no device.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402  (after XLA_FLAGS above, which jax reads when its CPU backend starts)
import pytest  # noqa: E402

MAPS_BEFORE_CLEARING = 30_000
"""Memory maps of the test process above which JAX's compiled programs are dropped after a test (Linux allows 65530)."""


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux: no such limit to keep under
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Drop JAX's compiled programs when the process holds many memory maps. Every CPU executable XLA keeps holds maps
    of its machine code, and a test worker that had compiled a few thousand programs reached Linux's limit of 65530
    maps per process (``vm.max_map_count``), where the next large compile failed with a segmentation fault in XLA
    (the conformance kit's module alone held 47 000). Reading the count costs about a millisecond per test."""
    yield
    if _memory_maps() > MAPS_BEFORE_CLEARING:
        jax.clear_caches()
