"""One reading of a request's sampling distribution for rollout and trainer, refusing what vLLM would
refuse (or silently change) before any engine sees it."""

from __future__ import annotations

import math

import pytest

from fp8rl.errors import InvalidRequest
from fp8rl.sampling import SamplingSettings, sampling_settings
from fp8rl.v1 import common_pb2


def test_unset_fields_take_their_defaults() -> None:
    assert sampling_settings(common_pb2.SamplingParams()) == SamplingSettings(1.0, 0, 1.0)
    assert sampling_settings(common_pb2.SamplingParams(top_k=5, top_p=0.5)) == SamplingSettings(1.0, 5, 0.5)
    # Greedy: vLLM drops top-k / top-p, so its logprobs are the raw model's; the trainer must agree.
    greedy = sampling_settings(common_pb2.SamplingParams(temperature=0.0, top_k=5, top_p=0.5))
    assert greedy == SamplingSettings(0.0, 0, 1.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", -0.5),
        ("temperature", 2.5),  # vLLM refuses > 2
        ("temperature", 0.005),  # vLLM would sample at 0.01 instead: the trainer would score another T
        ("top_p", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
    ],
)
def test_values_an_engine_would_refuse_or_change_are_refused_naming_the_field(
    field: str, value: float
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        sampling_settings(common_pb2.SamplingParams(**{field: value}))
    assert refused.value.field == f"sampling.{field}"


def test_the_edges_of_the_engine_ranges_are_accepted() -> None:
    for temperature in (0.0, 0.01, 2.0):
        assert sampling_settings(
            common_pb2.SamplingParams(temperature=temperature)
        ).temperature == pytest.approx(temperature)
