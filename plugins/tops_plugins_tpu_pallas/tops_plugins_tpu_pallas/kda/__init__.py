"""KDA's Pallas TPU kernels: ``tpu_pallas.fused`` (the forward in ``fused``, one chunk's math in ``chunkwise``, its
backward in ``backward``) and ``tpu_pallas.varlen`` for packed sequences (``varlen``: the same forward with a state
reset at every sequence start); ``recurrent``, the decode kernel's inputs."""

from tops_plugins_tpu_pallas.kda import backward, chunkwise, fused, recurrent, varlen

__all__ = ["backward", "chunkwise", "fused", "recurrent", "varlen"]
