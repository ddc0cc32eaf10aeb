"""Episodes: an agent's multi-turn conversation with the policy, recorded as the engine saw it.

Every call under ``/episodes/{id}/v1/...`` is a turn. A turn whose request extends the previous turn (the
same messages, then the assistant's reply as it was sampled, then anything new; for a completions
prompt, the previous prompt and completion, then more) is sent to the engine as the previous turn's exact
prompt ids and sampled ids followed by the new tokens: rendering the conversation again would
re-tokenize the reply (BPE need not give back the sampled ids) and train on tokens the policy never
sampled. A turn that does not extend the previous one is recorded as the start of a new sample, and says
so (``extends: false``).

:func:`samples_of` turns the recorded turns into training samples: each run of extending turns is one
sequence, the first turn's prompt, then everything after it, with a loss mask that covers only the
tokens the policy sampled.

The store lives in the replica's memory, bounded in episodes, turns and tokens, and forgets an episode
that has been idle too long; a restarted replica has forgotten them all (the caller's episode then
fails and is dropped, as a rollout that fails is).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from fp8rl.errors import InvalidRequest, Overloaded, PreconditionFailed
from fp8rl.v1 import rollout_pb2

EPISODE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class EpisodeLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_episodes: int = Field(1024, ge=1)
    """Episodes held at once; one more is refused (429) until one ends or expires."""
    max_turns: int = Field(64, ge=1)
    """Turns per episode."""
    max_tokens: int = Field(262144, ge=1)
    """Prompt and sampled tokens recorded per episode, over all its turns."""
    idle_s: float = Field(900.0, gt=0)
    """An episode without a call for this long is forgotten."""


class EpisodeNotFound(InvalidRequest):
    """No episode of this id (never started, ended, or expired)."""


@dataclass(frozen=True)
class Turn:
    prompt_token_ids: list[int]  # exactly what the engine was given
    token_ids: list[int]  # what it sampled
    logprobs: list[float]
    weight_version: int
    finish_reason: str
    extends: bool  # its prompt is the previous turn's prompt and sampled ids, then more
    text: str = ""
    # what the next turn must repeat to extend this one: chat messages with this turn's reply, or a
    # completions prompt's text followed by this turn's completion
    context: Any = None

    def as_json(self) -> dict[str, Any]:
        return {
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "weight_version": self.weight_version,
            "finish_reason": self.finish_reason,
            "extends": self.extends,
            "text": self.text,
        }


@dataclass
class Episode:
    id: str
    turns: list[Turn] = field(default_factory=list)
    tokens: int = 0
    busy: bool = False
    last_used: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "turns": [t.as_json() for t in self.turns],
            "samples": [s.as_json() for s in samples_of(self.turns)],
        }


@dataclass(frozen=True)
class EpisodeSample:
    """One training sequence of an episode: ``prompt_token_ids`` then ``completion_token_ids``; the
    policy sampled the completion tokens where ``loss_mask`` is true (their ``logprobs`` are the rollout's;
    0 elsewhere)."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    loss_mask: list[bool]
    weight_versions: list[int]  # one per turn (the oldest decides the sample's staleness)
    turns: list[int]  # the episode's turns it holds

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def samples_of(turns: list[Turn]) -> list[EpisodeSample]:
    """Each run of extending turns as one sample (see the module's docstring)."""
    out: list[EpisodeSample] = []
    runs: list[list[int]] = []
    for i, turn in enumerate(turns):
        if turn.extends and runs:
            runs[-1].append(i)
        else:
            runs.append([i])
    for run in runs:
        first, last = turns[run[0]], turns[run[-1]]
        start = len(first.prompt_token_ids)
        completion = last.prompt_token_ids[start:] + last.token_ids
        logprobs, mask = [0.0] * len(completion), [False] * len(completion)
        for i in run:
            at = len(turns[i].prompt_token_ids) - start
            logprobs[at : at + len(turns[i].token_ids)] = turns[i].logprobs
            mask[at : at + len(turns[i].token_ids)] = [True] * len(turns[i].token_ids)
        out.append(
            EpisodeSample(
                list(first.prompt_token_ids),
                completion,
                logprobs,
                mask,
                [turns[i].weight_version for i in run],
                run,
            )
        )
    return out


