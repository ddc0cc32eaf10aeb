"""OpenAI-compatible HTTP face of a replica, for agent and environment frameworks: ``POST /v1/completions``,
``POST /v1/chat/completions`` (plain, or SSE with ``stream``), ``GET /v1/models``.

The same engine, validation and version rules as gRPC: each request becomes a ``GenerateRequest`` for
:meth:`RolloutService.generate`. Requests are validated with the ``openai`` package's own parameter types
and answers are built from its response models, plus what RL needs: each choice's sampled ``token_ids``
and ``prompt_token_ids``, and the ``weight_version`` that produced them (also the ``X-Weight-Version``
header). A version can be required with the ``X-Weight-Version`` header or a ``weight_version`` body
field (409 when the replica holds another); ``top_k`` is accepted in the body too. Logprobs are those of
the sampled tokens (the distribution they were sampled from, as over gRPC), with up to the replica's
``max_top_logprobs`` alternatives per token when asked (``logprobs: N``; chat's ``top_logprobs``).
``echo`` returns the prompt with its logprobs (the model's raw distribution); with ``max_tokens: 0`` it
only scores the prompt (one token is generated and dropped: the engine generates at least one). A
stream sends the tokens as the engine generates them (a chunk per engine step and choice, with their
ids and logprobs; the last of each choice has its finish reason), then ``[DONE]``. A client that goes
away cancels its generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, cast

import grpc
from fastapi import FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import TypeAdapter, ValidationError
from pydantic.json_schema import JsonSchemaMode

from fp8rl.errors import Cancelled, InvalidRequest, Overloaded
from fp8rl.security import SecurityConfig, bearer_role, read_tokens
from fp8rl.serving import STATUS_OF, status_of
from fp8rl.v1 import common_pb2, rollout_pb2
from rollout_service.episodes import (
    Episode,
    EpisodeNotFound,
    Episodes,
    Turn,
    spliced_chat,
    spliced_ids,
    spliced_text,
)
from rollout_service.service import Generation, RolloutService
from rollout_service.validation import parse_sampling

VERSION_HEADER = "X-Weight-Version"

# gRPC status of a domain error (fp8rl.serving's one table) -> HTTP status and OpenAI error type.
HTTP_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),
    # A limit of the replica's (samples per request, queued samples): was a 500 (found by schemathesis).
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
}


class UnknownModel(InvalidRequest):
    """A request for a model this replica does not serve."""


def error_response(exc: Exception) -> JSONResponse:
    unknown = isinstance(exc, (UnknownModel, EpisodeNotFound))
    code = grpc.StatusCode.NOT_FOUND if unknown else status_of(exc)
    status, kind = HTTP_OF.get(code, (500, "server_error"))
    param = openai_param(exc.field) if isinstance(exc, InvalidRequest) else None
    body = {"error": {"message": str(exc), "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


def openai_param(field: str) -> str:
    """Our field name -> the OpenAI request's (``sampling.max_tokens`` -> ``max_tokens``)."""
    field = field.removeprefix("sampling.")
    if re.match(r"prompts\[\d+\]\.chat", field):
        return "messages"
    return "prompt" if field.startswith("prompts") else field


def _adapters() -> tuple[TypeAdapter[Any], TypeAdapter[Any]]:
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    return (
        TypeAdapter(completion_create_params.CompletionCreateParamsBase),
        TypeAdapter(chat_create_params.CompletionCreateParamsBase),
    )


def json_body(raw: bytes) -> Any:
    """The request body as JSON. Every way bytes fail to be JSON is the client's: not UTF-8, not JSON,
    an integer of more digits than Python reads (a ValueError, not a JSONDecodeError), nesting deeper than
    the parser recurses."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest("body", f"is not JSON: {exc}") from None


def validated(adapter: TypeAdapter[Any], body: Any, lazy: tuple[str, ...] = ()) -> dict[str, Any]:
    """``body`` if OpenAI's type ``adapter`` holds it, strictly; the ``lazy`` fields' items too."""
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    try:
        checked = adapter.validate_python(body, strict=True)  # no coercion: "0.5" is no temperature
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidRequest(".".join(str(p) for p in first["loc"]) or "body", first["msg"]) from None
    for name in lazy:
        if isinstance(body.get(name), list):  # (a string is an Iterable too: left to the caller's check)
            drain(checked[name], name)
    return body


def drain(value: Any, path: str) -> None:
    """Consume what pydantic validated lazily: OpenAI's types declare ``messages``, tool calls and
    content parts as ``Iterable``, whose items are checked only when iterated (found by schemathesis: a
    message breaking its type was accepted). An item's error names where it lies (``messages.2``). Not
    for a union of iterables (``prompt``: pydantic picks its first, lazy, member for any list)."""
    if isinstance(value, Iterator):
        try:
            value = list(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            index = [str(p) for p in first["loc"][:1] if isinstance(p, int)]
            rest = ".".join(str(p) for p in first["loc"][len(index) :])
            raise InvalidRequest(
                ".".join([path, *index]), f"{rest}: {first['msg']}" if rest else first["msg"]
            ) from None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        drain(item, f"{path}.{key}" if path else str(key))


def refuse_unsupported(body: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Parameters this server cannot honour are refused when set to anything but their default."""
    for name, default in defaults.items():
        if body.get(name) not in (None, default):
            raise InvalidRequest(name, f"not supported by this server (only {default!r})")


