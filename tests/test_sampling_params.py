"""SamplingParams: validation names the bad field; defaults and conversions."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tandem.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "1.0"),
        ("top_p", 0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("top_k", -2),
        ("top_k", 3.0),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("min_p", float("inf")),
        ("seed", 1.5),
        ("seed", "42"),
        ("stop", ("ok", "")),
        ("stop", [""]),
        ("stop_token_ids", (-1,)),
    ],
)
def test_invalid_value_raises_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**{field: value})


def test_defaults_are_valid() -> None:
    params = SamplingParams()
    assert params.max_tokens == 16
    assert params.temperature == 1.0 and not params.is_greedy
    assert params.top_p == 1.0 and params.top_k == -1 and params.min_p == 0.0
    assert params.seed is None and params.stop == () and params.stop_token_ids == ()
    assert not params.ignore_eos and not params.logprobs


def test_boundary_values_are_valid() -> None:
    params = SamplingParams(max_tokens=1, temperature=0, top_p=1, top_k=0, min_p=1, seed=0)
    assert params.is_greedy
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1, min_p=0, top_p=1e-6, seed=-5).top_k == 1


def test_lists_become_tuples() -> None:
    # Lists and a lone string are what this checks: accepted at run time, outside the field types.
    params = SamplingParams(stop=["\n\n", "END"], stop_token_ids=[2, 7])  # type: ignore[arg-type]
    assert params.stop == ("\n\n", "END") and isinstance(params.stop, tuple)
    assert params.stop_token_ids == (2, 7) and isinstance(params.stop_token_ids, tuple)
    assert SamplingParams(stop="###").stop == ("###",)  # type: ignore[arg-type]
    hash(params)  # frozen and made of tuples: usable as a key


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]
