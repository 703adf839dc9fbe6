"""KDA's Pallas TPU forwards: ``tpu_pallas.fused`` (the kernel in ``fused``, one chunk's math in ``chunkwise``) and
``tpu_pallas.varlen`` for packed sequences (``varlen``: the same kernel with a state reset at every sequence start)."""

from tops_plugins_tpu_pallas.kda import chunkwise, fused, varlen

__all__ = ["chunkwise", "fused", "varlen"]
