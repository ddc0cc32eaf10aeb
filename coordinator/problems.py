"""What a task hands out and what scoring may raise: a problem (a prompt, its answer, and the conversation
when the prompt is chat-format), a dataset row's prompt read as either, and the failure of user code
that costs one sample. Below the tasks, the datasets and the user code's workers, which all use them."""

from __future__ import annotations

from dataclasses import dataclass

Messages = tuple[tuple[str, str], ...]  # (role, content) per turn


class CallFailed(RuntimeError):
    """User code (a reward, an episode) that timed out, crashed, ran out of memory or raised in its worker
    (coordinator/user_code.py): the batch scores its sample 0, counts it and records an event."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # timed out | crashed | out of memory | raised


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str  # the text sent, or a conversation's last message (what a reward function sees)
    answer: str
    messages: Messages | None = None  # a chat-format prompt, sent instead of ``prompt``


def parse_prompt(value: object, where: str, key: str = "prompt") -> tuple[str, Messages | None]:
    """A dataset row's prompt: text, or a list of {"role", "content"} messages (chat format)."""
    if isinstance(value, str):
        return value, None
    if (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    ):
        messages = tuple((m["role"], m["content"]) for m in value)
        return messages[-1][1], messages
    raise ValueError(f"{where}: {key!r} must be text or a non-empty list of {{role, content}} messages")
