"""Fixtures for the Pallas TPU plugin's tests: docs/ops.md-style inputs, the float64 reference, and error checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tops_core
from jax._src.pallas.mosaic.interpret import interpret_pallas_call
from jax.experimental.pallas import tpu as pltpu

def alibi_g_gamma(heads: int, layer: int = 0, layers: int = 24) -> np.ndarray:
    """docs/ops.md's ALiBi-style constant decays: ``-slope_h * (1 - layer / (layers - 1) + 1e-5)``."""
    slopes = 2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)
    return -slopes * (1 - layer / (layers - 1) + 1e-5)


@pytest.fixture(scope="session")
def make_inputs():
    """``make(B, T, H, K, V, dtype, g=..., g_gamma=..., initial_state=..., seed=...)`` -> (kernel inputs, reference inputs).

    ``g``: True for ``log_sigmoid(normal) / 16`` gates, or an array; ``g_gamma``: "alibi", a
    number (every head), an array ``[H]`` or None; ``initial_state``: True for a unit-normal state. q, k, v are cast
    to ``dtype`` (gates and state stay float32); the reference gets the same values in float64.
    """

    def make(B, T, H, K, V, dtype, *, g=False, g_gamma=None, initial_state=False, seed=0):
        rng = np.random.default_rng(seed)
        arrays = {
            "q": rng.standard_normal((B, T, H, K)) * K**-0.5,
            "k": rng.standard_normal((B, T, H, K)) * K**-0.5,
            "v": rng.standard_normal((B, T, H, V)),
        }
        if g is True:
            arrays["g"] = -np.logaddexp(0.0, -rng.standard_normal((B, T, H))) / 16
        elif g is not False:
            arrays["g"] = np.broadcast_to(np.asarray(g, np.float64), (B, T, H))
        if isinstance(g_gamma, str):
            arrays["g_gamma"] = alibi_g_gamma(H)
        elif np.ndim(g_gamma) == 1:
            arrays["g_gamma"] = np.asarray(g_gamma, np.float64)
        elif g_gamma is not None:
            arrays["g_gamma"] = np.full((H,), float(g_gamma))
        if initial_state:
            arrays["initial_state"] = rng.standard_normal((B, H, K, V))
        kernel = {n: jnp.asarray(x, dtype if n in ("q", "k", "v") else jnp.float32) for n, x in arrays.items()}
        reference = {n: np.asarray(x, np.float64) for n, x in kernel.items()}
        return kernel, reference

    return make


@pytest.fixture(scope="session")
def default_cpu_emitters():
    """``compiler_options`` for ``jax.jit`` that compile with XLA's default CPU fusion emitters, for the tests
    that compare two kernel programs bit for bit. The root conftest's older emitter at -O0 rounds some
    unrolled loop bodies differently from the same operations in a loop (o by one ulp at 4 chunks per
    grid step): a compiler's choice, not the kernel's, so those tests compile as XLA does by default."""
    return {"xla_cpu_use_fusion_emitters": True}


@pytest.fixture(scope="session")
def optimised_cpu_code():
    """``compiler_options`` for ``jax.jit`` that let LLVM optimise the CPU code again, for the slow tests whose interpreted
    kernels run long enough that the root conftest's -O0 costs more than it saves (the split backward's gradients of 160
    heads at T = 4096: killed after 90 minutes at -O0; 8 heads 11.3 -> 4.5 s)."""
    return {"xla_backend_optimization_level": 2}


@pytest.fixture(scope="session")
def reference():
    """``reference(inputs, output_final_state)`` -> float64 ``(o, final_state)`` from ``ref.recurrent``.

    x64 is switched on globally for the call, not with the thread-local ``jax.enable_x64``: the
    reference runs in a ``pure_callback`` whose results jax checks on a runtime thread, where a
    thread-local x64 is off and float64 results would be rejected as float32.
    """
    pytest.importorskip("tops_plugins_ref")

    def run(inputs, output_final_state=True):
        previous = jax.config.jax_enable_x64
        jax.config.update("jax_enable_x64", True)
        try:
            args = {n: jnp.asarray(x) if n == "cu_seqlens" else jnp.asarray(x, jnp.float64) for n, x in inputs.items()}
            o, final_state = tops_core.op("simple_gla").forward(
                **args, output_final_state=output_final_state, implementation="ref.recurrent"
            )
            return np.asarray(o), None if final_state is None else np.asarray(final_state)
        finally:
            jax.config.update("jax_enable_x64", previous)

    return run


@pytest.fixture(scope="session")
def assert_matches():
    """``assert_matches(name, x, ref, dtype)``: the kit's tolerance rule for outputs and final states; returns the relative error."""
    from tops_core.conformance.compare import measure, tolerance

    def check(name, x, ref, dtype):
        measurement = measure(name, x, ref, tolerance(jnp.dtype(dtype).name, gradient=False))
        assert measurement.passed, measurement.describe()
        return measurement.error

    return check


