"""What tops knows about TPUs, apart from the runtime that dispatches calls.

- ``generations``: each generation's figures (HBM bandwidth, peak flops, VMEM, MXU, TensorCores),
  with their sources; the runtime sizes kernels by them too;
- ``compile_only``: compile for a TPU that is not attached (libtpu's compile-only devices), and read
  the compiled program;
- ``llo``: what a compiled Mosaic kernel issues, read from libtpu's dumps;
- ``model``: ``tops bench``'s modelled TPU section, built from the three above.

Importing this package imports none of them.
"""
