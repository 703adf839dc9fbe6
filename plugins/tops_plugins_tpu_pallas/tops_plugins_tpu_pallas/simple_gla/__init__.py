"""simple_gla's Pallas TPU kernels: the forwards ``fused``, ``chunk`` and ``varlen`` (packed sequences),
each with its own backward (``backward_fused``, ``backward_split``, ``backward_varlen``, sharing
``gradients``), and one chunk's math for all of them in ``chunkwise``; ``recurrent``, the decode kernel's inputs."""

from tops_plugins_tpu_pallas.simple_gla import backward_fused, backward_split, backward_varlen, chunk, chunkwise, fused, gradients, recurrent, varlen

__all__ = ["backward_fused", "backward_split", "backward_varlen", "chunk", "chunkwise", "fused", "gradients", "recurrent", "varlen"]
