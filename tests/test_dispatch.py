"""The dispatcher: capabilities, policy, priority, caching and explanations."""

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

import tops_core
from tests import fakes
from tops_core import CallSpec, NoImplementationError, environment

sg = tops_core.op("simple_gla")


def spec(**overrides):
    base = dict(op="simple_gla", platform="cpu", dtype="float32", batch=2, seq_len=64, heads=4,
                key_dim=64, value_dim=64, num_seqs=2, features=frozenset({"g_gamma"}), ndims={"g_gamma": 1})
    return CallSpec(**(base | overrides))


def test_highest_priority_supporting_implementation_wins(registry):
    fakes.register("slow", priority={"cpu": 1})
    fakes.register("fast", priority={"cpu": 50})
    fakes.register("narrow", priority={"cpu": 99}, features={"g"})
    decision = sg.decide(spec())
    assert decision.implementation.name == "fake.fast"
    assert "highest priority (declared priority 50 on cpu) over fake.slow (1)" in decision.decided_by
    assert [c.name for c in decision.candidates] == ["fake.fast", "fake.slow", "fake.narrow"]
    assert decision.candidates[-1].reasons == ("does not support g_gamma",)


def test_priority_is_per_platform(registry):
    fakes.register("cpu_first", priority={"cpu": 50, "gpu": 1})
    fakes.register("gpu_first", priority={"cpu": 1, "gpu": 50})
    assert sg.decide(spec()).implementation.name == "fake.cpu_first"
    assert sg.decide(spec(platform="gpu")).implementation.name == "fake.gpu_first"


def test_priority_callable_explains_itself(registry):
    def by_batch(call):
        return (300, "B*H=8 is enough parallelism") if call.batch * call.heads >= 8 else (5, "too few rows")
    fakes.register("dynamic", priority=by_batch)
    fakes.register("static", priority={"cpu": 100})
    assert sg.decide(spec()).implementation.name == "fake.dynamic"
    decision = sg.decide(spec(batch=1, heads=2))
    assert decision.implementation.name == "fake.static"
    assert "fake.dynamic (5)" in decision.decided_by


def test_nothing_supports_the_call_lists_every_implementation_and_why(registry):
    fakes.register("a", features={"g"})
    fakes.register("b", platforms={"tpu"})
    with pytest.raises(NoImplementationError) as raised:
        sg.decide(spec())
    message = str(raised.value)
    assert "no implementation of simple_gla supports this forward call" in message
    assert re.search(r"x fake.a +rejected: does not support g_gamma", message)
    assert re.search(r"x fake.b +rejected: runs on tpu, this call is on cpu", message)


def test_no_implementations_registered(registry):
    with pytest.raises(NoImplementationError, match="no implementations of simple_gla are registered"):
        sg.decide(spec())


@pytest.mark.parametrize("source", ["argument", "use", "env"])
def test_force_from_each_source(registry, source):
    fakes.register("low", priority={"cpu": 1})
    fakes.register("high", priority={"cpu": 50})
    q, k, v, _, g_gamma = fakes.inputs()
    if source == "argument":
        explanation = sg.explain(q, k, v, g_gamma=g_gamma, implementation="fake.low")
        expected = "forced by argument"
    elif source == "use":
        with tops_core.use(simple_gla="fake.low"):
            explanation = sg.explain(q, k, v, g_gamma=g_gamma)
        expected = "forced by tops_core.use()"
    else:
        registry_env = pytest.MonkeyPatch()
        registry_env.setenv("TOPS_FORCE", "kda=ref.recurrent,simple_gla=fake.low")
        try:
            explanation = sg.explain(q, k, v, g_gamma=g_gamma)
        finally:
            registry_env.undo()
        expected = "forced by TOPS_FORCE"
    assert explanation.forward.implementation.name == "fake.low"
    assert explanation.forward.decided_by == expected


