"""Token-by-token sweeps over padded sequences: forward, and the reverse sweep of the exact VJP.

A recurrence is given as two NumPy functions over one step of all ``N`` sequences at once:

- ``step(state, token) -> (next_state, output)``;
- ``step_vjp(state, next_state, token, dnext_state, doutput) -> (token_grads, dstate)``: the
  cotangents of the step's token inputs and of the state before it, from those of the state
  after it and of its output.

``token`` is a tuple of per-step slices (``[N, ...]``) of the padded token arrays ``[L, N, ...]``.
On a padding step the state is kept as it is, so its cotangent passes through unchanged, and
what ``step_vjp`` says about the padding token is dropped when the steps are unpadded.

Memory: the reverse sweep needs the state before every step, in reverse order. Rather than
keeping all ``L`` of them, the forward sweep keeps one every ``C = ceil(sqrt(L))`` steps, and the
reverse sweep replays one segment of ``C`` steps at a time from its checkpoint. At most
``ceil(L / C) + C + 1 <= 2 sqrt(L) + 3`` states ``[N, H, K, V]`` are alive at once (plus a few
temporaries of one step), at the cost of running each step's forward twice more.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

Step = Callable[[np.ndarray, tuple[np.ndarray, ...]], tuple[np.ndarray, np.ndarray]]
StepVJP = Callable[..., tuple[tuple[np.ndarray, ...], np.ndarray]]


def run(step: Step, tokens: tuple[np.ndarray, ...], initial_states: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The outputs ``[L, N, ...]`` of every step and the final states ``[N, ...]``."""
    outputs = []
    state = initial_states
    for t in range(valid.shape[0]):
        next_state, output = step(state, _at(tokens, t))
        state = _where(valid[t], next_state, state)
        outputs.append(output)
    return np.stack(outputs), state


def vjp(
    step: Step, step_vjp: StepVJP, tokens: tuple[np.ndarray, ...], initial_states: np.ndarray, valid: np.ndarray,
    doutputs: np.ndarray, dfinal_states: np.ndarray,
) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """The cotangents of every token input ``[L, N, ...]`` and of the initial states, for the
    output cotangents ``doutputs`` ``[L, N, ...]`` and final-state cotangents ``dfinal_states``."""
    length = valid.shape[0]
    every = math.isqrt(max(length - 1, 0)) + 1  # ceil(sqrt(L))
    checkpoints = []
    state = initial_states
    for t in range(length):
        if t % every == 0:
            checkpoints.append(state)
        state = _where(valid[t], step(state, _at(tokens, t))[0], state)

    token_grads: list[Any] = [None] * length
    dstate = dfinal_states
    for segment in reversed(range(len(checkpoints))):
        start, stop = segment * every, min((segment + 1) * every, length)
        states = [checkpoints[segment]]  # states[t - start]: the state before step t; one more after the last
        for t in range(start, stop):
            states.append(_where(valid[t], step(states[-1], _at(tokens, t))[0], states[-1]))
        for t in reversed(range(start, stop)):
            grads, dprevious = step_vjp(states[t - start], states[t - start + 1], _at(tokens, t), dstate, doutputs[t])
            dstate = _where(valid[t], dprevious, dstate)
            token_grads[t] = grads
        del states  # before the next segment's replay, so that two segments are never alive together
    return tuple(np.stack(per_input) for per_input in zip(*token_grads)), dstate


def _at(tokens: tuple[np.ndarray, ...], t: int) -> tuple[np.ndarray, ...]:
    return tuple(x[t] for x in tokens)


def _where(valid: np.ndarray, taken: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """``taken`` for the valid sequences, ``kept`` for those whose step is padding."""
    if valid.all():
        return taken
    return np.where(valid.reshape(valid.shape + (1,) * (taken.ndim - 1)), taken, kept)


def outputs(sequences, step: Step, tokens: tuple[np.ndarray, ...], initial_states: np.ndarray, output_final_state: bool) -> dict:
    """``run`` over ``sequences`` (``host.sequences.Sequences``): ``o`` unpadded to ``[B, T, ...]`` and the final states,
    None unless ``output_final_state``."""
    o, final_states = run(step, tokens, initial_states, sequences.valid)
    return {"o": sequences.unpad(o), "final_state": final_states if output_final_state else None}


def token_gradients(
    sequences, step: Step, step_vjp: StepVJP, tokens: tuple[np.ndarray, ...], initial_states: np.ndarray, do: np.ndarray,
    dht: np.ndarray | None,
) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """``vjp`` over ``sequences`` for ``do`` ``[B, T, ...]`` and ``dht`` (None: zero): each token input's cotangent
    unpadded to ``[B, T, ...]``, and the initial states'."""
    dfinal_states = np.zeros_like(initial_states) if dht is None else dht
    grads, dinitial_states = vjp(step, step_vjp, tokens, initial_states, sequences.valid, sequences.pad(do), dfinal_states)
    return tuple(sequences.unpad(x) for x in grads), dinitial_states
