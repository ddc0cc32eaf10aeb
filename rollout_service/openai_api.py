"""OpenAI-compatible HTTP face of a replica, for agent and environment frameworks: ``POST /v1/completions``,
``POST /v1/chat/completions`` (plain, or SSE with ``stream``), ``GET /v1/models``.

The same engine, validation and version rules as gRPC: each request becomes a ``GenerateRequest`` for
:meth:`RolloutService.generate`. Requests are validated with the ``openai`` package's own parameter types
and answers are built from its response models, plus what RL needs: each choice's sampled ``token_ids``
and ``prompt_token_ids``, and the ``weight_version`` that produced them (also the ``X-Weight-Version``
header). A version is required with the ``X-Weight-Version`` header or a ``weight_version`` body field;
``top_k`` is accepted in the body too. Logprobs are those of the sampled tokens (the distribution they
were sampled from, as over gRPC); alternatives (``top_logprobs``) are not served. A stream sends each
completion whole as soon as it finishes (the engine returns finished completions), then ``[DONE]``.
"""

from __future__ import annotations

import re
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any, cast

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import TypeAdapter, ValidationError

from fp8rl.errors import InvalidRequest
from fp8rl.serving import STATUS_OF, status_of
from fp8rl.v1 import common_pb2, rollout_pb2
from rollout_service.service import Generation, RolloutService

VERSION_HEADER = "X-Weight-Version"

# gRPC status of a domain error (fp8rl.serving's one table) -> HTTP status and OpenAI error type.
HTTP_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}


class UnknownModel(InvalidRequest):
    """A request for a model this replica does not serve."""


