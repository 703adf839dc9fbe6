"""gla's Pallas TPU kernels: ``tpu_pallas.fused`` and, packed, ``tpu_pallas.varlen`` (``fused``: kda's machinery with
the chunk math of ``chunkwise``), and the decode kernel (``recurrent``)."""

from tops_plugins_tpu_pallas.gla import chunkwise, fused, recurrent

__all__ = ["chunkwise", "fused", "recurrent"]
