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