def error_response(exc: Exception) -> JSONResponse:
    code = grpc.StatusCode.NOT_FOUND if isinstance(exc, UnknownModel) else status_of(exc)
    status, kind = HTTP_OF.get(code, (500, "server_error"))
    param = openai_param(exc.field) if isinstance(exc, InvalidRequest) else None
    body = {"error": {"message": str(exc), "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


def openai_param(field: str) -> str:
    """Our field name -> the OpenAI request's (``sampling.max_tokens`` -> ``max_tokens``)."""
    field = field.removeprefix("sampling.")
    if re.match(r"prompts\[\d+\]\.messages", field):
        return "messages"
    return "prompt" if field.startswith("prompts") else field


def _adapters() -> tuple[TypeAdapter[Any], TypeAdapter[Any]]:
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    return (
        TypeAdapter(completion_create_params.CompletionCreateParamsBase),
        TypeAdapter(chat_create_params.CompletionCreateParamsBase),
    )


def validated(adapter: TypeAdapter[Any], body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    try:
        adapter.validate_python(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidRequest(".".join(str(p) for p in first["loc"]) or "body", first["msg"]) from None
    return body


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
        if body.get(theirs) is not None:
            setattr(sampling, ours, body[theirs])
    if body.get("top_k") is not None and not isinstance(body["top_k"], int):
        raise InvalidRequest("top_k", f"must be an integer, got {body['top_k']!r}")
    return sampling


def required_version(body: dict[str, Any], headers: Any) -> int | None:
    header, field = headers.get(VERSION_HEADER), body.get("weight_version")
    try:
        from_header = None if header is None else int(header)
    except ValueError:
        raise InvalidRequest(VERSION_HEADER, f"must be an integer, got {header!r}") from None
    if field is not None and not isinstance(field, int):
        raise InvalidRequest("weight_version", f"must be an integer, got {field!r}")
    if None not in (from_header, field) and from_header != field:
        raise InvalidRequest("weight_version", f"body says {field}, header {VERSION_HEADER} says {header}")
    return field if field is not None else from_header


def generate_request(
    body: dict[str, Any], headers: Any, prompts: list[rollout_pb2.Prompt], max_tokens_key: str
) -> rollout_pb2.GenerateRequest:
    request = rollout_pb2.GenerateRequest(prompts=prompts, sampling=sampling_of(body, max_tokens_key))
    if body.get("n") is not None:
        request.n = body["n"]
    version = required_version(body, headers)
    if version is not None:
        request.weight_version = version
    return request


def completion_prompts(prompt: Any) -> list[rollout_pb2.Prompt]:
    """OpenAI's ``prompt``: a string, a list of strings, a list of token ids, or a list of those lists."""
    one_token_list = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    if isinstance(prompt, str) or one_token_list:
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest("prompt", "must be text, token ids, or a non-empty list of either")
    return [
        rollout_pb2.Prompt(text=p) if isinstance(p, str) else rollout_pb2.Prompt(token_ids={"ids": p})
        for p in prompt
    ]


def chat_prompt(messages: Iterable[Any]) -> rollout_pb2.Prompt:
    turns = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list | tuple):  # content parts: only text can be rendered
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        turns.append(rollout_pb2.ChatMessage(role=message["role"], content=content or ""))
    return rollout_pb2.Prompt(messages=rollout_pb2.ChatMessages(messages=turns))


def ordered(generation: Generation) -> list[rollout_pb2.Completion]:
    return sorted(generation, key=lambda c: (int(c.prompt_id), c.sample_index))


class OpenAIFace:
    """Turns OpenAI requests into Generate calls and completions into OpenAI answers."""

    def __init__(self, service: RolloutService, model_name: str) -> None:
        self.service, self.model_name = service, model_name
        self.completion_params, self.chat_params = _adapters()

    def token_texts(self, ids: Iterable[int]) -> list[str]:
        return [self.service.engine.tokenizer.decode([t]) for t in ids]

    def check_model(self, body: dict[str, Any]) -> None:
        if body.get("model") != self.model_name:
            raise UnknownModel("model", f"this replica serves {self.model_name!r}, not {body.get('model')!r}")

    # -- /v1/completions ----------------------------------------------------------------------------
    def completions(self, body: Any, headers: Any) -> tuple[Generation, dict[str, Any]]:
        body = validated(self.completion_params, body)
        self.check_model(body)
        refuse_unsupported(
            body,
            {"echo": False, "best_of": 1, "suffix": "", "presence_penalty": 0, "frequency_penalty": 0},
        )
        if body.get("logit_bias"):
            raise InvalidRequest("logit_bias", "not supported by this server")
        if body.get("logprobs") not in (None, 0):
            raise InvalidRequest("logprobs", "use 0: the sampled token's logprob is served, not alternatives")
        request = generate_request(body, headers, completion_prompts(body["prompt"]), "max_tokens")
        return self.service.generate(request), body

    def completion_choice(self, c: rollout_pb2.Completion, n: int, logprobs: bool) -> Any:
        from openai.types import CompletionChoice
        from openai.types.completion_choice import Logprobs

        choice = CompletionChoice(
            index=int(c.prompt_id) * n + c.sample_index,
            text=c.text,
            finish_reason=c.finish_reason or "stop",
            token_ids=list(c.token_ids),
            prompt_token_ids=list(c.prompt_token_ids),
        )
        if logprobs:
            tokens = self.token_texts(c.token_ids)
            offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
            choice.logprobs = Logprobs(tokens=tokens, token_logprobs=list(c.logprobs), text_offset=offsets)
        return choice

    def completion(self, generation: Generation, body: dict[str, Any]) -> Any:
        from openai.types import CompletionUsage

        completions = ordered(generation)
        prompt_tokens = sum(len(c.prompt_token_ids) for c in completions if c.sample_index == 0)
        generated = sum(len(c.token_ids) for c in completions)
        usage = CompletionUsage(
            prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated
        )
        return self.completion_of(completions, generation.ticket.version, body, usage)

    def completion_of(
        self, completions: list[rollout_pb2.Completion], version: int, body: dict[str, Any], usage: Any
    ) -> Any:
        from openai.types import Completion

        n, logprobs = body.get("n") or 1, body.get("logprobs") is not None
        return Completion(
            id=f"cmpl-{uuid.uuid4().hex}",
            object="text_completion",
            created=int(time.time()),
            model=self.model_name,
            choices=[self.completion_choice(c, n, logprobs) for c in completions],
            usage=usage,
            weight_version=version,
        )

    # -- /v1/chat/completions -----------------------------------------------------------------------
    def chat(self, body: Any, headers: Any) -> tuple[Generation, dict[str, Any]]:
        body = validated(self.chat_params, body)
        self.check_model(body)
        refuse_unsupported(body, {"presence_penalty": 0, "frequency_penalty": 0, "top_logprobs": 0})
        for name in ("tools", "logit_bias", "response_format", "audio", "modalities"):
            if body.get(name):
                raise InvalidRequest(name, "not supported by this server")
        prompt = chat_prompt(body["messages"])
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        return self.service.generate(generate_request(body, headers, [prompt], key)), body

    def chat_logprobs(self, c: rollout_pb2.Completion) -> Any:
        from openai.types.chat.chat_completion import ChoiceLogprobs
        from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob

        return ChoiceLogprobs(
            content=[
                ChatCompletionTokenLogprob(token=t, logprob=lp, bytes=list(t.encode()), top_logprobs=[])
                for t, lp in zip(self.token_texts(c.token_ids), c.logprobs, strict=True)
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

    def chat_completion(self, generation: Generation, body: dict[str, Any]) -> Any:
        from openai.types import CompletionUsage
        from openai.types.chat import ChatCompletion, ChatCompletionMessage
        from openai.types.chat.chat_completion import Choice

        completions = ordered(generation)
        prompt_tokens = len(completions[0].prompt_token_ids) if completions else 0
        generated = sum(len(c.token_ids) for c in completions)
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
            usage=CompletionUsage(
                prompt_tokens=prompt_tokens,
                completion_tokens=generated,
                total_tokens=prompt_tokens + generated,
            ),
            weight_version=generation.ticket.version,
        )

    def chat_chunks(self, generation: Generation, body: dict[str, Any]) -> Iterator[Any]:
        from openai.types.chat import ChatCompletionChunk
        from openai.types.chat.chat_completion_chunk import Choice, ChoiceDelta

        chunk_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        for c in generation:
            choice = Choice(
                delta=ChoiceDelta(role="assistant", content=c.text), **self.chat_choice_fields(c, body)
            )
            yield ChatCompletionChunk(
                id=chunk_id,
                object="chat.completion.chunk",
                created=created,
                model=self.model_name,
                choices=[choice],
                weight_version=generation.ticket.version,
            )

    def completion_chunks(self, generation: Generation, body: dict[str, Any]) -> Iterator[Any]:
        for c in generation:
            yield self.completion_of([c], generation.ticket.version, body, usage=None)


def sse(chunks: Iterator[Any], generation: Generation) -> Iterator[str]:
    try:
        for chunk in chunks:
            yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
        yield "data: [DONE]\n\n"
    except Exception as exc:  # after the headers went out, an error can only travel as an event
        yield f"data: {bytes(error_response(exc).body).decode()}\n\n"
    finally:
        generation.cancel()  # the client went away (or all finished: then a no-op)


def build_app(service: RolloutService, model_name: str) -> FastAPI:
    face = OpenAIFace(service, model_name)
    app = FastAPI(title="fp8rl rollout (OpenAI-compatible)", docs_url=None, redoc_url=None)

    def answer(generation: Generation, body: dict[str, Any], plain: Any, chunks: Any) -> Any:
        headers = {VERSION_HEADER: str(generation.ticket.version)}
        if body.get("stream"):
            stream = sse(chunks(generation, body), generation)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        try:
            result = plain(generation, body)
        finally:
            generation.cancel()
        return JSONResponse(result.model_dump(mode="json", exclude_none=True), headers=headers)

    # Plain `def` endpoints: FastAPI runs them on its thread pool, as generation blocks.
    @app.post("/v1/completions")
    def completions(body: dict[str, Any], request: Request) -> Any:
        generation, body = face.completions(body, request.headers)
        return answer(generation, body, face.completion, face.completion_chunks)

    @app.post("/v1/chat/completions")
    def chat_completions(body: dict[str, Any], request: Request) -> Any:
        generation, body = face.chat(body, request.headers)
        return answer(generation, body, face.chat_completion, face.chat_chunks)

    @app.get("/v1/models")
    def models() -> Any:
        from openai.types import Model

        started = int(service.started)
        listed = Model(id=model_name, object="model", created=started, owned_by="fp8rl")
        return {"object": "list", "data": [listed.model_dump(mode="json")]}

    def on_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    for kind, _ in STATUS_OF:  # domain errors; anything else is a 500 that uvicorn logs
        app.add_exception_handler(cast(type[Exception], kind), on_error)

    @app.exception_handler(RequestValidationError)  # FastAPI's own check: the body is no JSON object
    def on_bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(InvalidRequest("body", "must be a JSON object"))

    return app


class HttpServer:
    """uvicorn on its own thread, bound before it starts (port 0 picks a free one)."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        import uvicorn

        self.socket = socket.create_server((host, port))
        self.port: int = self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="openai-http", daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()
