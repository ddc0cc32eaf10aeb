"""The face's OpenAPI document: what its generating routes read and answer, declared from OpenAI's types
(the handlers read raw bodies, so FastAPI cannot infer it)."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter
from pydantic.json_schema import JsonSchemaMode

from rollout_service.openai_face.requests import VERSION_HEADER

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
