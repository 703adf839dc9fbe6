"""Config fields the kernels share: chunk size, chunks per grid step, and interpret mode."""

from __future__ import annotations

from typing import Any

from jax.experimental.pallas import tpu as pltpu

CHUNK_SIZES = (64, 128)


def check_common_fields(config: Any, chunk_sizes: tuple = CHUNK_SIZES) -> None:
    """Raise TypeError/ValueError naming the field when ``chunk_size`` (one of ``chunk_sizes``), ``num_steps`` or ``interpret`` is invalid."""
    name = type(config).__name__
    if config.chunk_size not in chunk_sizes or isinstance(config.chunk_size, bool):
        raise ValueError(f"{name}.chunk_size must be one of {chunk_sizes}, got {config.chunk_size!r}")
    resolved_per_call = config.num_steps is None and hasattr(config, "TPU_NUM_STEPS")  # grid.steps_of
    if not resolved_per_call and (not isinstance(config.num_steps, int) or isinstance(config.num_steps, bool) or config.num_steps < 1):
        raise ValueError(f"{name}.num_steps must be an int >= 1, got {config.num_steps!r}")
    check_interpret(config)


def check_interpret(config: Any) -> None:
    """Raise TypeError naming the field when ``interpret`` is not None, a bool or a ``pltpu.InterpretParams``."""
    name = type(config).__name__
    if not (config.interpret is None or isinstance(config.interpret, (bool, pltpu.InterpretParams))):
        raise TypeError(
            f"{name}.interpret must be None (compile where lowered for a TPU, interpret elsewhere), True (the fast interpreter), "
            f"a pltpu.InterpretParams (the faithful one) or False (always compile with Mosaic, e.g. to "
            f"lower for TPU ahead of time on a host without one), got {config.interpret!r}"
        )
