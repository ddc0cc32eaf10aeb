"""Property-based fuzzing of the OpenAI HTTP face from its own OpenAPI document (schemathesis): requests
generated from the declared schemas, ones that fit them and ones that break them, sent to the real app
over a real RolloutService and its engine loop, with the echo engine of tests/fuzz/targets.py (no vLLM).
No answer is a 5xx, every answer conforms to what the document declares (status, content type, headers,
body), a request that breaks the schema is refused, and a refusal is a 4xx naming its field."""

from __future__ import annotations

import collections
import functools
import os
from typing import Any

import pytest

from rollout_service.openai_face import VERSION_HEADER
from tests.fuzz.targets import openai_client

OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")]
EXAMPLES_ENV = "FP8RL_SCHEMA_EXAMPLES"
# Per route and kind: the five runs take about half a minute on this kind of machine (a slow test).
DEFAULT_EXAMPLES = 100
NAMELESS = {401, 409, 429, 499}  # no token; the replica's version or capacity (no field is wrong); gone


@functools.cache
def api() -> Any:
    import schemathesis

    return schemathesis.openapi.from_asgi("/openapi.json", openai_client().app)


def names_a_field(param: str | None, case: Any) -> bool:
    """``param`` (an error's) is the body, the version header, or a field of the body or of the request's
    declared schema (``messages.0.role`` names ``messages``)."""
    if param is None:
        return False
    declared = case.operation.definition.raw["requestBody"] if case.operation.method.upper() == "POST" else {}
    ref = declared.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref", "")
    fields = set(case.body) if isinstance(case.body, dict) else set()
    if ref:
        fields |= set(api().raw_schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"])
    return param in ("body", VERSION_HEADER) or param.split(".")[0].split("[")[0] in fields


def test_the_document_declares_what_the_routes_read_and_answer() -> None:
    document = openai_client().get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    for path, request in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ):
        post = document["paths"][path]["post"]
        body = post["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{request}"}
        assert schemas[request]["properties"]["model"]["enum"] == ["tiny"]  # the one model served
        assert {"weight_version", "top_k"} <= set(schemas[request]["properties"])
        assert {"200", "400", "404", "409", "429", "503"} <= set(post["responses"])
        assert post["parameters"][0]["name"] == VERSION_HEADER
    assert all(r.startswith("#/components/schemas/") for r in refs(document))
    assert {r.rsplit("/", 1)[1] for r in refs(document)} <= set(schemas)  # every reference resolves


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [node["$ref"]] if "$ref" in node else [r for v in node.values() for r in refs(v)]
    return [r for v in node for r in refs(v)] if isinstance(node, list) else []


# Each route with requests that fit its schema, and those that take input with requests that break it.
RUNS = [(m, p, "positive") for m, p in OPERATIONS] + [
    (m, p, "negative") for m, p in OPERATIONS if m == "POST"
]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "path", "mode"), RUNS, ids=[f"{p}-{mode}" for _, p, mode in RUNS])
def test_every_answer_conforms_to_the_openapi_document(method: str, path: str, mode: str) -> None:
    pytest.importorskip("schemathesis", reason="schemathesis (the dev extra) fuzzes the HTTP API")
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi import checks

    negative = mode == "negative"
    conformance = [
        not_a_server_error,
        checks.status_code_conformance,
        checks.content_type_conformance,
        checks.response_headers_conformance,
        checks.response_schema_conformance,
        *([checks.negative_data_rejection] if negative else []),
    ]
    statuses: collections.Counter[int] = collections.Counter()
    refused: collections.Counter[str] = collections.Counter()  # the fields 4xx answers named
    operation = api()[path][method]

    @settings(
        max_examples=int(os.environ.get(EXAMPLES_ENV, DEFAULT_EXAMPLES)),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
    def one(case: Any) -> None:
        response = case.call_and_validate(checks=conformance)
        statuses[response.status_code] += 1
        if 400 <= response.status_code < 500 and response.status_code not in NAMELESS:
            error = response.json()["error"]
            refused[error["param"]] += 1
            assert names_a_field(error["param"], case), (response.status_code, error, case.body)

    one()
    top = ", ".join(f"{name} {count}" for name, count in refused.most_common(6))
    print(f"schemathesis {method} {path} ({mode}): {statuses.total()} examples, statuses {dict(statuses)}")
    print(f"  refused fields (most named): {top or '-'}")
