"""Coverage-guided fuzzing of the OpenAI HTTP face (tests/fuzz): raw bodies and a version header POSTed to
the real app over a real RolloutService and its engine loop, in process, with an engine that echoes the
prompt (no vLLM). Any status but a 5xx is an answer; an exception the app does not map is a crash."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fuzz import suite


def test_every_committed_input_replays_without_a_crash() -> None:
    print(f"openai: {suite.replay('openai')} committed inputs replayed")


@pytest.mark.slow
def test_fuzzing_finds_no_crash(tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris (coverage-guided fuzzing) has wheels for x86-64 Linux")
    suite.check(suite.fuzz("openai", suite.fuzz_seconds(), tmp_path))


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "tiny", "prompt": "\x8d"}',  # not UTF-8 (found by the fuzzer: it was a 500)
        b'{"model": "tiny", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",  # past int's digit limit
        b"[" * 100_000 + b"]" * 100_000,  # deeper than the parser recurses
        b'{"model": "tiny", "prompt": "a"',  # cut short
    ],
    ids=["not-utf8", "long-integer", "deep", "truncated"],
)
def test_a_body_that_is_not_json_is_a_400_naming_the_body(body: bytes) -> None:
    from tests.fuzz.targets import openai_client

    response = openai_client().post("/v1/completions", content=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "body" and error["message"].startswith("body: is not JSON"), error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # Found by the fuzzer: a token id the wire's int32 cannot hold was a 500 (protobuf's ValueError).
        ("/v1/completions", {"prompt": [[5, 21474836487], [8, 9]]}, "prompt"),
        # JSON spells lone UTF-16 surrogates, which no UTF-8 string (so no protobuf one) holds.
        ("/v1/completions", {"prompt": "3+\ud8004="}, "prompt"),
        ("/v1/completions", {"prompt": "3+4=", "stop": ["\udc00"]}, "body"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ],
    ids=[
        "token-id-beyond-int32",
        "surrogate-prompt",
        "surrogate-stop",
        "surrogate-content",
    ],
)
def test_a_value_the_wire_cannot_hold_is_a_400_naming_its_field(
    path: str, body: dict[str, object], param: str
) -> None:
    import json

    from tests.fuzz.targets import openai_client

    response = openai_client().post(path, content=json.dumps({"model": "tiny", **body}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "does not fit the request" in error["message"], error


def test_a_request_past_the_replicas_sample_limit_is_a_429() -> None:
    # Found by schemathesis: prompts x n past max_samples_per_request (RESOURCE_EXHAUSTED over gRPC)
    # was a 500, as a full queue was.
    import json

    from tests.fuzz.targets import openai_client

    body = {"model": "tiny", "prompt": ["1+2="] * 5, "n": 4}  # 20 samples, the app's limit 16
    response = openai_client().post("/v1/completions", content=json.dumps(body))
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and "max_samples_per_request" in error["message"], error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # Found by schemathesis: items of OpenAI's Iterable fields (messages, tool calls, content parts)
        # went unchecked (pydantic validates them lazily): a text part of 5 was rendered as "5".
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages.0.content.0",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "assistant", "content": "a", "tool_calls": [5]},
                    {"role": "user", "content": "b"},
                ]
            },
            "messages.0.tool_calls.0",
        ),
        # (was refused as not fitting the wire; now as the message's type, which wants UTF-8 text)
        ("/v1/chat/completions", {"messages": [{"role": "\udfff", "content": "hi"}]}, "messages.0"),
        # Found by schemathesis: too many alternatives were refused as gRPC's top_logprobs, which these
        # completions call logprobs.
        ("/v1/completions", {"prompt": "1+2=", "logprobs": 300}, "logprobs"),
        # Found by schemathesis: 2**31 did not fit the wire's int32 (a ValueError, an HTTP 500).
        ("/v1/completions", {"prompt": "#", "logprobs": 2**31}, "logprobs"),
    ],
    ids=[
        "text-part-not-text",
        "tool-call-not-an-object",
        "surrogate-role",
        "logprobs-past-the-limit",
        "logprobs-past-int32",
    ],
)
def test_a_refusal_names_the_field_of_the_openai_request(
    path: str, body: dict[str, object], param: str
) -> None:
    import json

    from tests.fuzz.targets import openai_client

    response = openai_client().post(path, content=json.dumps({"model": "tiny", **body}))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()