def _constant(value):
    """A fake forward whose output says which implementation ran."""
    def forward(q, k, v, **kwargs):
        return jnp.full(v.shape, value, v.dtype), None
    return forward


def test_a_use_block_applies_to_functions_jitted_before_it(registry):
    fakes.register("one", forward=_constant(1.0), priority={"cpu": 50})
    fakes.register("two", forward=_constant(2.0), priority={"cpu": 10})
    q, k, v, _, _ = fakes.inputs()
    step = jax.jit(lambda q, k, v: sg.forward(q, k, v)[0][0, 0, 0, 0])
    assert step(q, k, v) == 1
    with tops_core.use(simple_gla="fake.two"):
        assert step(q, k, v) == 2  # traced again: the block's scope is part of jit's cache key
        first_traced_inside = jax.jit(lambda q, k, v: sg.forward(q, k, v)[0][0, 0, 0, 0])
        assert first_traced_inside(q, k, v) == 2
    assert step(q, k, v) == 1 and first_traced_inside(q, k, v) == 1
    with tops_core.use(deny=["fake.one"]):
        assert step(q, k, v) == 2
    assert step(q, k, v) == 1


def test_the_environment_is_read_when_a_call_is_traced(registry, clean_env):
    fakes.register("one", forward=_constant(1.0), priority={"cpu": 50})
    fakes.register("two", forward=_constant(2.0), priority={"cpu": 10})
    q, k, v, _, _ = fakes.inputs()
    step = jax.jit(lambda q, k, v: sg.forward(q, k, v)[0][0, 0, 0, 0])
    assert step(q, k, v) == 1
    clean_env.setenv("TOPS_FORCE", "simple_gla=fake.two")
    assert step(q, k, v) == 1  # already traced: os.environ is not part of jit's cache key
    assert sg.forward(q, k, v)[0][0, 0, 0, 0] == 2  # an eager call is traced now
    assert jax.jit(lambda q, k, v: sg.forward(q, k, v)[0][0, 0, 0, 0])(q, k, v) == 2


def test_argument_beats_context_beats_environment(registry, clean_env):
    for name in ("a", "b", "c"):
        fakes.register(name)
    clean_env.setenv("TOPS_FORCE", "simple_gla=fake.a")
    assert sg.decide(spec(), policy=sg.policy()).implementation.name == "fake.a"
    with tops_core.use(simple_gla="fake.b"):
        assert sg.decide(spec(), policy=sg.policy()).implementation.name == "fake.b"
        assert sg.decide(spec(), policy=sg.policy("fake.c")).implementation.name == "fake.c"
        with tops_core.use(simple_gla=None):
            assert sg.decide(spec(), policy=sg.policy()).implementation.name == "fake.a"


def test_forced_config_overrides_reach_the_implementation(registry):
    seen = []

    def forward(q, k, v, *, config, **kwargs):
        seen.append(config)
        return v, None

    fakes.register("configurable", forward=forward)
    q, k, v, _, _ = fakes.inputs()
    with tops_core.use(simple_gla=("fake.configurable", {"chunk_size": 128})):
        sg.forward(q, k, v)
    sg.forward(q, k, v)
    assert [c.chunk_size for c in seen] == [128, 64]
    with pytest.raises(TypeError, match=r"config has no field\(s\) \['num_steps'\]"):
        sg.forward(q, k, v, implementation=("fake.configurable", {"num_steps": 2}))


def test_explain_says_what_the_config_comes_to_for_the_call(registry):
    def per_call(config, call, direction):
        return f"{direction} chunk {config.chunk_size * 2 if call.seq_len > 32 else config.chunk_size}"

    tops_core.register(dataclasses.replace(fakes.implementation("doubling"), explain_config=per_call), plugin="fake")
    assert "  for this call: forward chunk 128" in sg.decide(spec()).explain().splitlines()
    assert "  for this call: backward chunk 64" in sg.decide(spec(seq_len=16), "backward").explain().splitlines()
    fakes.register("plain", priority={"cpu": 99})
    assert "for this call" not in sg.decide(spec()).explain()


