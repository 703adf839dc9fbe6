"""gla's Pallas TPU kernels: the decode kernel (``recurrent``)."""

from tops_plugins_tpu_pallas.gla import recurrent

__all__ = ["recurrent"]
