"""The face's FastAPI app: its routes over :class:`~rollout_service.openai_face.face.OpenAIFace`, the
bearer-token check, domain errors as HTTP answers, the OpenAPI document; and ``HttpServer``, uvicorn on
a thread of its own."""

from __future__ import annotations

import functools
import socket
import threading
from typing import Any, cast

from fastapi import FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse

from fp8rl.errors import Overloaded
from fp8rl.security import SecurityConfig, bearer_role, read_tokens, serving_caller
from fp8rl.serving import STATUS_OF
from rollout_service.episodes import OUTSIDE_EPISODES, CallScope
from rollout_service.openai_face.face import OpenAIFace
from rollout_service.openai_face.requests import VERSION_HEADER, error_response, json_body
from rollout_service.openai_face.responses import ordered
from rollout_service.openai_face.schema import openapi_components
from rollout_service.openai_face.streaming import bounded_body, collect, finishing, recording, stream
from rollout_service.service import Generation, RolloutService


def build_app(service: RolloutService, model_name: str, security: SecurityConfig | None = None) -> FastAPI:
    """The face over ``service``, serving ``model_name``; behind the replica's bearer tokens when its
    ``security`` has some (and reads are not open)."""
    face = OpenAIFace(service, model_name)
    app = FastAPI(title="fp8rl rollout (OpenAI-compatible)", docs_url=None, redoc_url=None)
    declared, components = openapi_components(model_name)
    security = security or SecurityConfig()
    accepted = read_tokens(security.tokens_file) if security.tokens_file else {}
    if accepted:  # the same bearer tokens as gRPC; any role may generate (the run's own first)
        identify_callers(app, accepted, required=not security.open_reads)
    add_routes(app, face, declared)
    add_error_handlers(app)
    app.openapi = functools.partial(openapi, app, components)  # type: ignore[method-assign]
    return app


def identify_callers(app: FastAPI, accepted: dict[str, str], required: bool) -> None:
    """Serves each request as the role of its bearer token (the run's own calls come first:
    rollout_service.generation); refuses (401) one without an ``accepted`` token when ``required``."""

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Any) -> Response:
        role = bearer_role(request.headers.get("authorization", ""), accepted)
        if role is None and required:
            body = {
                "error": {
                    "message": "send Authorization: Bearer <token>",
                    "type": "authentication_error",
                    "param": None,
                    "code": None,
                }
            }
            return JSONResponse(body, status_code=401)
        with serving_caller(role):
            return cast(Response, await call_next(request))


def add_routes(app: FastAPI, face: OpenAIFace, declared: dict[str, Any]) -> None:
    """The generating routes (each also under an episode's URL), the episodes' and the model list."""

    @app.post("/v1/completions", openapi_extra=declared["/v1/completions"])
    async def completions(request: Request) -> Response:
        return await answer(face, request, face.completions, face.completion, face.completion_chunks)

    @app.post("/v1/chat/completions", openapi_extra=declared["/v1/chat/completions"])
    async def chat_completions(request: Request) -> Response:
        return await answer(face, request, face.chat, face.chat_completion, face.chat_chunks)

    @app.post("/episodes/{episode_id}/v1/completions", openapi_extra=declared["/v1/completions"])
    async def episode_completions(request: Request, episode_id: str) -> Response:
        return await answer(
            face, request, face.completions, face.completion, face.completion_chunks, episode_id
        )

    @app.post("/episodes/{episode_id}/v1/chat/completions", openapi_extra=declared["/v1/chat/completions"])
    async def episode_chat_completions(request: Request, episode_id: str) -> Response:
        return await answer(face, request, face.chat, face.chat_completion, face.chat_chunks, episode_id)

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

        listed = Model(
            id=face.model_name, object="model", created=int(face.service.started), owned_by="fp8rl"
        )
        return {"object": "list", "data": [listed.model_dump(mode="json")]}


async def answer(
    face: OpenAIFace, request: Request, admit: Any, build: Any, chunks: Any, episode_id: str | None = None
) -> Response:
    """A generating route: the body read within the replica's limit, admitted by ``admit`` (within the
    episode ``episode_id``, when one is named), answered as a stream of ``chunks`` or whole by ``build``."""
    body = json_body(await bounded_body(request, face.service.limits.max_request_bytes))
    scope = face.episodes.turn(episode_id) if episode_id is not None else OUTSIDE_EPISODES
    try:
        # Validation, tokenization and admission run on a worker thread: tokenizing can take a while.
        generation, body = await run_in_threadpool(admit, body, request.headers, scope)
    except BaseException:
        scope.finish()
        raise
    if body.get("stream"):
        return streamed(request, generation, body, chunks, scope)
    return await whole(request, generation, body, build, scope)


def streamed(
    request: Request, generation: Generation, body: dict[str, Any], chunks: Any, scope: CallScope
) -> StreamingResponse:
    """The generation as server-sent events; the scope records each completion once it finished (an
    episode's turn), and finishes once the stream ends."""
    version = generation.ticket.version
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    chunk = recording(chunks(version, body), scope.record)
    events = finishing(stream(request, generation, chunk, include_usage), scope.finish)
    return StreamingResponse(events, media_type="text/event-stream", headers={VERSION_HEADER: str(version)})


async def whole(
    request: Request, generation: Generation, body: dict[str, Any], build: Any, scope: CallScope
) -> Response:
    """Every completion in one answer (499 if the client went away first); the scope records the first
    (an episode's turn has one) and finishes."""
    version = generation.ticket.version
    try:
        completions = await collect(generation, request)
        if completions:  # (None: the client went away)
            scope.record(completions[0])
    finally:
        scope.finish()
    if completions is None:
        return Response(status_code=499)  # nobody is listening
    result = build(ordered(completions), version, body)
    return JSONResponse(
        result.model_dump(mode="json", exclude_none=True, serialize_as_any=True),
        headers={VERSION_HEADER: str(version)},
    )


def add_error_handlers(app: FastAPI) -> None:
    """Every domain error of ``fp8rl.serving``'s table answered by :func:`on_error`."""
    for kind, _ in STATUS_OF:  # domain errors; anything else is a 500 that uvicorn logs
        app.add_exception_handler(cast(type[Exception], kind), on_error)


def on_error(_: Request, exc: Exception) -> JSONResponse:
    """A domain error's HTTP answer, with the retry hints the ``openai`` client honours."""
    response = error_response(exc)
    if response.status_code == 409:  # another weight version: retrying the same request cannot help
        response.headers["x-should-retry"] = "false"
    if isinstance(exc, Overloaded):  # busy (ask again shortly: the openai client honours it) or capped
        if exc.transient:
            response.headers["retry-after"] = "1"
        else:
            response.headers["x-should-retry"] = "false"
    return response


def openapi(app: FastAPI, components: dict[str, Any]) -> dict[str, Any]:
    """The app's OpenAPI document, plus the ``components`` schemas its routes refer to."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    document = FastAPI.openapi(app)  # (kept as app.openapi_schema), plus the schemas routes refer to
    document.setdefault("components", {}).setdefault("schemas", {}).update(components)
    return document


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
