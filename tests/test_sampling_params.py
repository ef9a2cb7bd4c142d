"""SamplingParams takes numbers however they are spelled (Python or numpy) and refuses bools,
which Python counts as ints; every refusal is a ValueError naming the field."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infer.sampling import SamplingArrays
from infer.sampling_params import SAMPLING_EPS, SamplingParams, StructuredOutput

INT_TYPES = [int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
FLOAT_TYPES = [float, np.float16, np.float32, np.float64]
# field -> (smallest valid, largest valid) for the integer fields
INT_FIELDS = {"top_k": (0, 2**16), "max_tokens": (1, 2**16), "seed": (0, 2**32 - 1)}


def _fits(t: type, value: int) -> bool:
    return t is int or np.iinfo(t).min <= value <= np.iinfo(t).max


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(INT_FIELDS)), st.sampled_from(INT_TYPES), st.data())
def test_numpy_integers_are_accepted_as_python_ints(field: str, t: type, data) -> None:
    lo, hi = INT_FIELDS[field]
    if not _fits(t, lo):
        return
    value = data.draw(st.integers(lo, hi).filter(lambda v: _fits(t, v)))
    params = SamplingParams(**{field: t(value)}, stop_token_ids=[t(lo)])
    got = getattr(params, field)
    assert type(got) is int and got == value
    assert all(type(x) is int for x in params.stop_token_ids)
    assert params == SamplingParams(**{field: value}, stop_token_ids=[lo])  # one value, one params
    json.dumps(params.__dict__)  # numpy scalars would not serialize
    SamplingArrays.from_params([params.with_resolved_seed()])


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(FLOAT_TYPES), st.floats(0, 100), st.floats(0.01, 1))
def test_numpy_floats_are_accepted_as_python_floats(t: type, temperature: float, top_p: float) -> None:
    params = SamplingParams(temperature=t(temperature), top_p=t(top_p))
    assert type(params.temperature) is float and type(params.top_p) is float
    assert params.temperature == float(t(temperature)) and params.top_p == float(t(top_p))


@pytest.mark.parametrize("field", ["temperature", "top_p", "top_k", "max_tokens", "seed"])
@pytest.mark.parametrize("flag", [True, False, np.True_, np.False_])
def test_bools_are_refused_by_every_numeric_field(field: str, flag) -> None:
    """max_tokens=True is a bug in the caller, not a request for 1 token."""
    with pytest.raises(ValueError, match=rf"invalid SamplingParams: {field} must be"):
        SamplingParams(**{field: flag})


@pytest.mark.parametrize("kwargs, message", [
    (dict(stop_token_ids=[True]), "stop_token_ids must be ints"),
    (dict(stop_token_ids=[np.int64(-1)]), "stop_token_ids must be ints"),
    (dict(stop_token_ids=5), "stop_token_ids must be a sequence"),
    (dict(stop=7), "stop must be a sequence"),
    (dict(ignore_eos=1), "ignore_eos must be a bool"),
    (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output must be a bool"),
    (dict(seed=np.int64(-1)), "seed must be None"),
    (dict(seed=np.uint64(2**32)), "seed must be None"),
    (dict(top_k=np.float64(2.0)), "top_k must be an int"),
    (dict(temperature=np.float32("nan")), "temperature must be a finite number"),
    (dict(temperature=10**400), "temperature must be a finite number"),
    (dict(top_p=np.float64(1.5)), "top_p must be in"),
    (dict(output_kind="delta"), "output_kind must be one of"),
])
def test_other_bad_values_name_their_field(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_numpy_bool_is_a_bool_for_ignore_eos() -> None:
    params = SamplingParams(ignore_eos=np.True_)
    assert params.ignore_eos is True


def test_a_string_is_not_a_list_of_choices() -> None:
    """Iterated, "positive" would constrain the output to one of its letters."""
    with pytest.raises(ValueError, match="choice must be a sequence of strings, got the string"):
        StructuredOutput(choice="positive")
    assert StructuredOutput(choice=["positive"]).choice == ("positive",)


@pytest.mark.parametrize("temperature, greedy", [
    (0.0, True), (5e-324, True), (1e-38, True), (SAMPLING_EPS / 2, True),
    (SAMPLING_EPS, False), (0.7, False)])
def test_a_temperature_below_the_epsilon_is_greedy(temperature: float, greedy: bool) -> None:
    """As vLLM: one rule, which the device arrays follow (0 marks a greedy row there)."""
    params = SamplingParams(temperature=temperature, seed=0)
    assert params.greedy == greedy
    row = float(SamplingArrays.from_params([params]).temperature[0])
    assert (row == 0.0) == greedy


@pytest.mark.parametrize("t", INT_TYPES[:5])
def test_a_top_k_of_minus_one_is_off_as_in_vllm(t: type) -> None:
    """vLLM takes top_k 0 or -1 (its old default) for "all tokens": -1 was refused here, so
    params written for vLLM failed. It is the one spelling of off, 0, from then on."""
    params = SamplingParams(temperature=1.0, top_k=t(-1), seed=3)
    assert params == SamplingParams(temperature=1.0, top_k=0, seed=3)
    assert int(SamplingArrays.from_params([params]).top_k[0]) == 0
    for bad in (-2, -100):
        with pytest.raises(ValueError, match="top_k must be"):
            SamplingParams(top_k=t(bad))
