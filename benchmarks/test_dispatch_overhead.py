"""Dispatch overhead: ``op.forward`` against calling the selected implementation directly.

The implementation is deliberately trivial (one multiply) so that what is measured is the
cost of validation, the call spec, the cached decision and the custom_vjp wrapper. Run:

    pytest benchmarks/test_dispatch_overhead.py --benchmark-only     # side by side
    python benchmarks/test_dispatch_overhead.py                       # ratio and microseconds
"""

import timeit

import jax
import jax.numpy as jnp
import pytest

import tops_core
from tops_core import Capabilities, Implementation
from tops_core.registry import Registry, swap_default_registry


def scaled_values(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, config):
    return v * scale, None


IMPLEMENTATION = Implementation(
    op="simple_gla", name="scaled_values", forward=scaled_values,
    capabilities=Capabilities(features={"g_gamma"}), priority={"cpu": 1000, "gpu": 1000, "tpu": 1000},
)


def workload():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (1, 64, 2, 32))
    k = jax.random.normal(keys[1], (1, 64, 2, 32))
    v = jax.random.normal(keys[2], (1, 64, 2, 32))
    return q, k, v, -jnp.ones((2,)) / 16


def callables():
    """(through the op, direct) pairs, jitted and eager, on a registry holding only the trivial implementation."""
    swap_default_registry(Registry(autoload=False))
    tops_core.register(IMPLEMENTATION, plugin="bench")
    sg = tops_core.op("simple_gla")
    q, k, v, gamma = workload()

    def through_op(q, k, v):
        return sg.forward(q, k, v, g_gamma=gamma)[0]

    def direct(q, k, v):
        return scaled_values(q, k, v, g=None, g_gamma=gamma, scale=32**-0.5, initial_state=None,
                             output_final_state=False, cu_seqlens=None, config=None)[0]

    return (q, k, v), {"op (jit)": jax.jit(through_op), "direct (jit)": jax.jit(direct),
                       "op (eager)": through_op, "direct (eager)": direct}


@pytest.fixture(scope="module")
def prepared():
    previous = swap_default_registry(None)
    args, functions = callables()
    for function in functions.values():
        function(*args).block_until_ready()
    yield args, functions
    swap_default_registry(previous)


@pytest.mark.benchmark(group="dispatch-jit")
@pytest.mark.parametrize("name", ["op (jit)", "direct (jit)"])
def test_jitted(benchmark, prepared, name):
    args, functions = prepared
    benchmark(lambda: functions[name](*args).block_until_ready())


@pytest.mark.benchmark(group="dispatch-eager")
@pytest.mark.parametrize("name", ["op (eager)", "direct (eager)"])
def test_eager(benchmark, prepared, name):
    args, functions = prepared
    benchmark(lambda: functions[name](*args).block_until_ready())


def main(repeats: int = 2000) -> None:
    args, functions = callables()
    seconds = {}
    for name, function in functions.items():
        function(*args).block_until_ready()
        runs = [timeit.timeit(lambda: function(*args).block_until_ready(), number=repeats) / repeats for _ in range(5)]
        seconds[name] = min(runs)
    for name, value in seconds.items():
        print(f"{name:<16} {value * 1e6:9.1f} us")
    print(f"jitted op / direct: {seconds['op (jit)'] / seconds['direct (jit)']:.3f}")
    print(f"eager dispatch overhead: {(seconds['op (eager)'] - seconds['direct (eager)']) * 1e6:.1f} us per call")


if __name__ == "__main__":
    main()