def sampling_of(body: dict[str, Any], max_tokens_key: str) -> common_pb2.SamplingParams:
    stop = body.get("stop")
    sampling = common_pb2.SamplingParams(stop=[stop] if isinstance(stop, str) else list(stop or []))
    for ours, theirs in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("seed", "seed"),
        ("max_tokens", max_tokens_key),
    ):
        value = body.get(theirs)
        if value is None:
            continue
        if ours in ("top_k", "seed", "max_tokens") and not is_int(value):
            raise InvalidRequest(theirs, f"must be an integer, got {value!r}")
        setattr(sampling, ours, value)
    return sampling


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def required_version(body: dict[str, Any], headers: Any) -> int | None:
    header, field = headers.get(VERSION_HEADER), body.get("weight_version")
    if header is not None and not re.fullmatch(r"-?\d+", header.strip()):
        raise InvalidRequest(VERSION_HEADER, f"must be an integer, got {header!r}")
    from_header = None if header is None else int(header)
    if field is not None and not is_int(field):
        raise InvalidRequest("weight_version", f"must be an integer, got {field!r}")
    if None not in (from_header, field) and from_header != field:
        raise InvalidRequest("weight_version", f"body says {field}, header {VERSION_HEADER} says {header}")
    return field if field is not None else from_header


@contextlib.contextmanager
def fitting(field: str) -> Iterator[None]:
    """Around building wire messages from a body that passed OpenAI's types: a value the wire cannot hold
    (an integer beyond its range, text with a lone UTF-16 surrogate, which JSON can spell) is the
    client's error, named by ``field``."""
    try:
        yield
    except InvalidRequest:
        raise
    except (TypeError, ValueError, OverflowError) as exc:  # (UnicodeEncodeError is a ValueError)
        raise InvalidRequest(field, f"a value does not fit the request: {exc}") from None


def generate_request(
    body: dict[str, Any], headers: Any, prompts: list[rollout_pb2.Prompt], max_tokens_key: str
) -> rollout_pb2.GenerateRequest:
    with fitting("body"):
        request = rollout_pb2.GenerateRequest(prompts=prompts, sampling=sampling_of(body, max_tokens_key))
        if body.get("n") is not None:
            request.n = body["n"]
        version = required_version(body, headers)
        if version is not None:
            request.weight_version = version
    return request


def completion_prompts(prompt: Any) -> list[rollout_pb2.Prompt]:
    """OpenAI's ``prompt``: a string, a list of strings, a list of token ids, or a list of those lists."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(map(is_int, prompt))):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest("prompt", "must be text, token ids, or a non-empty list of either")
    prompts = []
    for p in prompt:
        if isinstance(p, str):
            prompts.append(rollout_pb2.Prompt(text=p))
        elif isinstance(p, list) and all(map(is_int, p)):
            prompts.append(rollout_pb2.Prompt(token_ids={"ids": p}))
        else:
            raise InvalidRequest("prompt", "each prompt must be text or a list of token ids")
    return prompts


def chat_prompt(messages: Any) -> rollout_pb2.Prompt:
    """OpenAI's ``messages`` as a chat prompt: roles and text content (parts of type text) only."""
    if not isinstance(messages, list):
        raise InvalidRequest("messages", "must be a list of messages")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}]", "must be an object with a role")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
                raise InvalidRequest(f"messages[{i}].content", "only text parts can be rendered")
            content = "".join(str(part.get("text", "")) for part in content)
        if content is not None and not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content", "must be text or a list of text parts")
        turns.append(rollout_pb2.ChatMessage(role=message["role"], content=content or ""))
    return rollout_pb2.Prompt(chat=rollout_pb2.ChatMessages(messages=turns))


