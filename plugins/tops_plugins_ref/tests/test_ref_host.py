"""The host side of the reference: NumPy only, so it cannot deadlock JAX, and its checkpointed sweep is exact."""

import ast
import contextlib
import gc
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

import tops_core
import tops_plugins_ref
from tops_plugins_ref.host import kda as host_kda
from tops_plugins_ref.host import sweep
from tops_plugins_ref.host.sequences import Sequences

# The loop a user reported hanging at 0% CPU: each call's host function ran jitted JAX while the
# runtime it needed was waiting, with ``y = x[0] + i`` queued, for that very callback to return.
LOOPS = {
    "kda": """
kda = tops_core.op("kda")
x = jnp.ones((2, 300, 4, 64)) * 0.1; g = -jnp.ones((2, 300, 4, 64)) * 0.1; beta = jnp.full((2, 300, 4), 0.5)
for i in range(20):
    o, _ = kda.forward(x, x, x, g, beta, implementation="ref.recurrent"); y = x[0] + i
""",
    "simple_gla": """
sg = tops_core.op("simple_gla")
x = jnp.ones((2, 300, 4, 64)) * 0.1; gamma = jnp.full((4,), -0.1)
for i in range(20):
    o, _ = sg.forward(x, x, x, g_gamma=gamma, implementation="ref.recurrent"); y = x[0] + i
""",
}


