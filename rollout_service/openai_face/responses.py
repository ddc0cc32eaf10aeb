"""Completions -> OpenAI answers: the pieces the face builds its response models from, and the two
types the ``openai`` package lacks (a choice mid-stream, an echoed prompt's logprobs)."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from fp8rl.v1 import rollout_pb2


def ordered(completions: Iterable[rollout_pb2.Completion]) -> list[rollout_pb2.Completion]:
    return sorted(completions, key=lambda c: (int(c.prompt_id), c.sample_index))


@functools.cache
def streamed_choice() -> type:
    """A completion choice mid-stream, which has no finish reason yet (the ``openai`` package's type
    requires one)."""
    from openai.types import CompletionChoice

    class StreamedChoice(CompletionChoice):
        finish_reason: str | None = None  # type: ignore[assignment]

    return StreamedChoice


@functools.cache
def completion_logprobs() -> type:
    """OpenAI's completion logprobs as its API answers them: an echoed prompt's first token has none
    (null), which the ``openai`` package's type does not allow. Answers are serialized as their runtime
    types (``serialize_as_any``) for it."""
    from openai.types.completion_choice import Logprobs

    class CompletionLogprobs(Logprobs):
        token_logprobs: list[float | None] | None = None  # type: ignore[assignment]
        top_logprobs: list[dict[str, float] | None] | None = None  # type: ignore[assignment]

    return CompletionLogprobs


def scored_prompt(c: rollout_pb2.Completion) -> rollout_pb2.Completion:
    """``c`` without its completion: what ``echo`` with ``max_tokens: 0`` answers (the prompt, scored)."""
    shown = rollout_pb2.Completion()
    shown.CopyFrom(c)
    for name in ("token_ids", "logprobs", "top_logprobs"):
        shown.ClearField(name)
    shown.text, shown.finish_reason = "", "length"
    return shown


def usage_of(completions: list[rollout_pb2.Completion], prompt_tokens: int) -> Any:
    from openai.types import CompletionUsage

    generated = sum(len(c.token_ids) for c in completions)
    return CompletionUsage(
        prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated
    )