def spliced_chat(
    previous: Turn | None,
    messages: list[dict[str, str]],
    render: Callable[[list[dict[str, str]], bool], list[int]],
    tokenize: Callable[[str], list[int]],
    eos: int | None,
) -> tuple[list[int], bool]:
    """The prompt ids for a chat turn and whether it extends ``previous``. ``render(messages,
    generation_prompt)`` is the chat template's tokenization, ``tokenize`` plain text's.

    It extends when ``messages`` start with the previous turn's messages and its reply (the text as
    sampled), and the template renders that history as the previous prompt, the reply's text and what the
    template closes a turn with (e.g. ``<|im_end|>\n``), then the new prompt. The previous prompt and the
    reply's text are then replaced by the previous turn's exact ids: its prompt and its sampled ids. When
    the policy sampled the end of its turn (``eos``) and the template renders one there too, that one is the
    policy's. (A template that closes a turn without ``eos`` follows the sampled ``eos`` with its own
    closing: the sequence the engine then sees is the one trained on.)"""
    new = render(messages, True)
    if previous is None or not isinstance(previous.context, list):
        return new, False
    history: list[dict[str, str]] = previous.context
    if messages[: len(history)] != history or history[-1]["role"] != "assistant":
        return new, False
    before, rendered = render(history[:-1], True), render(history, False)
    content = tokenize(history[-1]["content"]) if history[-1]["content"] else []
    reply = rendered[len(before) :]
    if (
        new[: len(rendered)] != rendered
        or rendered[: len(before)] != before
        or reply[: len(content)] != content
    ):
        return new, False
    closing = reply[len(content) :]
    if closing and eos is not None and closing[0] == eos and previous.token_ids[-1:] == [eos]:
        closing = closing[1:]
    return previous.prompt_token_ids + previous.token_ids + closing + new[len(rendered) :], True


def spliced_ids(previous: Turn | None, ids: list[int]) -> tuple[list[int], bool]:
    """A completions turn given as token ids extends ``previous`` when it starts with its exact ids."""
    if previous is None:
        return ids, False
    prefix = previous.prompt_token_ids + previous.token_ids
    return ids, ids[: len(prefix)] == prefix and len(ids) > len(prefix)


def spliced_text(
    previous: Turn | None, text: str, tokenize: Callable[[str], list[int]]
) -> tuple[list[int], bool]:
    """A completions turn given as text extends ``previous`` when it starts with the previous prompt's
    text and its completion: the new text alone is tokenized and appended to the exact ids."""
    if previous is None or not isinstance(previous.context, str) or not text.startswith(previous.context):
        return tokenize(text), False
    rest = text[len(previous.context) :]
    return previous.prompt_token_ids + previous.token_ids + (tokenize(rest) if rest else []), True


