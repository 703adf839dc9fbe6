"""The conformance kit catches wrong implementations, and works as a pytest plugin."""

import dataclasses
import pathlib
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tops_core
import tops_plugins_ref
from tests import fakes
from tops_core.conformance.cases import grid
from tops_core.conformance.checks import ConformanceError, check_rejected, run_case

pytest_plugins = ["pytester"]


@pytest.fixture
def with_reference(registry):
    registry.register_plugin(tops_plugins_ref, "ref")
    return registry


def case_named(impl, name):
    return next(case for case in grid(impl).supported if case.name == name)


def flipped_gate_sign(q, k, v, *, g, g_gamma, **kwargs):
    return fakes.scan_forward(q, k, v, g=None if g is None else -g, g_gamma=None if g_gamma is None else -g_gamma, **kwargs)


def ignores_initial_state(q, k, v, *, initial_state, **kwargs):
    return fakes.scan_forward(q, k, v, initial_state=None, **kwargs)


def decays_through_padding(q, k, v, *, g, g_gamma, output_final_state, **kwargs):
    """Pads T up to a multiple of 64 with zero tokens, but lets the decay run over the padding."""
    pad = -q.shape[1] % 64
    widen = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    o, state = fakes.scan_forward(widen(q), widen(k), widen(v), g=None if g is None else widen(g), g_gamma=g_gamma,
                                  output_final_state=output_final_state, **kwargs)
    return o[:, : q.shape[1]], state


def default_scale_forward(q, k, v, *, scale, **kwargs):
    return fakes.scan_forward(q, k, v, scale=q.shape[-1] ** -0.5, **kwargs)


def default_scale_backward(q, k, v, do, *, scale, **kwargs):
    return fakes.vjp_backward(q, k, v, do, scale=q.shape[-1] ** -0.5, **kwargs)


def zero_dg_gamma(*args, **kwargs):
    grads = fakes.vjp_backward(*args, **kwargs)
    return dataclasses.replace(grads, dg_gamma=None if grads.dg_gamma is None else jnp.zeros_like(grads.dg_gamma))


@pytest.mark.parametrize("label, changes, case, caught", [
    ("wrong gate sign", dict(forward=flipped_gate_sign), "gates=g", ["o:", "final_state:"]),
    ("zero dg_gamma", dict(backward=zero_dg_gamma), "base", ["dg_gamma: relative RMS 1.00e+00"]),
    ("final state decays through padding", dict(forward=decays_through_padding), "base", ["final_state:"]),
    ("ignored initial_state", dict(forward=ignores_initial_state), "base", ["o:", "final_state:"]),
    ("scale replaced by the default", dict(forward=default_scale_forward), "base", ["o:"]),
    ("scale replaced by the default in the backward", dict(backward=default_scale_backward), "base", ["dq:", "dk:"]),
])
def test_the_kit_catches_a_wrong_implementation(with_reference, label, changes, case, caught):
    wrong = fakes.register("wrong", **changes)
    with pytest.raises(ConformanceError) as raised:
        run_case(wrong, case_named(wrong, case))
    report = str(raised.value)
    for fragment in caught:
        line = next(line for line in report.splitlines() if line.strip().startswith(fragment.split(":")[0] + ":"))
        assert fragment in line and "FAIL" in line, report


def test_the_kit_passes_a_correct_implementation_and_reports_its_errors(with_reference):
    correct = fakes.register("correct")
    measurements = run_case(correct, case_named(correct, "base"))
    assert [m.name for m in measurements] == ["o", "final_state", "dq", "dk", "dv", "dg", "dg_gamma", "dinitial_state"]
    assert all(m.passed and m.error < 1e-5 for m in measurements)


def test_the_reference_answers_a_case_once_for_every_implementation_checked(registry):
    answered = []

    def counted(*args, **kwargs):
        jax.debug.callback(lambda: answered.append(1))  # runs each time the compiled reference runs, not once per trace
        return fakes.scan_forward(*args, **kwargs)

    fakes.register("oracle", forward=counted)
    first, second = fakes.register("first", backward=None), fakes.register("second", backward=None)
    for impl in (first, second):
        run_case(impl, case_named(impl, "base"), reference="fake.oracle")
    assert len(answered) == 1
    # Registered anew, the reference is another implementation, which is asked again.
    run_case(fakes.register("third", backward=None), case_named(first, "base"), reference="fake.oracle")
    assert len(answered) == 2


def test_grid_follows_the_declarations(registry):
    narrow = fakes.register("narrow", backward=None, features={"g_gamma", "output_final_state"}, requires={"g_gamma"},
                            ndims={"g_gamma": {1}}, dtypes={"bfloat16", "float32"}, key_dim=tops_core.DimRule(max=100))
    cases = grid(narrow)
    supported = {c.name for c in cases.supported}
    assert {"base", "without-output_final_state", "K=100,V=100", "strong-g_gamma", "bfloat16", "bfloat16-strong-g_gamma"} <= supported
    assert not any(c.name.startswith(("gates=", "varlen", "g_gamma-scalar")) for c in cases.supported)
    assert all("g_gamma" in c.features and c.key_dim <= 100 for c in cases.supported)
    assert {c.name for c in cases.unsupported} == {
        "unsupported-cu_seqlens", "unsupported-g", "unsupported-initial_state", "missing-required-g_gamma",
        "unsupported-float16", "unsupported-float64", "unsupported-g_gamma.ndim=0", "unsupported-key_dim=128",
    }


