"""The config every ``xla.chunk`` implementation shares: how many tokens a chunk holds."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Tuning of ``xla.chunk``: ``chunk_size`` tokens per chunk (a power of two, 16 to 256)."""

    chunk_size: int = 64

    def __post_init__(self):
        size = self.chunk_size
        if isinstance(size, bool) or not isinstance(size, int) or not 16 <= size <= 256 or size & (size - 1):
            raise ValueError(f"chunk_size must be a power of two from 16 to 256, got {size!r}")