class Episodes:
    """The replica's episodes; thread-safe (HTTP handlers run on worker threads)."""

    def __init__(self, limits: EpisodeLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self._episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()

    def _expire(self) -> None:
        now = self.clock()
        # (a turn in flight that long lost its caller: a stream that never started ends nothing)
        for key in [k for k, e in self._episodes.items() if now - e.last_used > self.limits.idle_s]:
            del self._episodes[key]

    def begin(self, episode_id: str) -> Episode:
        """Holds ``episode_id`` (started on first use) for one turn, until :meth:`finish`: another turn
        of it meanwhile is refused (a conversation is sequential), and so is a turn past the bounds."""
        if not EPISODE_ID.fullmatch(episode_id):
            raise InvalidRequest("episode_id", f"must match {EPISODE_ID.pattern}, got {episode_id[:140]!r}")
        with self._lock:
            self._expire()
            episode = self._episodes.get(episode_id)
            if episode is None:
                if len(self._episodes) >= self.limits.max_episodes:
                    raise Overloaded(f"{self.limits.max_episodes} episodes are open: end one first")
                episode = self._episodes[episode_id] = Episode(episode_id)
            if episode.busy:
                raise PreconditionFailed(f"episode {episode_id!r} has a turn in flight: turns are sequential")
            if len(episode.turns) >= self.limits.max_turns:
                raise InvalidRequest(
                    "episode_id", f"episode {episode_id!r} has had its {self.limits.max_turns} turns"
                )
            episode.busy, episode.last_used = True, self.clock()
        return episode

    def finish(self, episode: Episode) -> None:
        """Ends the turn :meth:`begin` held; an episode whose first turn failed is not kept."""
        with self._lock:
            episode.busy, episode.last_used = False, self.clock()
            if not episode.turns and self._episodes.get(episode.id) is episode:
                del self._episodes[episode.id]

    def record(self, episode: Episode, turn: Turn) -> None:
        tokens = len(turn.prompt_token_ids) + len(turn.token_ids)
        with self._lock:
            if episode.tokens + tokens > self.limits.max_tokens:
                raise InvalidRequest(
                    "episode_id",
                    f"episode {episode.id!r} would hold more than {self.limits.max_tokens} tokens",
                )
            episode.turns.append(turn)
            episode.tokens += tokens

    def check_room(self, episode: Episode, prompt_tokens: int, max_tokens: int) -> None:
        """Refuses, before it runs, a turn whose prompt and completion could pass the token bound."""
        if episode.tokens + prompt_tokens + max_tokens > self.limits.max_tokens:
            raise InvalidRequest(
                "episode_id",
                f"episode {episode.id!r} holds {episode.tokens} tokens; this turn could add "
                f"{prompt_tokens + max_tokens}, past its {self.limits.max_tokens}",
            )

    def turn(self, episode_id: str) -> EpisodeTurn:
        """A call under ``/episodes/{episode_id}/v1``: the episode held (:meth:`begin`) for its turn."""
        return EpisodeTurn(self, self.begin(episode_id))

    def get(self, episode_id: str) -> Episode:
        with self._lock:
            self._expire()
            episode = self._episodes.get(episode_id)
        if episode is None:
            raise EpisodeNotFound(
                "episode_id", f"no episode {episode_id[:140]!r} (never started, ended, or expired)"
            )
        return episode

    def end(self, episode_id: str) -> Episode:
        episode = self.get(episode_id)
        with self._lock:
            if episode.busy:
                raise PreconditionFailed(f"episode {episode_id!r} has a turn in flight")
            self._episodes.pop(episode_id, None)
        return episode

    def __len__(self) -> int:
        with self._lock:
            return len(self._episodes)


class ChatTokenizer(Protocol):
    """What splicing a turn needs of the engine (rollout_service.engine.Engine has it)."""

    @property
    def has_chat_template(self) -> bool: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def tokenize(self, text: str) -> list[int]: ...

    def tokenize_chat(self, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]: ...


class CallScope:
    """What an OpenAI call does around its generation. Outside an episode (:data:`OUTSIDE_EPISODES`):
    nothing. An episode's turn (:class:`EpisodeTurn`) continues the episode's exact ids, stays within its
    bounds, records what was sampled and frees the episode."""

    def prompts(
        self, prompts: list[rollout_pb2.Prompt], body: dict[str, Any], engine: ChatTokenizer
    ) -> list[rollout_pb2.Prompt]:
        """The prompts the engine is given for the request's ``prompts``."""
        return prompts

    def check_room(self, request: rollout_pb2.GenerateRequest, max_tokens: Callable[[], int]) -> None:
        """Refuse, before it runs, a request that could pass the scope's bounds (``max_tokens``: the most
        completion tokens the request may sample, computed on demand)."""

    def record(self, completion: rollout_pb2.Completion) -> None:
        """The call's (first) completion, once finished."""

    def finish(self) -> None:
        """The call is over (answered, failed or abandoned)."""


OUTSIDE_EPISODES = CallScope()


class EpisodeTurn(CallScope):
    """One turn of a held episode: from :meth:`Episodes.turn` until :meth:`finish`."""

    def __init__(self, episodes: Episodes, episode: Episode) -> None:
        self.episodes, self.episode = episodes, episode
        self.extends: bool = False  # (what the recorded turn needs: see Turn)
        self.context: Any = None

    def prompts(
        self, prompts: list[rollout_pb2.Prompt], body: dict[str, Any], engine: ChatTokenizer
    ) -> list[rollout_pb2.Prompt]:
        """The turn's one prompt as the exact ids it continues (see the module's docstring)."""
        if body.get("echo"):
            raise InvalidRequest("echo", "not within an episode: a turn samples")
        if len(prompts) != 1:
            raise InvalidRequest("prompt", "an episode's turn has one prompt")
        if (body.get("n") or 1) != 1:
            raise InvalidRequest("n", "an episode's turn samples once (n: 1)")
        previous = self.episode.turns[-1] if self.episode.turns else None
        [prompt] = prompts
        if prompt.HasField("chat"):
            messages = [{"role": m.role, "content": m.content} for m in prompt.chat.messages]
            if not engine.has_chat_template:
                raise InvalidRequest("messages", "the model has no chat template")
            ids, self.extends = spliced_chat(
                previous, messages, engine.tokenize_chat, engine.tokenize, engine.eos_token_id
            )
            self.context = messages
        elif prompt.HasField("text"):
            ids, self.extends = spliced_text(previous, prompt.text, engine.tokenize)
            self.context = prompt.text
        else:
            ids, self.extends = spliced_ids(previous, list(prompt.token_ids.ids))
        return [rollout_pb2.Prompt(token_ids={"ids": ids})]

    def check_room(self, request: rollout_pb2.GenerateRequest, max_tokens: Callable[[], int]) -> None:
        self.episodes.check_room(self.episode, len(request.prompts[0].token_ids.ids), max_tokens())

    def record(self, completion: rollout_pb2.Completion) -> None:
        c, context = completion, self.context
        if isinstance(context, list):
            context = [*context, {"role": "assistant", "content": c.text}]
        elif isinstance(context, str):
            context += c.text
        turn = Turn(
            list(c.prompt_token_ids),
            list(c.token_ids),
            list(c.logprobs),
            c.weight_version,
            c.finish_reason,
            self.extends,
            c.text,
            context,
        )
        self.episodes.record(self.episode, turn)

    def finish(self) -> None:
        self.episodes.finish(self.episode)