def test_unknown_forced_implementation_is_an_error_not_a_fallback(registry):
    fakes.register("real")
    with pytest.raises(ValueError, match="unknown implementation 'fake.typo' .*registered: fake.real"):
        sg.decide(spec(), policy=sg.policy("fake.typo"))


def test_forced_but_unsupported_falls_back_with_a_warning(registry):
    fakes.register("narrow", features={"g"})
    fakes.register("wide")
    with pytest.warns(RuntimeWarning, match="fake.narrow does not support this call"):
        decision = sg.decide(spec(), policy=sg.policy("fake.narrow"))
    assert decision.implementation.name == "fake.wide"
    assert "fell back by priority" in decision.notes[0]


def test_strict_mode_refuses_to_fall_back_from_a_forced_implementation(registry):
    fakes.register("narrow", features={"g"})
    fakes.register("wide")
    with tops_core.use(strict=True), pytest.raises(NoImplementationError, match="strict mode forbids falling back"):
        sg.decide(spec(), policy=sg.policy("fake.narrow"))


def test_strict_mode_refuses_to_fall_back_past_the_highest_priority(registry, clean_env):
    fakes.register("best", priority={"cpu": 90}, features={"g"})
    fakes.register("fallback", priority={"cpu": 10})
    fakes.register("elsewhere", priority={"cpu": 99, "tpu": 99}, platforms={"tpu"})
    assert sg.decide(spec(), policy=sg.policy()).implementation.name == "fake.fallback"
    clean_env.setenv("TOPS_STRICT", "1")
    with pytest.raises(NoImplementationError, match="highest-priority implementation on cpu, fake.best, does not support"):
        sg.decide(spec(), policy=sg.policy())
    assert sg.decide(spec(features={"g"}, ndims={}), policy=sg.policy()).implementation.name == "fake.best"


def test_strict_mode_breaks_priority_ties_like_the_ranking(registry, clean_env):
    fakes.register("a_wide", priority={"cpu": 50})
    fakes.register("b_narrow", priority={"cpu": 50}, features={"g"})
    clean_env.setenv("TOPS_STRICT", "1")
    assert sg.decide(spec(), policy=sg.policy()).implementation.name == "fake.a_wide"


def test_deny_list_from_env_and_context(registry, clean_env):
    fakes.register("first", priority={"cpu": 90})
    fakes.register("second", priority={"cpu": 50})
    fakes.register("third", priority={"cpu": 10})
    clean_env.setenv("TOPS_DENY", "fake.first")
    assert sg.decide(spec(), policy=sg.policy()).implementation.name == "fake.second"
    with tops_core.use(deny=["fake.s*"]):
        decision = sg.decide(spec(), policy=sg.policy())
    assert decision.implementation.name == "fake.third"
    assert ("denied by policy",) == next(c for c in decision.candidates if c.name == "fake.second").reasons


def test_a_deny_pattern_must_match_a_registered_implementation_of_some_op(registry, clean_env):
    fakes.register("scan")
    tops_core.register(dataclasses.replace(fakes.implementation("delta", features={"initial_state"}, ndims={}), op="kda"), plugin="fake")
    registered = "registered: fake.delta, fake.scan"
    with pytest.raises(ValueError, match=rf"tops_core.use\(deny=...\): deny pattern 'fake.scna' matches no registered implementation; {registered}"):
        with tops_core.use(deny=["fake.scan", "fake.scna"]):
            pass
    with tops_core.use(deny="fake.delta"):  # kda's: a pattern may deny what only another op has
        assert sg.decide(spec(), policy=sg.policy()).implementation.name == "fake.scan"
    clean_env.setenv("TOPS_DENY", "fake.d*,xla.chunck")
    with pytest.raises(ValueError, match=rf"TOPS_DENY: deny pattern 'xla.chunck' matches no registered implementation; {registered}"):
        sg.policy()
    with pytest.raises(TypeError, match="deny patterns must be strings"):
        with tops_core.use(deny=[3]):
            pass


