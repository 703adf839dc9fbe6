"""Settings for every test run in this repository (the plugins' tests included)."""

import os

# The tests compile hundreds of small programs for the CPU and run each once or twice, so LLVM's
# optimisation of the machine code costs more than it saves: -O0 halves the compile time of the
# larger ones (kda's chunked backward: 6.1 s -> 3.0 s). XLA's own HLO passes still run, so the
# programs compute the same operations; the compile-only TPU programs are not affected.
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"]))