@pytest.fixture(scope="session")
def reference_gradients():
    """``reference_gradients(inputs, do, dht)`` -> float64 gradients (a dict by input name) from ``ref.recurrent``.

    The VJP of ``(o, final_state)`` for cotangents ``do`` and ``dht``, or of ``o`` alone where ``dht`` is None; x64
    switched on as in ``reference``. ``inputs`` may hold ``cu_seqlens`` (packed), which has no gradient.
    """
    pytest.importorskip("tops_plugins_ref")

    def run(inputs, do, dht):
        previous = jax.config.jax_enable_x64
        jax.config.update("jax_enable_x64", True)
        try:
            args = {n: jnp.asarray(x, jnp.float64) for n, x in inputs.items() if n != "cu_seqlens"}
            packed = {"cu_seqlens": jnp.asarray(inputs["cu_seqlens"])} if "cu_seqlens" in inputs else {}
            final = dht is not None

            def forward(a):
                o, final_state = tops_core.op("simple_gla").forward(**a, **packed, output_final_state=final, implementation="ref.recurrent")
                return (o, final_state) if final else o

            _, vjp = jax.vjp(forward, args)
            do64 = jnp.asarray(do, jnp.float64)
            (grads,) = vjp((do64, jnp.asarray(dht, jnp.float64)) if final else do64)
            return {n: np.asarray(x) for n, x in grads.items()}
        finally:
            jax.config.update("jax_enable_x64", previous)

    return run


@pytest.fixture(scope="session")
def alibi_layers():
    """``alibi_layers(heads_per_layer, layers)``: the ALiBi-style decays of every head of every layer, side by side ``[layers * heads]``."""

    def decays(heads_per_layer: int, layers: int) -> np.ndarray:
        return np.concatenate([alibi_g_gamma(heads_per_layer, layer, layers) for layer in range(layers)])

    return decays


@pytest.fixture(scope="session")
def make_kda_inputs():
    """``make(B, T, H, K, V, dtype, gate=None, initial_state=True, normalised=True, seed=0)`` -> kda's inputs.

    docs/ops.md's kda test data: q, k L2-normalised (unit-normal when ``normalised`` is false),
    ``g = log_sigmoid(normal) / 16`` (or the constant log decay ``gate``), ``beta = sigmoid(normal)``;
    q, k, v in ``dtype``, the rest float32.
    """

    def make(B, T, H, K, V, dtype, *, gate=None, initial_state=True, normalised=True, seed=0):
        rng = np.random.default_rng(seed)
        q, k = rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, H, K))
        if normalised:
            q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
        g = np.full((B, T, H, K), gate) if gate is not None else -np.logaddexp(0.0, -rng.standard_normal((B, T, H, K))) / 16
        inputs = dict(
            q=jnp.asarray(q, dtype), k=jnp.asarray(k, dtype), v=jnp.asarray(rng.standard_normal((B, T, H, V)), dtype),
            g=jnp.asarray(g, jnp.float32), beta=jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((B, T, H)))), jnp.float32),
        )
        if initial_state:
            inputs["initial_state"] = jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32)
        return inputs

    return make


@pytest.fixture(scope="session")
def kda_reference():
    """``reference(inputs, use_qk_l2norm)`` -> float64 ``(o, final_state)`` of kda from ``ref.recurrent`` (x64 as in ``reference``)."""
    pytest.importorskip("tops_plugins_ref")

    def run(inputs, use_qk_l2norm=False):
        previous = jax.config.jax_enable_x64
        jax.config.update("jax_enable_x64", True)
        try:
            args = {n: jnp.asarray(np.asarray(x, np.float64)) for n, x in inputs.items()}
            o, final_state = tops_core.op("kda").forward(
                **args, output_final_state=True, use_qk_l2norm=use_qk_l2norm, implementation="ref.recurrent"
            )
            return np.asarray(o), np.asarray(final_state)
        finally:
            jax.config.update("jax_enable_x64", previous)

    return run


@pytest.fixture(scope="session")
def kda_gradients():
    """``gradients(inputs, implementation, **options)`` -> every input's gradient of kda's ``sum(o @ W) + sum(final_state * W)``
    (``W`` a fixed ``V x V`` cosine pattern, so every output element weighs differently), jitted, in interpret mode,
    strict; ``options`` go to ``kda.forward`` (``cu_seqlens``, ``use_qk_l2norm``)."""

    def gradients(inputs, implementation, **options):
        V = inputs["v"].shape[-1]
        weights = jnp.cos(jnp.arange(V * V, dtype=jnp.float32)).reshape(V, V)

        def loss(inputs):
            o, final_state = tops_core.op("kda").forward(**inputs, **options, output_final_state=True, implementation=implementation)
            return jnp.sum(o.astype(jnp.float32) @ weights) + jnp.sum(final_state * weights)

        with tops_core.use(interpret=True, strict=True):
            return jax.block_until_ready(jax.jit(jax.grad(loss))(inputs))

    return gradients


@pytest.fixture
def race_reports(monkeypatch):
    """The race-detection state of every kernel launch in the test (the interpreter makes one per launch and keeps only the latest)."""
    created = []

    class Recording(interpret_pallas_call.RaceDetectionState):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            created.append(self)

    monkeypatch.setattr(interpret_pallas_call, "RaceDetectionState", Recording)
    yield created
    pltpu.reset_tpu_interpret_mode_state()  # in case a launch failed midway