def ordered(completions: Iterable[rollout_pb2.Completion]) -> list[rollout_pb2.Completion]:
    return sorted(completions, key=lambda c: (int(c.prompt_id), c.sample_index))


class OpenAIFace:
    """Turns OpenAI requests into Generate calls and completions into OpenAI answers."""

    def __init__(self, service: RolloutService, model_name: str) -> None:
        self.service, self.model_name = service, model_name
        self.completion_params, self.chat_params = _adapters()
        self.episodes = Episodes(service.config.episodes)

    def token_texts(self, ids: Iterable[int]) -> list[str]:
        return [self.service.engine.tokenizer.decode([t]) for t in ids]

    def check_model(self, body: dict[str, Any]) -> None:
        if body.get("model") != self.model_name:
            raise UnknownModel("model", f"this replica serves {self.model_name!r}, not {body.get('model')!r}")

    # -- /v1/completions ----------------------------------------------------------------------------
    def completions(
        self, body: Any, headers: Any, episode: Episode | None = None
    ) -> tuple[Generation, dict[str, Any]]:
        body = validated(self.completion_params, body)
        self.check_model(body)
        refuse_unsupported(body, {"best_of": 1, "suffix": "", "presence_penalty": 0, "frequency_penalty": 0})
        if body.get("logit_bias"):
            raise InvalidRequest("logit_bias", "not supported by this server")
        top = body.get("logprobs")
        if top is not None and not (is_int(top) and top >= 0):
            raise InvalidRequest("logprobs", f"must be an integer >= 0, got {top!r}")
        echo = bool(body.get("echo"))
        score_only = echo and body.get("max_tokens") == 0
        asked = {**body, "max_tokens": 1} if score_only else body
        with fitting("prompt"):
            prompts = completion_prompts(body["prompt"])
        if episode is not None:
            if echo:
                raise InvalidRequest("echo", "not within an episode: a turn samples")
            prompts, body = self.episode_turn(episode, body, prompts)
        request = generate_request(asked, headers, prompts, "max_tokens")
        request.top_logprobs = top or 0
        request.prompt_logprobs = echo and top is not None
        if echo and body.get("stream"):
            raise InvalidRequest("echo", "not streamed by this server: ask without stream")
        if episode is not None:
            self.check_room(episode, request)
        try:
            generation = self.service.generate(request, stream=bool(body.get("stream")))
        except InvalidRequest as exc:
            if exc.field != "top_logprobs":
                raise
            # (ours; these completions call it logprobs: found by schemathesis)
            raise InvalidRequest("logprobs", str(exc).removeprefix("top_logprobs: ")) from None
        return generation, {**body, SCORE_ONLY: score_only}

    # -- episodes -----------------------------------------------------------------------------------
    def episode_turn(
        self, episode: Episode, body: dict[str, Any], prompts: list[rollout_pb2.Prompt]
    ) -> tuple[list[rollout_pb2.Prompt], dict[str, Any]]:
        """A turn's one prompt as the exact ids it continues (rollout_service/episodes.py), and the body
        with what recording it needs."""
        if len(prompts) != 1:
            raise InvalidRequest("prompt", "an episode's turn has one prompt")
        if (body.get("n") or 1) != 1:
            raise InvalidRequest("n", "an episode's turn samples once (n: 1)")
        previous = episode.turns[-1] if episode.turns else None
        prompt = prompts[0]
        if prompt.HasField("chat"):
            messages = [{"role": m.role, "content": m.content} for m in prompt.chat.messages]
            if not self.service.engine.has_chat_template:
                raise InvalidRequest("messages", "the model has no chat template")
            engine = self.service.engine
            ids, extends = spliced_chat(
                previous, messages, engine.tokenize_chat, engine.tokenize, engine.eos_token_id
            )
            context: Any = messages
        elif prompt.HasField("text"):
            ids, extends = spliced_text(previous, prompt.text, self.service.engine.tokenize)
            context = prompt.text
        else:
            ids, extends = spliced_ids(previous, list(prompt.token_ids.ids))
            context = None
        return [rollout_pb2.Prompt(token_ids={"ids": ids})], {**body, EPISODE: (episode, extends, context)}

    def check_room(self, episode: Episode, request: rollout_pb2.GenerateRequest) -> None:
        """Refuses a turn whose prompt and most completion tokens (as validation reads them) could pass
        the episode's token bound."""
        limits = self.service.limits
        most = parse_sampling(request.sampling, limits.max_model_len, limits.default_max_tokens).max_tokens
        self.episodes.check_room(episode, len(request.prompts[0].token_ids.ids), most)

    def record(self, body: dict[str, Any], c: rollout_pb2.Completion) -> None:
        """An episode's turn, once its completion finished."""
        episode, extends, context = body[EPISODE]
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
            extends,
            c.text,
            context,
        )
        self.episodes.record(episode, turn)

    def completion_choice(self, c: rollout_pb2.Completion, n: int, body: dict[str, Any]) -> Any:
        """OpenAI's choice of ``c``; with ``echo`` the prompt comes first, in the text and in the logprobs
        (its first token has none). ``token_ids`` stay the sampled ids, as gRPC's."""
        from openai.types import CompletionChoice

        echo, top = bool(body.get("echo")), body.get("logprobs")
        prompt = self.service.engine.tokenizer.decode(list(c.prompt_token_ids)) if echo else ""
        choice = CompletionChoice(
            index=int(c.prompt_id) * n + c.sample_index,
            text=prompt + c.text,
            finish_reason=c.finish_reason or "stop",
            token_ids=list(c.token_ids),
            prompt_token_ids=list(c.prompt_token_ids),
        )
        if top is not None:
            ids = [*(c.prompt_token_ids if echo else []), *c.token_ids]
            tokens = self.token_texts(ids)
            scored: list[float | None] = [*([None, *c.prompt_logprobs] if echo else []), *c.logprobs]
            offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
            alternatives = [*([None, *c.prompt_top_logprobs] if echo else []), *c.top_logprobs]
            choice.logprobs = completion_logprobs()(
                tokens=tokens,
                token_logprobs=scored,
                text_offset=offsets,
                top_logprobs=[None if a is None else self.alternatives(a) for a in alternatives]
                if top
                else None,
            )
        return choice

    def alternatives(self, a: rollout_pb2.TokenAlternatives) -> dict[str, float]:
        """A position's alternatives as OpenAI's legacy completions show them: token text -> logprob (two
        tokens with one text, e.g. partial UTF-8 bytes, keep the more likely's)."""
        shown: dict[str, float] = {}
        for text, logprob in zip(self.token_texts(a.token_ids), a.logprobs, strict=True):
            shown.setdefault(text, logprob)
        return shown

    def completion(
        self, completions: list[rollout_pb2.Completion], version: int, body: dict[str, Any]
    ) -> Any:
        completions = [scored_prompt(c) if body[SCORE_ONLY] else c for c in completions]
        prompt_tokens = sum(len(c.prompt_token_ids) for c in completions if c.sample_index == 0)
        return self.completion_of(completions, version, body, usage_of(completions, prompt_tokens))

    def completion_of(
        self, completions: list[rollout_pb2.Completion], version: int, body: dict[str, Any], usage: Any
    ) -> Any:
        from openai.types import Completion

        n = body.get("n") or 1
        return Completion(
            id=f"cmpl-{uuid.uuid4().hex}",
            object="text_completion",
            created=int(time.time()),
            model=self.model_name,
            choices=[self.completion_choice(c, n, body) for c in completions],
            usage=usage,
            weight_version=version,
        )

    # -- /v1/chat/completions -----------------------------------------------------------------------
    def chat(
        self, body: Any, headers: Any, episode: Episode | None = None
    ) -> tuple[Generation, dict[str, Any]]:
        body = validated(self.chat_params, body, lazy=("messages",))
        self.check_model(body)
        refuse_unsupported(body, {"presence_penalty": 0, "frequency_penalty": 0})
        top = body.get("top_logprobs")
        if top and not body.get("logprobs"):
            raise InvalidRequest("top_logprobs", "needs logprobs: true")
        for name in (
            "tools",
            "functions",
            "function_call",
            "logit_bias",
            "response_format",
            "audio",
            "modalities",
        ):
            if body.get(name):
                raise InvalidRequest(name, "not supported by this server")
        with fitting("messages"):
            prompts = [chat_prompt(body["messages"])]
        if episode is not None:
            prompts, body = self.episode_turn(episode, body, prompts)
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        request = generate_request(body, headers, prompts, key)
        request.top_logprobs = top or 0
        if episode is not None:
            self.check_room(episode, request)
        return self.service.generate(request, stream=bool(body.get("stream"))), body

    def chat_logprobs(self, c: rollout_pb2.Completion) -> Any:
        from openai.types.chat.chat_completion import ChoiceLogprobs
        from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob, TopLogprob

        def top(i: int) -> list[TopLogprob]:
            if not c.top_logprobs:
                return []
            a = c.top_logprobs[i]
            return [
                TopLogprob(token=t, logprob=lp, bytes=list(t.encode()))
                for t, lp in zip(self.token_texts(a.token_ids), a.logprobs, strict=True)
            ]

        return ChoiceLogprobs(
            content=[
                ChatCompletionTokenLogprob(token=t, logprob=lp, bytes=list(t.encode()), top_logprobs=top(i))
                for i, (t, lp) in enumerate(zip(self.token_texts(c.token_ids), c.logprobs, strict=True))
            ]
        )

    def chat_choice_fields(self, c: rollout_pb2.Completion, body: dict[str, Any]) -> dict[str, Any]:
        """What a chat choice and a chat stream chunk's choice share."""
        return {
            "index": c.sample_index,
            "finish_reason": c.finish_reason or "stop",
            "logprobs": self.chat_logprobs(c) if body.get("logprobs") else None,
            "token_ids": list(c.token_ids),
            "prompt_token_ids": list(c.prompt_token_ids),
        }

    def chat_completion(
        self, completions: list[rollout_pb2.Completion], version: int, body: dict[str, Any]
    ) -> Any:
        from openai.types.chat import ChatCompletion, ChatCompletionMessage
        from openai.types.chat.chat_completion import Choice

        return ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            object="chat.completion",
            created=int(time.time()),
            model=self.model_name,
            choices=[
                Choice(
                    message=ChatCompletionMessage(role="assistant", content=c.text),
                    **self.chat_choice_fields(c, body),
                )
                for c in completions
            ],
            usage=usage_of(completions, len(completions[0].prompt_token_ids) if completions else 0),
            weight_version=version,
        )

    def chat_chunks(
        self, version: int, body: dict[str, Any]
    ) -> Callable[[rollout_pb2.Completion, bool], Any]:
        """The stream's chunks, all under one id: a piece of a completion as it is generated (the first
        of a choice with the assistant's role), then, once it finished, one with its finish reason and
        prompt ids but nothing new."""
        from openai.types.chat import ChatCompletionChunk
        from openai.types.chat.chat_completion_chunk import Choice, ChoiceDelta, ChoiceLogprobs

        chunk_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        started: set[int] = set()

        def chunk(c: rollout_pb2.Completion, done: bool) -> Any:
            first = c.sample_index not in started
            started.add(c.sample_index)
            if done:
                fields = self.chat_choice_fields(c, body) | {"logprobs": None, "token_ids": []}
                delta = ChoiceDelta(role="assistant") if first else ChoiceDelta()
            else:
                fields = {
                    "index": c.sample_index,
                    "logprobs": ChoiceLogprobs(content=self.chat_logprobs(c).content)
                    if body.get("logprobs")
                    else None,
                    "token_ids": list(c.token_ids),
                }
                delta = ChoiceDelta(role="assistant" if first else None, content=c.text)
            return ChatCompletionChunk(
                id=chunk_id,
                object="chat.completion.chunk",
                created=created,
                model=self.model_name,
                choices=[Choice(delta=delta, **fields)],
                weight_version=version,
            )

        return chunk

    def completion_chunks(
        self, version: int, body: dict[str, Any]
    ) -> Callable[[rollout_pb2.Completion, bool], Any]:
        """The stream's chunks: a piece of a completion as it is generated, then, once it finished, one
        with its finish reason and prompt ids but nothing new."""

        def chunk(c: rollout_pb2.Completion, done: bool) -> Any:
            answer = self.completion_of([c], version, body, usage=None)
            choice = answer.choices[0]
            if done:  # (everything was sent in pieces)
                choice.text, choice.token_ids, choice.logprobs = "", [], None
            else:
                answer.choices = [streamed_choice()(**choice.model_dump() | {"finish_reason": None})]
            return answer

        return chunk


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


