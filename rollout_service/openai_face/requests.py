"""OpenAI requests -> ``GenerateRequest`` messages, every bad field named as OpenAI names it (pure, as
:mod:`rollout_service.validation` is for gRPC); a refused request -> its HTTP answer (one table)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from typing import Any

import grpc
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError

from fp8rl.errors import InvalidRequest
from fp8rl.serving import status_of
from fp8rl.v1 import common_pb2, rollout_pb2
from rollout_service.episodes import EpisodeNotFound

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


def request_adapters() -> tuple[TypeAdapter[Any], TypeAdapter[Any]]:
    """OpenAI's request types, completions' and chat's, to validate bodies with."""
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
