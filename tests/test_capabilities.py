"""The capability matcher: each declaration category yields a readable reason, or none."""

import pytest

from tops_core import CallSpec, Capabilities, DimRule


def spec(**overrides):
    base = dict(op="simple_gla", platform="cpu", dtype="float32", batch=2, seq_len=64, heads=4,
                key_dim=128, value_dim=128, num_seqs=2, features=frozenset({"g_gamma"}), ndims={"g_gamma": 1})
    return CallSpec(**(base | overrides))


EVERYTHING = Capabilities(features={"g", "g_gamma", "initial_state", "cu_seqlens", "output_final_state"})


def test_supported_call_has_no_reasons():
    assert EVERYTHING.reasons(spec()) == []


@pytest.mark.parametrize("capabilities, call, reason", [
    (Capabilities(platforms={"tpu"}, features={"g_gamma"}), spec(), "runs on tpu, this call is on cpu"),
    (Capabilities(platforms={"tpu"}, interpretable=True, features={"g_gamma"}), spec(), "TOPS_INTERPRET=1"),
    (Capabilities(dtypes={"bfloat16"}, features={"g_gamma"}), spec(), "dtype float32 not supported (supports bfloat16)"),
    (Capabilities(features={"g"}), spec(), "does not support g_gamma"),
    (Capabilities(features={"g", "g_gamma"}, requires={"g"}), spec(), "requires g"),
    (Capabilities(features={"g_gamma"}, ndims={"g_gamma": {1}}), spec(ndims={"g_gamma": 0}), "g_gamma.ndim=0 not supported"),
    (Capabilities(features={"g_gamma"}, key_dim=DimRule(max=64)), spec(), "K=128 not supported (K: 1..64)"),
    (Capabilities(features={"g_gamma"}, value_dim=DimRule(multiple_of=256)), spec(), "V=128 not supported (V: multiple of 256)"),
    (Capabilities(features={"g_gamma"}), spec(features={"g_gamma", "cu_seqlens"}), "does not support cu_seqlens"),
    (Capabilities(features={"g_gamma"}), spec(features={"g_gamma", "initial_state"}), "does not support initial_state"),
    (Capabilities(features={"g_gamma"}), spec(features={"g_gamma", "output_final_state"}), "does not support output_final_state"),
    (Capabilities(features={"g_gamma"}, predicate=lambda s: "T must be even" if s.seq_len % 2 else None), spec(seq_len=63), "T must be even"),
])
def test_each_unsupported_category_gives_a_reason(capabilities, call, reason):
    reasons = capabilities.reasons(call)
    assert any(reason in r for r in reasons), reasons


def test_interpret_mode_admits_interpretable_tpu_kernels_only():
    tpu_kernel = Capabilities(platforms={"tpu"}, interpretable=True, features={"g_gamma"})
    tpu_only = Capabilities(platforms={"tpu"}, features={"g_gamma"})
    assert tpu_kernel.reasons(spec(interpret=True)) == []
    assert tpu_kernel.interpreted(spec(interpret=True))
    assert not tpu_kernel.interpreted(spec(platform="tpu", interpret=True))
    assert tpu_only.reasons(spec(interpret=True)) == ["runs on tpu, this call is on cpu"]


def test_reasons_accumulate():
    narrow = Capabilities(platforms={"gpu"}, dtypes={"bfloat16"}, features=set())
    assert len(narrow.reasons(spec())) == 3


@pytest.mark.parametrize("kwargs, error", [
    (dict(platforms={"metal"}), "unknown platforms"),
    (dict(dtypes={"int8"}), "unknown dtypes"),
    (dict(features={"g"}, requires={"g_gamma"}), "requires must be a subset"),
    (dict(platforms={"cpu"}, interpretable=True), "only makes sense for a TPU kernel"),
])
def test_malformed_declarations_are_refused(kwargs, error):
    with pytest.raises(ValueError, match=error):
        Capabilities(**kwargs)


def test_a_string_is_not_a_collection_of_names():
    with pytest.raises(TypeError, match="collection of names"):
        Capabilities(platforms="tpu")


def test_dim_rule():
    rule = DimRule(min=64, max=256, multiple_of=64)
    assert [rule.accepts(d) for d in (32, 64, 100, 256, 320)] == [False, True, False, True, False]
    assert rule.describe() == "64..256, multiple of 64"
    assert DimRule().describe() == "any"


def test_call_spec_is_hashable_and_order_insensitive():
    a = spec(features={"g", "g_gamma"}, ndims={"g_gamma": 1, "g": 3})
    b = spec(features={"g_gamma", "g"}, ndims=(("g", 3), ("g_gamma", 1)))
    assert a == b and hash(a) == hash(b)
    with pytest.raises(ValueError, match="platform must be one of"):
        spec(platform="metal")