def test_TOPS_FORCE_forces_one_implementation_per_op(registry, clean_env):
    clean_env.setenv("TOPS_FORCE", "simple_gla=xla.chunk, kda=ref.recurrent, simple_gla=ref.recurrent")
    with pytest.raises(ValueError, match=r"TOPS_FORCE names simple_gla twice \(xla.chunk and ref.recurrent\); force one implementation per op"):
        tops_core.op("kda").policy()


def test_an_unknown_TOPS_variable_is_reported_once_naming_the_known_ones(registry, clean_env):
    fakes.register("scan")
    clean_env.setattr(environment, "_warned", set())
    clean_env.setenv("TOPS_FORSE", "simple_gla=fake.scan")
    clean_env.setenv("TOPS_INTERPRETT", "1")
    q, k, v, _, _ = fakes.inputs()
    with pytest.warns(RuntimeWarning) as caught:
        sg.forward(q, k, v)
    known = ", ".join(environment.KNOWN)
    assert [str(w.message) for w in caught] == [
        f"tops: unknown environment variable TOPS_FORSE is ignored (did you mean TOPS_FORCE?); tops reads {known}",
        f"tops: unknown environment variable TOPS_INTERPRETT is ignored (did you mean TOPS_INTERPRET?); tops reads {known}",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sg.forward(*fakes.inputs(T=16)[:3])  # decided afresh, warned already


def test_interpret_mode_selects_tpu_kernels_off_tpu_and_labels_them(registry, clean_env):
    fakes.register("portable", priority={"cpu": 100, "tpu": 50})
    fakes.register("kernel", platforms={"tpu"}, interpretable=True, priority={"tpu": 200})
    assert sg.decide(spec(), policy=sg.policy()).implementation.name == "fake.portable"
    clean_env.setenv("TOPS_INTERPRET", "1")
    decision = sg.decide(spec(interpret=True), policy=sg.policy())
    assert decision.implementation.name == "fake.kernel" and decision.interpreted
    assert "declared priority 200 on tpu" in decision.decided_by
    assert "fake.kernel [interpreted]" in decision.explain()


def test_decisions_are_cached_per_spec_and_policy_and_cleared_on_registration(registry):
    fakes.register("first")
    fakes.register("spare", priority={"cpu": 1})
    first = sg.decide(spec())
    assert sg.decide(spec()) is first
    assert sg.decide(spec(batch=4)) is not first
    with tops_core.use(deny=["fake.spare"]):
        assert sg.decide(spec()) is not first
    fakes.register("second", priority={"cpu": 99})
    assert sg.decide(spec()).implementation.name == "fake.second"


def test_explanation_on_success_shows_candidates_reasons_winner_and_cause(registry):
    fakes.register("chosen", priority={"cpu": 20})
    fakes.register("runner_up", priority={"cpu": 10})
    fakes.register("forward_only", priority={"cpu": 30}, backward=None)
    fakes.register("rejected", features={"g"})
    q, k, v, _, g_gamma = fakes.inputs(B=2, T=16, H=3, K=8, V=5)
    text = str(sg.explain(q, k, v, g_gamma=g_gamma, output_final_state=True))
    forward, backward = text.split("simple_gla backward:")
    assert forward.startswith("simple_gla forward: B=2 T=16 H=3 K=8 V=5 float32 on cpu; with g_gamma (ndim 1), output_final_state")
    assert "* fake.forward_only" in forward and "selected: fake.forward_only with FakeConfig(chunk_size=64)" in forward
    assert re.search(r"x fake.rejected +rejected: does not support g_gamma", forward)
    assert "- fake.runner_up" in forward
    assert "rejected: forward only (no backward)" in backward and "selected: fake.chosen" in backward


def test_a_backward_predicate_rejects_the_backward_alone(registry):
    # A kernel whose backward serves fewer calls than its forward (say, a chip its compiler rejects it on).
    fakes.register("narrow_backward", priority={"cpu": 20}, backward_predicate=lambda s: "not for T > 8" if s.seq_len > 8 else None)
    fakes.register("spare", priority={"cpu": 10})
    assert sg.decide(spec(), "forward").implementation.name == "fake.narrow_backward"
    assert sg.decide(spec(), "backward").implementation.name == "fake.spare"
    assert sg.decide(spec(seq_len=8), "backward").implementation.name == "fake.narrow_backward"
    q, k, v, _, g_gamma = fakes.inputs(B=2, T=16, H=3, K=8, V=5)
    backward = str(sg.explain(q, k, v, g_gamma=g_gamma)).split("simple_gla backward:")[1]
    assert re.search(r"x fake.narrow_backward +rejected: backward: not for T > 8", backward), backward


def test_forced_forward_only_implementation_pairs_with_a_backward(registry):
    fakes.register("kernel", backward=None, priority={"cpu": 1})
    fakes.register("portable", priority={"cpu": 10})
    q, k, v, _, g_gamma = fakes.inputs()
    explanation = sg.explain(q, k, v, g_gamma=g_gamma, implementation="fake.kernel")
    assert explanation.forward.implementation.name == "fake.kernel"
    assert explanation.backward.implementation.name == "fake.portable"
    assert "the forced fake.kernel is forward-only" in explanation.backward.notes[0]
    assert str(explanation).endswith(
        "pairing: fake.kernel is forward-only; gradients come from fake.portable's backward, "
        "which recomputes from the original inputs")


def test_explanation_without_any_backward(registry):
    fakes.register("kernel", backward=None)
    q, k, v, _, _ = fakes.inputs()
    explanation = sg.explain(q, k, v)
    assert explanation.backward is None
    assert "no implementation of simple_gla supports this backward call" in str(explanation)


def test_call_spec_records_platform_dtype_and_features(registry):
    q, k, v, g, _ = fakes.inputs(dtype=jnp.bfloat16)
    prepared = sg.prepare(q, k, v, g, jnp.float32(-0.1), 0.5, None, True, None, False)
    assert prepared.spec == CallSpec(op="simple_gla", platform="cpu", dtype="bfloat16", batch=2, seq_len=12,
                                     heads=3, key_dim=8, value_dim=5, num_seqs=2,
                                     features={"g", "g_gamma", "output_final_state"}, ndims={"g_gamma": 0})


def test_policy_flag_parsing(registry, clean_env):
    clean_env.setenv("TOPS_FORCE", "simple_gla")
    with pytest.raises(ValueError, match="TOPS_FORCE entries must look like 'op=plugin.impl'"):
        sg.policy()
    clean_env.delenv("TOPS_FORCE")
    with pytest.raises(TypeError, match="an implementation must be given as a name"):
        with tops_core.use(simple_gla=42):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tops_core.use(strict=True, interpret=True):
            policy = tops_core.op("kda").policy()
    assert policy.strict and policy.interpret and policy.force is None


def test_misspelt_op_names_and_flag_values_are_errors(registry, clean_env):
    with pytest.raises(ValueError, match=r"unknown op 'simple_glaa' in tops_core.use\(\); known ops: gated_delta_rule, gla, kda, simple_gla"):
        with tops_core.use(simple_glaa="ref.recurrent"):
            pass
    clean_env.setenv("TOPS_FORCE", "simple_glaa=xla.chunk")
    with pytest.raises(ValueError, match="unknown op 'simple_glaa' in TOPS_FORCE"):
        sg.policy()
    clean_env.delenv("TOPS_FORCE")
    for name in ("TOPS_INTERPRET", "TOPS_STRICT"):
        clean_env.setenv(name, "2")
        with pytest.raises(ValueError, match=f"{name}='2' is not a boolean"):
            sg.policy()
        clean_env.setenv(name, "off")
    assert not sg.policy().interpret and not sg.policy().strict
