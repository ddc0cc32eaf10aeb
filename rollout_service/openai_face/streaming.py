"""A generation as it happens, for the routes: waited for off the event loop, cancelled when the client
goes away, sent as server-sent events; the request body read within its limit."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fastapi import Request

from fp8rl.errors import Cancelled, InvalidRequest
from fp8rl.v1 import rollout_pb2
from rollout_service.openai_face.requests import error_response
from rollout_service.openai_face.responses import usage_of
from rollout_service.service import Generation

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
    """``chunk``, recording each whole completion as it finishes (a call scope's record)."""

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
