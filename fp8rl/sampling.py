"""The sampling distribution of a request, read from the wire and validated as vLLM will take it. One
function for rollout and trainer: if they read the same request differently, the logprobs stop matching.
Pure (no torch, no I/O)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from fp8rl.errors import InvalidRequest
from fp8rl.v1 import common_pb2

# vLLM 0.32 refuses temperatures above 2 and raises those in (0, 0.01) to 0.01 with only a warning: the
# rollout would then sample at another temperature than the trainer scores at. Both are refused here.
# The wire carries float32: 0.01 arrives as 0.0099999998, which is accepted (vLLM's 0.01 is the same
# float32 number).
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 2.0
_MIN_WIRE_TEMPERATURE = struct.unpack("f", struct.pack("f", MIN_TEMPERATURE))[0]


@dataclass(frozen=True)
class SamplingSettings:
    """The distribution sampled from: logits / temperature (0 = greedy: left unscaled, and no top-k or
    top-p, as in vLLM), top-k (0 = off), then top-p."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


def sampling_settings(s: common_pb2.SamplingParams) -> SamplingSettings:
    """``s``'s distribution, unset fields at their defaults; InvalidRequest names a bad field before any
    engine sees it (a value the engine rejects on its own thread would fail other requests too)."""
    temperature = s.temperature if s.HasField("temperature") else 1.0
    top_k = s.top_k if s.HasField("top_k") else 0
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not (temperature == 0 or _MIN_WIRE_TEMPERATURE <= temperature <= MAX_TEMPERATURE):  # NaN, inf too
        raise InvalidRequest(
            "sampling.temperature",
            f"must be 0 (greedy) or lie in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {temperature}",
        )
    if not 0 < top_p <= 1:  # NaN too
        raise InvalidRequest("sampling.top_p", f"must lie in (0, 1], got {top_p}")
    if top_k < 0:
        raise InvalidRequest("sampling.top_k", f"must be >= 0 (0 = off), got {top_k}")
    if temperature == 0:  # greedy: vLLM drops top-k / top-p, so its logprobs are the raw model's
        return SamplingSettings(0.0, 0, 1.0)
    return SamplingSettings(temperature, top_k, top_p)
