"""gated_delta_rule's Pallas TPU kernels: the fused forward (``fused``, its chunk math in ``chunkwise``) and the
decode kernel (``recurrent``)."""

from tops_plugins_tpu_pallas.gated_delta_rule import chunkwise, fused, recurrent

__all__ = ["chunkwise", "fused", "recurrent"]
