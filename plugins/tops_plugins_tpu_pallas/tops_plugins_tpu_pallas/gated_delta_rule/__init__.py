"""gated_delta_rule's Pallas TPU kernels: the decode kernel (``recurrent``)."""

from tops_plugins_tpu_pallas.gated_delta_rule import recurrent

__all__ = ["recurrent"]
