from __future__ import annotations

import math
import re

import pytest

from deltaserve.errors import RequestValidationError, UnsupportedRequestError
from deltaserve.sampling_params import SamplingParams


def test_defaults_are_vllms_and_valid() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs, p.logit_bias) == (None, None, 0, None, None)
    assert (p.ignore_eos, p.skip_special_tokens, p.spaces_between_special_tokens) == (False, True, True)
    assert p.include_stop_str_in_output is False
    p.validate()


def test_stop_is_normalised_to_a_list() -> None:
    assert SamplingParams().stop == []
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams().stop_token_ids == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "0.7"),
        ("top_p", 0),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 2.0),
        ("top_k", True),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3),
        ("frequency_penalty", math.nan),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("max_tokens", 0),
        ("max_tokens", 16.0),
        ("max_tokens", True),
        ("min_tokens", -1),
        ("min_tokens", 1.5),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
        ("seed", -(2**63) - 1),
        ("seed", 2**63),
        ("seed", 1.5),
        ("n", 0),
        ("n", 1.0),
        ("ignore_eos", "true"),
        ("skip_special_tokens", 1),
        ("spaces_between_special_tokens", None),
        ("include_stop_str_in_output", "false"),
    ],
)
def test_invalid_value_is_rejected_naming_field_and_value(field: str, value: object) -> None:
    with pytest.raises(RequestValidationError) as err:
        SamplingParams(**{field: value}).validate()
    assert err.value.field == field
    assert field in str(err.value)
    assert repr(value) in str(err.value)
    assert not isinstance(err.value, UnsupportedRequestError)


def test_messages_state_expected_and_found() -> None:
    with pytest.raises(RequestValidationError, match=r"^temperature must be a finite number >= 0, got nan$"):
        SamplingParams(temperature=math.nan).validate()
    with pytest.raises(RequestValidationError, match=r"^top_p must be in \(0, 1\], got 0$"):
        SamplingParams(top_p=0).validate()


@pytest.mark.parametrize(
    ("kwargs", "found"),
    [
        ({"stop": [""]}, "''"),
        ({"stop": ["ok", 3]}, "3"),
        ({"stop": 7}, "7"),
        ({"stop_token_ids": ["2"]}, "'2'"),
        ({"stop_token_ids": [True]}, "True"),
        ({"logit_bias": {5: 100.5}}, "100.5"),
        ({"logit_bias": {5: math.nan}}, "nan"),
        ({"logit_bias": {"5": 1.0}}, "'5'"),
        ({"logit_bias": [(5, 1.0)]}, "[(5, 1.0)]"),
    ],
)
def test_invalid_collections_are_rejected(kwargs: dict, found: str) -> None:
    (field,) = kwargs
    with pytest.raises(RequestValidationError) as err:
        SamplingParams(**kwargs).validate()
    assert err.value.field == field
    assert str(err.value).startswith(field)
    assert str(err.value).endswith(f"got {found}")


def test_min_tokens_above_max_tokens_is_rejected() -> None:
    SamplingParams(min_tokens=5, max_tokens=5).validate()
    with pytest.raises(RequestValidationError) as err:
        SamplingParams(min_tokens=6, max_tokens=5).validate()
    assert err.value.field == "min_tokens"
    assert "max_tokens (5)" in str(err.value) and "got 6" in str(err.value)


def test_allowed_token_ids_must_leave_a_token_that_nothing_forbids() -> None:
    """Every allowed id forbidden (a one-token bad word, or held back by min_tokens) leaves the sampler
    no distribution: refused by name, with the ids."""
    eos = (9, 10)
    SamplingParams(allowed_token_ids=[5, 6], bad_words_token_ids=[[5], [1, 6]]).validate_samplable(eos)
    SamplingParams(
        allowed_token_ids=[9, 7], min_tokens=2, stop_token_ids=[7], ignore_eos=True
    ).validate_samplable(eos)
    SamplingParams(allowed_token_ids=[9]).validate_samplable(eos)  # no min_tokens: eos may end it
    refused = [
        (SamplingParams(allowed_token_ids=[5, 6], bad_words_token_ids=[[5], [6]]), "that bad_words does not"),
        (SamplingParams(allowed_token_ids=[9, 10], min_tokens=1), "min_tokens (1) holds back"),
        (
            SamplingParams(
                allowed_token_ids=[9, 7, 5], min_tokens=3, stop_token_ids=[7], bad_words_token_ids=[[5]]
            ),
            "end-of-sequence, stop and bad-word ids",
        ),
    ]
    for params, expected in refused:
        with pytest.raises(RequestValidationError, match=re.escape(expected)) as err:
            params.validate_samplable(eos)
        assert err.value.field == "allowed_token_ids"
        assert str(err.value).endswith(f"got {params.allowed_token_ids}")


def test_n_above_one_is_unsupported() -> None:
    with pytest.raises(UnsupportedRequestError, match="n > 1 is not supported") as err:
        SamplingParams(n=2).validate()
    assert err.value.field == "n"


@pytest.mark.parametrize("value", [-1, 21, True, 1.5])
def test_prompt_logprobs_is_an_integer_up_to_twenty(value) -> None:
    SamplingParams(prompt_logprobs=0).validate()
    SamplingParams(prompt_logprobs=20).validate()
    with pytest.raises(
        RequestValidationError, match=r"prompt_logprobs must be None or an integer in \[0, 20\]"
    ) as err:
        SamplingParams(prompt_logprobs=value).validate()
    assert err.value.field == "prompt_logprobs"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0},
        {"temperature": 2},
        {"top_p": 1e-9},
        {"top_p": 1},
        {"top_k": -1},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"repetition_penalty": 1e-3},
        {"max_tokens": 1, "min_tokens": 1},
        {"logprobs": 0},
        {"logprobs": 20},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"logit_bias": {0: -100, 7: 100.0}},
        {"stop": "x", "stop_token_ids": [0, 151645]},
        {"ignore_eos": True, "skip_special_tokens": False},
    ],
)
def test_edge_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs).validate()


def test_token_ids_must_lie_in_the_vocabulary() -> None:
    SamplingParams(stop_token_ids=[0, 99], logit_bias={99: 1.0}).validate_token_ids(100)
    with pytest.raises(RequestValidationError, match=r"stop_token_ids .*\[0, 100\), got 100$") as err:
        SamplingParams(stop_token_ids=[3, 100]).validate_token_ids(100)
    assert err.value.field == "stop_token_ids"
    with pytest.raises(RequestValidationError, match=r"logit_bias .*\[0, 100\), got -1$") as err:
        SamplingParams(logit_bias={-1: 1.0}).validate_token_ids(100)
    assert err.value.field == "logit_bias"


def test_temperatures_below_1e5_are_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert not SamplingParams().is_greedy
