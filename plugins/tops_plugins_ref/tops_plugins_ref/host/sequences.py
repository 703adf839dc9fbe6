"""How the ``[B, T]`` tokens of a call split into sequences, padded side by side for a vectorised sweep."""

from __future__ import annotations

import numpy as np


class Sequences:
    """``N`` sequences padded to the longest length ``L``, laid out step-major: ``[L, N, ...]``.

    Without ``cu_seqlens`` each of the ``B`` batch rows is one sequence of ``T`` tokens (no
    padding), so packed and unpacked calls share one code path. Padding steps read zeros and
    ``valid`` marks them, so the sweep can leave the state alone there.
    """

    def __init__(self, cu_seqlens: np.ndarray | None, batch: int, seq_len: int):
        if cu_seqlens is None:
            bounds = np.arange(batch + 1) * seq_len
        else:
            bounds = np.asarray(cu_seqlens, np.int64)
            # The core validates boundaries, or replaces invalid traced ones, before any implementation
            # sees them; this cheap guard only keeps a broken guarantee from indexing out of range.
            if bounds[0] != 0 or np.any(np.diff(bounds) < 0) or bounds[-1] != seq_len:
                raise ValueError(f"ref.recurrent was handed invalid cu_seqlens {bounds.tolist()} for T = {seq_len}")
        self.batch, self.seq_len = batch, seq_len
        self.count = len(bounds) - 1
        starts, lengths = bounds[:-1], np.diff(bounds)
        steps = np.arange(lengths.max())
        self.valid = steps[:, None] < lengths[None, :]  # [L, N]
        # The token each padded step reads; batch * seq_len (one past the end) is a row of zeros.
        self._token_index = np.where(self.valid, starts[None, :] + steps[:, None], batch * seq_len)
        tokens = np.arange(batch * seq_len)
        # side="right" skips empty sequences: a token belongs to the last sequence starting at or before it.
        sequence = np.searchsorted(bounds, tokens, side="right") - 1
        self._padded_position = (tokens - starts[sequence]) * self.count + sequence  # into the flattened [L * N]

    @property
    def length(self) -> int:
        """``L``, the number of steps of the sweep."""
        return self.valid.shape[0]

    def pad(self, x: np.ndarray) -> np.ndarray:
        """``[B, T, ...]`` tokens to ``[L, N, ...]`` steps."""
        flat = x.reshape(self.batch * self.seq_len, *x.shape[2:])
        with_zero_row = np.concatenate([flat, np.zeros((1, *flat.shape[1:]), flat.dtype)])
        return with_zero_row[self._token_index]

    def unpad(self, steps: np.ndarray) -> np.ndarray:
        """``[L, N, ...]`` steps back to ``[B, T, ...]`` tokens, dropping the padding."""
        flat = steps.reshape(self.length * self.count, *steps.shape[2:])[self._padded_position]
        return flat.reshape(self.batch, self.seq_len, *steps.shape[2:])