SCORE_ONLY = "fp8rl_score_only"  # (in the admitted body: echo with max_tokens 0)
EPISODE = "fp8rl_episode"  # (in the admitted body of an episode's turn: the episode, extends, context)


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


_DONE = object()


async def finished(generation: Generation) -> AsyncIterator[rollout_pb2.Completion]:
    """The completions as they finish (see :func:`happening`)."""
    async for completion, done in happening(generation, lambda: ((c, True) for c in generation)):
        if done:
            yield completion


async def happening(
    generation: Generation, events: Callable[[], Iterable[tuple[rollout_pb2.Completion, bool]]] | None = None
) -> AsyncIterator[tuple[rollout_pb2.Completion, bool]]:
    """What the generation produces as it comes (``Generation.events``: pieces, then each whole
    completion). It is waited for on a thread of its own (the wait blocks), so a long generation holds
    no worker of the server; leaving early (the client went away, or the request was cancelled) cancels
    what is left, as gRPC does."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    produce = events or generation.events

    def put(item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def pump() -> None:
        try:
            for event in produce():
                put(event)
            put(_DONE)
        except BaseException as exc:
            put(exc)

    threading.Thread(target=pump, name="openai-generation", daemon=True).start()
    try:
        while (item := await queue.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        generation.cancel()  # a no-op once all finished


async def cancel_on_disconnect(request: Request, generation: Generation) -> None:
    """Runs beside a generation until cancelled; cancels the generation once the client has gone away
    (a stream would otherwise only notice at its next write, which may be the end)."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
    generation.cancel()