@pytest.mark.parametrize("op", LOOPS)
def test_calls_queued_without_blocking_do_not_deadlock(op):
    code = "import jax, jax.numpy as jnp, tops_core\n" + LOOPS[op] + "jax.block_until_ready((o, y))\nprint('finished')\n"
    environment = {name: value for name, value in os.environ.items() if not name.startswith("TOPS_")}
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                env=environment | {"JAX_PLATFORMS": "cpu"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {op} loop did not finish in 120 s: the host callback deadlocked")
    assert result.returncode == 0 and "finished" in result.stdout, result.stderr[-3000:]


JAX_DIRECTORIES = tuple(os.path.dirname(module.__file__) + os.sep for module in (jax, jaxlib))


@contextlib.contextmanager
def jax_code_recorded():
    """Every function of jax or jaxlib that this thread enters meanwhile: Python ones by their
    file, builtins by their module."""
    entered = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(JAX_DIRECTORIES):
            entered.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")
        elif event == "c_call" and (getattr(arg, "__module__", None) or "").partition(".")[0] in ("jax", "jaxlib"):
            entered.append(repr(arg))

    # jax registers a garbage-collector callback, which runs wherever a collection happens to start,
    # not because the recorded code calls JAX: no collection while recording.
    collecting = gc.isenabled()
    gc.disable()
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield entered
    finally:
        sys.setprofile(previous)
        if collecting:
            gc.enable()


def test_the_recorder_sees_jax_work():
    with jax_code_recorded() as entered:
        jnp.zeros(3).block_until_ready()
    assert entered


def test_the_host_function_runs_no_jax_code(monkeypatch, x64):
    """Every host call, forward and backward of both ops, float32 and float64, packed and not."""
    entered, host_calls = [], []
    real_pure_callback = jax.pure_callback

    def watched_pure_callback(host, result_shape_dtypes, *args, **kwargs):
        def watched_host(*operands):
            # JAX hands the host its operands as CPU jax.Arrays; reading them out is JAX's part.
            operands = jax.tree.map(np.asarray, operands)
            with jax_code_recorded() as seen:
                results = host(*operands)
            entered.extend(seen)
            host_calls.append(host)
            return results

        return real_pure_callback(watched_host, result_shape_dtypes, *args, **kwargs)

    monkeypatch.setattr(jax, "pure_callback", watched_pure_callback)
    rng = np.random.default_rng(0)
    # Shapes no other test uses, so that no cached trace can skip the patched pure_callback.
    B, T, H, K, V = 1, 7, 3, 5, 2
    cu_seqlens = jnp.asarray([0, 3, 3, 7])
    q, k, g = (jnp.asarray(rng.normal(size=(B, T, H, K))) for _ in range(3))
    v, do = (jnp.asarray(rng.normal(size=(B, T, H, V))) for _ in range(2))
    beta, gamma = jnp.asarray(rng.random((B, T, H))), jnp.asarray(-rng.random(H))
    sg, kda = tops_core.op("simple_gla"), tops_core.op("kda")

    sg.forward(q, k, v, g_gamma=gamma, cu_seqlens=cu_seqlens, output_final_state=True, implementation="ref.recurrent")
    sg.backward(q, k, v, do, g_gamma=gamma, cu_seqlens=cu_seqlens, implementation="ref.recurrent")
    f32 = [x.astype(jnp.float32) for x in (q, k, v, -jnp.abs(g), beta, do)]
    kda.forward(*f32[:5], use_qk_l2norm=True, output_final_state=True, implementation="ref.recurrent")
    kda.backward(*f32, use_qk_l2norm=True, implementation="ref.recurrent")

    assert len(host_calls) == 4
    assert entered == []


def test_the_host_package_imports_nothing_of_jax():
    host = pathlib.Path(tops_plugins_ref.__file__).parent / "host"
    imported = set()
    for path in host.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {(path.name, alias.name.partition(".")[0]) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add((path.name, (node.module or "").partition(".")[0]))
    assert {name for name in imported if name[1] in ("jax", "jaxlib", "tops_core")} == set()
    assert ("kda.py", "numpy") in imported  # the walk does see the imports


# -- the checkpointed reverse sweep ------------------------------------------------------------


def every_state_vjp(step, step_vjp, tokens, initial_states, valid, doutputs, dfinal_states):
    """The reverse sweep written the plain way: keep the state before every step."""
    states = [initial_states]
    for t in range(valid.shape[0]):
        next_state = step(states[-1], tuple(x[t] for x in tokens))[0]
        states.append(np.where(valid[t][:, None, None, None], next_state, states[-1]))
    dstate, token_grads = dfinal_states, []
    for t in reversed(range(valid.shape[0])):
        grads, dprevious = step_vjp(states[t], states[t + 1], tuple(x[t] for x in tokens), dstate, doutputs[t])
        dstate = np.where(valid[t][:, None, None, None], dprevious, dstate)
        token_grads.insert(0, grads)
    return tuple(np.stack(per_input) for per_input in zip(*token_grads)), dstate


@pytest.mark.parametrize("lengths", [[1], [4], [5], [2, 7, 0], [10, 3, 9]], ids=str)
def test_checkpointing_changes_no_bit_of_the_gradients(lengths):
    """Lengths whose longest is a square, is not, and leaves a short last segment of C = ceil(sqrt(L))."""
    rng = np.random.default_rng(len(lengths) * 100 + max(lengths))
    H, K, V = 2, 3, 4
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
    T = int(cu_seqlens[-1])
    sequences = Sequences(cu_seqlens, 1, T)
    tokens = tuple(sequences.pad(x) for x in (
        rng.normal(size=(1, T, H, K)), rng.normal(size=(1, T, H, K)), rng.normal(size=(1, T, H, V)),
        -rng.random((1, T, H, K)), rng.random((1, T, H)),
    ))
    initial_states, dfinal_states = rng.normal(size=(2, len(lengths), H, K, V))
    doutputs = sequences.pad(rng.normal(size=(1, T, H, V)))
    step = lambda *args: host_kda._step(*args, scale=0.5)  # noqa: E731
    step_vjp = lambda *args: host_kda._step_vjp(*args, scale=0.5)  # noqa: E731

    got = sweep.vjp(step, step_vjp, tokens, initial_states, sequences.valid, doutputs, dfinal_states)
    want = every_state_vjp(step, step_vjp, tokens, initial_states, sequences.valid, doutputs, dfinal_states)
    for got_grad, want_grad in zip(got[0], want[0]):
        np.testing.assert_array_equal(sequences.unpad(got_grad), sequences.unpad(want_grad))
    np.testing.assert_array_equal(got[1], want[1])


def test_the_host_epsilon_is_the_op_contracts():
    from tops_core.ops.kda import L2NORM_EPSILON

    assert host_kda.L2NORM_EPSILON == L2NORM_EPSILON
