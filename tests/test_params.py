"""nanoserve/params.py: SamplingParams refuses a bad value by name with its limit, accepts the
limits themselves, normalises stop strings and stop ids, and says what the sampler must do."""

from __future__ import annotations

import dataclasses

import pytest

from nanoserve import SamplingParams
from nanoserve.params import StructuredOutputs


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens=0 must be an integer >= 1"),
    ({"temperature": -0.5}, "temperature=-0.5 must be >= 0"),
    ({"temperature": float("nan")}, "temperature=nan must be >= 0"),
    ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]"),
    ({"top_k": -2}, "top_k=-2 must be -1 or 0"),
    ({"min_p": -0.1}, r"min_p=-0.1 must be in \[0, 1\]"),
    ({"min_p": 1.1}, r"min_p=1.1 must be in \[0, 1\]"),
    ({"n": 0}, "n=0 must be an integer in \\[1, 64\\]"),
    ({"min_tokens": 17, "max_tokens": 16}, "min_tokens=17 must be in \\[0, max_tokens=16\\]"),
    ({"min_tokens": -1}, "min_tokens=-1"),
    ({"repetition_penalty": 0.0}, "repetition_penalty=0.0 must be > 0"),
    ({"presence_penalty": 2.5}, "presence_penalty=2.5 must be in \\[-2, 2\\]"),
    ({"frequency_penalty": -3.0}, "frequency_penalty=-3.0 must be in \\[-2, 2\\]"),
    ({"logprobs": 21}, "logprobs=21 must be None or an integer in \\[0, 20\\]"),
    ({"stop": ["ok", ""]}, "must be non-empty strings"),
    ({"min_tokens": 5, "structured_outputs": StructuredOutputs(regex="[0-9]{2}")},
     "min_tokens=5 cannot be combined with structured_outputs"),
])
def test_bad_sampling_params_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 2.0}, "max_tokens=2.0 must be an integer >= 1"),
    ({"top_k": 1.5}, r"top_k=1.5 must be -1 or 0 \(no limit\) or a positive integer"),
    ({"top_p": float("nan")}, r"top_p=nan must be in \(0, 1\]"),
    ({"seed": "7"}, "seed='7' must be an integer or None"),
    ({"n": 65}, r"n=65 must be an integer in \[1, 64\]"),
    ({"n": 2.0}, r"n=2.0 must be an integer in \[1, 64\]"),
    ({"min_tokens": 1.0}, r"min_tokens=1.0 must be in \[0, max_tokens=16\]"),
    ({"repetition_penalty": -1.0}, "repetition_penalty=-1.0 must be > 0"),
    ({"presence_penalty": -2.5}, r"presence_penalty=-2.5 must be in \[-2, 2\]"),
    ({"frequency_penalty": 2.01}, r"frequency_penalty=2.01 must be in \[-2, 2\]"),
    ({"logprobs": -1}, r"logprobs=-1 must be None or an integer in \[0, 20\]"),
    ({"logprobs": 2.0}, r"logprobs=2.0 must be None or an integer in \[0, 20\]"),
    ({"stop": ("ok", 5)}, r"stop=\('ok', 5\) must be non-empty strings"),
    ({"stop": ""}, "stop='' must be non-empty strings"),
])
def test_wrong_types_and_far_sides_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "max_tokens": 1, "min_tokens": 0},
    {"top_k": 0, "top_p": 1e-9, "min_p": 1.0, "n": 64, "min_tokens": 16, "max_tokens": 16},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0, "logprobs": 0, "repetition_penalty": 1e-6},
    {"presence_penalty": 2.0, "frequency_penalty": -2.0, "logprobs": 20, "seed": 0, "n": 1},
])
def test_values_at_the_limits_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    assert all(getattr(params, name) == value for name, value in kwargs.items())


def test_a_single_stop_string_is_accepted_as_a_str():
    assert SamplingParams(stop="###").stop == ("###",)


def test_stop_strings_and_stop_ids_are_normalised_to_tuples():
    params = SamplingParams(stop=["a", "bc"], stop_token_ids=[5, True, 7])
    assert params.stop == ("a", "bc")
    assert params.stop_token_ids == (5, 1, 7) and all(type(t) is int for t in params.stop_token_ids)


def test_frozen():
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.0


def test_defaults_are_vllms():
    params = SamplingParams()
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (1.0, -1, 1.0, 0.0)
    assert (params.max_tokens, params.n, params.seed, params.logprobs) == (16, 1, None, None)
    assert (params.stop, params.stop_token_ids, params.ignore_eos, params.min_tokens) == ((), (), False, 0)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.0, 0.0, 0.0)


@pytest.mark.parametrize("kwargs, is_greedy, needs_history, has_filters", [
    ({}, False, False, False),
    ({"temperature": 0.0}, True, False, False),
    ({"temperature": 1e-6}, False, False, False),
    ({"top_k": 0}, False, False, False),  # 0 is no limit
    ({"top_k": 1}, False, False, True),
    ({"top_p": 0.99}, False, False, True),
    ({"min_p": 0.01}, False, False, True),
    ({"repetition_penalty": 1.1}, False, True, False),
    ({"presence_penalty": -0.5}, False, True, False),
    ({"frequency_penalty": 0.5}, False, True, False),
    ({"min_tokens": 1}, False, True, False),  # EOS is masked until then: the sampler counts output
    ({"temperature": 0.0, "top_k": 5, "min_tokens": 2}, True, True, True),
])
def test_what_the_sampler_must_do(kwargs, is_greedy, needs_history, has_filters):
    params = SamplingParams(**kwargs)
    assert (params.is_greedy, params.needs_history, params.has_filters) == (is_greedy, needs_history, has_filters)
