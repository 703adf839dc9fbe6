"""KDA's Pallas TPU forward, ``tpu_pallas.fused`` for kda: the kernel in ``fused``, one chunk's math in ``chunkwise``."""

from tops_plugins_tpu_pallas.kda import chunkwise, fused

__all__ = ["chunkwise", "fused"]