@contextlib.asynccontextmanager
async def watched(request: Request, generation: Generation) -> AsyncIterator[None]:
    watcher = asyncio.ensure_future(cancel_on_disconnect(request, generation))
    try:
        yield
    finally:
        watcher.cancel()


async def collect(generation: Generation, request: Request) -> list[rollout_pb2.Completion] | None:
    """Every completion, or None once the client has gone away (what is left is then cancelled)."""
    async with watched(request, generation):
        try:
            return [c async for c in finished(generation)]
        except Cancelled:
            return None


async def stream(
    request: Request, generation: Generation, chunk: Any, include_usage: bool
) -> AsyncIterator[str]:
    async with watched(request, generation):
        async for event in sse(happening(generation), chunk, include_usage):
            yield event


async def sse(
    events: AsyncIterator[tuple[rollout_pb2.Completion, bool]], chunk: Any, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per piece of a completion as it is generated and one as each
    finishes, with ``include_usage`` a last one with the usage and no choices (OpenAI's
    ``stream_options``), then [DONE]. A client that goes away cancels this generator, and with it the
    generation."""
    try:
        seen, last = [], None
        async for c, done in events:
            if done:
                seen.append(c)
            last = chunk(c, done)
            yield f"data: {last.model_dump_json(exclude_none=True, serialize_as_any=True)}\n\n"
        if include_usage and last is not None:
            prompt_tokens = sum(len(c.prompt_token_ids) for c in seen if c.sample_index == 0)
            usage = last.model_copy(update={"choices": [], "usage": usage_of(seen, prompt_tokens)})
            yield f"data: {usage.model_dump_json(exclude_none=True)}\n\n"
        yield "data: [DONE]\n\n"
    except Exception as exc:  # after the headers went out, an error can only travel as an event
        yield f"data: {bytes(error_response(exc).body).decode()}\n\n"


async def bounded_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (400, before it is parsed) once it passes ``limit`` bytes, as a
    Generate request over gRPC is: a declared length past it is refused unread."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise InvalidRequest("body", f"{declared} bytes exceed the limit of {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise InvalidRequest("body", f"more than {limit} bytes exceed the limit of {limit}")
    return bytes(body)


def recording(chunk: Any, record: Callable[[rollout_pb2.Completion], None]) -> Any:
    """``chunk``, recording each whole completion as it finishes (an episode's streamed turn)."""

    def recorded(c: rollout_pb2.Completion, done: bool) -> Any:
        if done:
            record(c)
        return chunk(c, done)

    return recorded


async def finishing(events: AsyncIterator[str], finish: Callable[[], None]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    finally:
        finish()


ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"], "description": "the refused field, if one"},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
ERROR_STATUSES = {
    "400": "a refused request (error.param names the field)",
    "401": "no accepted bearer token (when the replica requires one)",
    "404": "a model this replica does not serve, or an episode it does not hold",
    "409": "the replica holds another weight version than the one required (or the episode a turn in flight)",
    "429": "past a limit of the replica's (samples per request, queued samples, episodes held)",
    "503": "the replica is not ready, draining or overloaded",
}
SCHEMA_REF = "#/components/schemas/{model}"


def openapi_components(model_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the routes read and answer, for the OpenAPI document (the handlers read raw bodies, so
    FastAPI cannot infer it): OpenAI's request types narrowed to this replica (its one model; our
    ``weight_version`` and ``top_k``) and OpenAI's response models. The routes' ``openapi_extra`` by
    path, and the component schemas they refer to."""
    from openai.types import Completion, completion_create_params
    from openai.types.chat import ChatCompletion
    from openai.types.chat import completion_create_params as chat_create_params

    requests: dict[str, Any] = {
        "CompletionRequest": completion_create_params.CompletionCreateParamsBase,
        "ChatCompletionRequest": chat_create_params.CompletionCreateParamsBase,
    }
    answers: dict[str, Any] = {"Completion": Completion, "ChatCompletion": ChatCompletion}
    keyed: list[tuple[str, JsonSchemaMode, TypeAdapter[Any]]] = [
        *((n, "validation", TypeAdapter(t)) for n, t in requests.items()),
        *((n, "serialization", TypeAdapter(t)) for n, t in answers.items()),
    ]
    schemas, top = TypeAdapter.json_schemas(keyed, ref_template=SCHEMA_REF)
    components = dict(top.get("$defs", {})) | {"Error": ERROR_SCHEMA}
    extras = {
        "model": {"type": "string", "enum": [model_name], "description": "the model this replica serves"},
        "weight_version": {
            "type": ["integer", "null"],
            "description": "the version required (409 if not held)",
        },
        "top_k": {
            "type": ["integer", "null"],
            "description": "sample among the k most likely tokens (0: all)",
        },
    }
    for name in requests:  # (both are OpenAI's CompletionCreateParamsBase: named ours)
        request = components.pop(schemas[(name, "validation")]["$ref"].rsplit("/", 1)[1])
        components[name] = request | {"properties": request["properties"] | extras}
    routes = {
        "/v1/completions": operation("CompletionRequest", schemas[("Completion", "serialization")]),
        "/v1/chat/completions": operation(
            "ChatCompletionRequest", schemas[("ChatCompletion", "serialization")]
        ),
    }
    return routes, components


def operation(request: str, answer: dict[str, Any]) -> dict[str, Any]:
    """A generating route's OpenAPI operation: its body (the component ``request``), the version header,
    the answer (JSON ``answer``, or an SSE stream) and the errors."""
    version = {"type": "integer", "description": "the weight version required (409 if not held)"}
    ok = {
        "description": "the completions (an SSE stream of chunks with stream: true)",
        "headers": {VERSION_HEADER: {"schema": {"type": "string", "pattern": "^-?[0-9]+$"}}},
        "content": {"application/json": {"schema": answer}, "text/event-stream": {}},
    }
    error = {"application/json": {"schema": {"$ref": SCHEMA_REF.format(model="Error")}}}
    return {
        "parameters": [{"name": VERSION_HEADER, "in": "header", "required": False, "schema": version}],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": SCHEMA_REF.format(model=request)}}},
        },
        "responses": {
            "200": ok,
            **{code: {"description": why, "content": error} for code, why in ERROR_STATUSES.items()},
        },
    }


def build_app(service: RolloutService, model_name: str, security: SecurityConfig | None = None) -> FastAPI:
    face = OpenAIFace(service, model_name)
    app = FastAPI(title="fp8rl rollout (OpenAI-compatible)", docs_url=None, redoc_url=None)
    declared, components = openapi_components(model_name)
    security = security or SecurityConfig()
    accepted = read_tokens(security.tokens_file) if security.tokens_file else {}

    if accepted and not security.open_reads:  # the same bearer tokens as gRPC; any role may generate

        @app.middleware("http")
        async def authenticate(request: Request, call_next: Any) -> Response:
            if bearer_role(request.headers.get("authorization", ""), accepted) is None:
                body = {
                    "error": {
                        "message": "send Authorization: Bearer <token>",
                        "type": "authentication_error",
                        "param": None,
                        "code": None,
                    }
                }
                return JSONResponse(body, status_code=401)
            return cast(Response, await call_next(request))

    async def answer(
        request: Request, admit: Any, build: Any, chunks: Any, episode_id: str | None = None
    ) -> Response:
        body = json_body(await bounded_body(request, service.limits.max_request_bytes))
        episode = face.episodes.begin(episode_id) if episode_id is not None else None
        try:
            # Validation, tokenization and admission run on a worker thread: tokenizing can take a while.
            generation, body = await run_in_threadpool(admit, body, request.headers, episode)
        except BaseException:
            if episode is not None:
                face.episodes.finish(episode)
            raise
        version = generation.ticket.version
        headers = {VERSION_HEADER: str(version)}
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            chunk = chunks(version, body)
            if episode is not None:
                chunk = recording(chunk, lambda c: face.record(body, c))
            events = stream(request, generation, chunk, include_usage)
            if episode is not None:
                events = finishing(events, lambda: face.episodes.finish(episode))
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:
            completions = await collect(generation, request)
            if completions is not None and episode is not None:
                face.record(body, completions[0])
        finally:
            if episode is not None:
                face.episodes.finish(episode)
        if completions is None:
            return Response(status_code=499)  # nobody is listening
        result = build(ordered(completions), version, body)
        return JSONResponse(
            result.model_dump(mode="json", exclude_none=True, serialize_as_any=True), headers=headers
        )

    @app.post("/v1/completions", openapi_extra=declared["/v1/completions"])
    async def completions(request: Request) -> Response:
        return await answer(request, face.completions, face.completion, face.completion_chunks)

    @app.post("/v1/chat/completions", openapi_extra=declared["/v1/chat/completions"])
    async def chat_completions(request: Request) -> Response:
        return await answer(request, face.chat, face.chat_completion, face.chat_chunks)

    @app.post("/episodes/{episode_id}/v1/completions", openapi_extra=declared["/v1/completions"])
    async def episode_completions(request: Request, episode_id: str) -> Response:
        return await answer(request, face.completions, face.completion, face.completion_chunks, episode_id)

    @app.post("/episodes/{episode_id}/v1/chat/completions", openapi_extra=declared["/v1/chat/completions"])
    async def episode_chat_completions(request: Request, episode_id: str) -> Response:
        return await answer(request, face.chat, face.chat_completion, face.chat_chunks, episode_id)

    @app.get("/episodes/{episode_id}")
    async def episode(episode_id: str) -> Any:
        """The episode's turns as recorded and its training samples."""
        return face.episodes.get(episode_id).as_json()

    @app.delete("/episodes/{episode_id}")
    async def end_episode(episode_id: str) -> Any:
        """Ends the episode, answering what :func:`episode` answers."""
        return face.episodes.end(episode_id).as_json()

    @app.get("/episodes/{episode_id}/v1/models")
    @app.get("/v1/models")
    async def models() -> Any:
        from openai.types import Model

        listed = Model(id=model_name, object="model", created=int(service.started), owned_by="fp8rl")
        return {"object": "list", "data": [listed.model_dump(mode="json")]}

    def on_error(_: Request, exc: Exception) -> JSONResponse:
        response = error_response(exc)
        if response.status_code == 409:  # another weight version: retrying the same request cannot help
            response.headers["x-should-retry"] = "false"
        if isinstance(exc, Overloaded):  # busy (ask again shortly: the openai client honours it) or capped
            if exc.transient:
                response.headers["retry-after"] = "1"
            else:
                response.headers["x-should-retry"] = "false"
        return response

    for kind, _ in STATUS_OF:  # domain errors; anything else is a 500 that uvicorn logs
        app.add_exception_handler(cast(type[Exception], kind), on_error)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = FastAPI.openapi(app)  # (kept as app.openapi_schema), plus the schemas routes refer to
        document.setdefault("components", {}).setdefault("schemas", {}).update(components)
        return document

    app.openapi = openapi  # type: ignore[method-assign]
    return app


class HttpServer:
    """uvicorn on its own thread. It binds at once (port 0 picks a free one), so a taken port fails
    before the engine loads; ``serve`` starts answering once the app exists."""

    def __init__(self, host: str, port: int) -> None:
        self.socket = socket.create_server((host, port))
        self.port: int = self.socket.getsockname()[1]
        self.server: Any = None
        self.thread: threading.Thread | None = None

    def serve(self, app: FastAPI, security: SecurityConfig | None = None) -> HttpServer:
        """Serve ``app``; over HTTPS with the replica's own certificate when it has one."""
        import uvicorn

        tls = security if security is not None and security.tls_cert is not None else None
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level="warning",
                lifespan="off",
                ssl_certfile=str(tls.tls_cert) if tls else None,
                ssl_keyfile=str(tls.tls_key) if tls else None,
            )
        )
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="openai-http", daemon=True
        )
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.server is not None and self.thread is not None:
            self.server.should_exit = True
            self.thread.join(timeout=10)
        self.socket.close()