def test_a_packed_only_grid_runs_bfloat16_without_states_by_default(registry):
    packed = fakes.register("packed", features={"g_gamma", "initial_state", "output_final_state", "cu_seqlens"},
                            requires={"cu_seqlens"}, dtypes={"bfloat16", "float32"})
    cases = {c.name: c for c in grid(packed).supported}
    for name in ("bfloat16-without-states", "bfloat16-weak-g_gamma,without-states"):
        case = cases[name]
        assert case.dtype == "bfloat16" and not case.slow and case.seqlens is not None
        assert case.features.isdisjoint({"initial_state", "output_final_state"})
    assert cases["bfloat16-weak-g_gamma,without-states"].weak_decay
    assert cases["bfloat16"].slow  # with states, packed-only: the unpacked sibling's runs by default


def test_rejection_happens_in_the_matcher(registry):
    calls = []
    narrow = fakes.register("narrow", features={"g_gamma"}, forward=lambda *a, **kw: calls.append(1))
    for case in grid(narrow).unsupported:
        assert check_rejected(narrow, case)
    assert calls == []


def test_an_implementation_that_accepts_a_case_fails_the_rejection_check(registry):
    wide = fakes.register("wide")
    with pytest.raises(ConformanceError, match="accepts case base"):
        check_rejected(wide, case_named(wide, "base"))


# In one process with -m slow: under xdist the plugin runs the same cases in the workers and the summary crosses back.
@pytest.mark.parametrize("workers", [pytest.param([], marks=pytest.mark.slow), ["-n", "2"]], ids=["one-process", "xdist"])
def test_a_third_party_runs_the_kit_as_a_pytest_plugin(pytester, clean_env, workers):
    # Under pytest-xdist the cases run in worker processes: the summary must still reach the one that prints it.
    clean_env.setenv("PYTHONPATH", str(pathlib.Path(__file__).parents[1]))
    clean_env.setenv("TOPS_PLUGINS", "ref")
    pytester.makeconftest(textwrap.dedent('''
        import dataclasses
        import tops_core
        from tests import fakes

        def negated(*args, **kwargs):
            o, state = fakes.scan_forward(*args, **kwargs)
            return -o, state

        tops_core.register(fakes.implementation("good", backward=None), plugin="third")
        tops_core.register(fakes.implementation("bad", forward=negated, backward=None), plugin="third")
        tops_core.register(fakes.implementation("elsewhere", backward=None, platforms={"gpu"}), plugin="third")
    '''))
    pytester.makepyfile(test_kit="from tops_core.testing.suite import *  # noqa\n")
    result = pytester.runpytest_subprocess(
        "-p", "tops_core.testing", "--tops-impl", "third.*", "-k", "base or rejected or elsewhere", "-p", "no:cacheprovider",
        f"--rootdir={pytester.path}", "-W", "ignore::pytest.PytestAssertRewriteWarning", *workers,
    )
    result.assert_outcomes(passed=7, failed=1, skipped=1)
    result.stdout.fnmatch_lines([
        "*tops conformance: accuracy not checked on this machine*",
        "simple_gla third.elsewhere: third.elsewhere runs on gpu; this machine is cpu",
        "*tops conformance: worst relative RMS error*",
        "simple_gla *third.good *float32 *o *base",
    ])


def test_the_tolerance_rule_has_no_absolute_escape():
    from tops_core.conformance.compare import measure

    # An absolute error of 4e-8 is tiny, yet 2e-8 relative is far above float64's 1e-10: it fails.
    loose = measure("dq", [1.0 + 4e-8, 2.0], [1.0, 2.0], tol=1e-10)
    assert not loose.passed and loose.describe().endswith("FAIL")
    tight = measure("dq", [1.0, 2.0], [1.0, 2.0], tol=1e-10)
    assert tight.passed and tight.describe().endswith(" ok")


def test_an_all_zero_reference_is_compared_by_the_rms_of_the_result():
    from tops_core.conformance.compare import measure

    assert measure("dg", [0.0, 0.0], [0.0, 0.0], tol=1e-10).passed
    small = measure("dg", [3e-11, -4e-11], [0.0, 0.0], tol=1e-10)
    assert small.error == pytest.approx(np.sqrt((9e-22 + 16e-22) / 2)) and small.passed
    assert not measure("dg", [1e-6, 0.0], [0.0, 0.0], tol=1e-10).passed


def test_nan_where_the_reference_is_finite_fails():
    from tops_core.conformance.compare import measure

    assert not measure("o", [np.nan, 1.0], [1.0, 1.0], tol=1.0).passed
