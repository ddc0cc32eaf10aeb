"""Rollout.Generate as a newcomer meets it, against the real replica (vLLM on CPU): a minimal request
works, unset fields take documented defaults, chat prompts go through the model's template, and the
OpenAI-compatible HTTP endpoint answers the official `openai` client with the gRPC path's samples."""

from __future__ import annotations

import math
from typing import Any

import grpc
import openai
import pytest
from transformers import AutoTokenizer

from fp8rl.tiny import decode
from fp8rl.v1 import common_pb2, rollout_pb2
from rollout_service.openai_face import VERSION_HEADER
from tests.conftest import InProcessRollout

MODEL_NAME = "tiny"


def generate(rollout: InProcessRollout, **fields: Any) -> rollout_pb2.GenerateResponse:
    return rollout.stub.Generate(rollout_pb2.GenerateRequest(**fields), timeout=120)


def invalid(rollout: InProcessRollout, **fields: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as failure:
        generate(rollout, **fields)
    return failure.value


def test_a_minimal_request_gets_one_completion_under_the_held_version(rollout_fp8: InProcessRollout) -> None:
    response = generate(rollout_fp8, prompts=[rollout_pb2.Prompt(text="12+34=")])
    [completion] = response.completions
    # n = 1; max_tokens = the server default (16); any version: the one held, reported.
    assert completion.prompt_token_ids and 1 <= len(completion.token_ids) <= 16
    assert completion.finish_reason == "stop" or len(completion.token_ids) == 16
    assert completion.weight_version == response.weight_version == rollout_fp8.service.version


def test_unset_max_tokens_is_the_server_default_capped_by_the_context(rollout_fp8: InProcessRollout) -> None:
    import dataclasses

    greedy = common_pb2.SamplingParams(temperature=0.0)
    prompt = [rollout_pb2.Prompt(text="12+34=")]
    service = rollout_fp8.service
    limits = service.limits
    for default in (16, 3):  # the configured default, and another one set on the replica
        service.limits = dataclasses.replace(limits, default_max_tokens=default)
        try:
            unset = generate(rollout_fp8, prompts=prompt, sampling=greedy).completions[0]
        finally:
            service.limits = limits
        explicit = common_pb2.SamplingParams(temperature=0.0, max_tokens=default)
        same = generate(rollout_fp8, prompts=prompt, sampling=explicit).completions[0]
        assert list(unset.token_ids) == list(same.token_ids)
        assert len(unset.token_ids) == default or unset.finish_reason == "stop"
    long = [rollout_pb2.Prompt(token_ids=rollout_pb2.TokenIds(ids=[40] * 250))]  # 6 tokens of room in 256
    [capped] = generate(rollout_fp8, prompts=long, sampling=greedy).completions
    assert len(capped.token_ids) == 6 or (capped.finish_reason == "stop" and len(capped.token_ids) < 6)


def test_explicit_bad_values_are_still_refused_naming_the_field(rollout_fp8: InProcessRollout) -> None:
    prompt = [rollout_pb2.Prompt(text="1+1=")]
    cases = {
        "n: must lie in [1, 64], got 0": dict(n=0),
        "sampling.max_tokens: must lie in [1, 256], got 0": dict(
            sampling=common_pb2.SamplingParams(max_tokens=0)
        ),
        "weight_version: must be a version >= 0 or -1 (any), got -2": dict(weight_version=-2),
        "top_logprobs: must lie in [0, 20] (max_top_logprobs), got 21": dict(top_logprobs=21),
        "return_routed_experts: the model has no mixture-of-experts layers: nothing is routed": dict(
            return_routed_experts=True
        ),
    }
    for message, fields in cases.items():
        error = invalid(rollout_fp8, prompts=prompt, **fields)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details() == message
    for temperature in (float("inf"), 2.5):  # refused here, before vLLM could fail the engine's batch
        error = invalid(
            rollout_fp8, prompts=prompt, sampling=common_pb2.SamplingParams(temperature=temperature)
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith("sampling.temperature: must be 0 (greedy) or lie in [0.01, 2.0]")
    assert generate(rollout_fp8, prompts=prompt).completions  # and the replica keeps serving
    error = invalid(rollout_fp8, prompts=[rollout_pb2.Prompt(id="p")])
    assert error.details() == "prompts[0]: set one of text, token_ids or chat, got (unset)"
    held = rollout_fp8.service.version
    error = invalid(rollout_fp8, prompts=prompt, weight_version=held + 1)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_chat_prompts_are_rendered_with_the_models_template(rollout_fp8: InProcessRollout) -> None:
    turns = [("system", "add"), ("user", "12+34=")]
    messages = rollout_pb2.ChatMessages(
        messages=[rollout_pb2.ChatMessage(role=r, content=c) for r, c in turns]
    )
    response = generate(
        rollout_fp8,
        prompts=[rollout_pb2.Prompt(chat=messages)],
        sampling=common_pb2.SamplingParams(max_tokens=3),
    )
    tokenizer = AutoTokenizer.from_pretrained(rollout_fp8.model_dir)
    expected = tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in turns], add_generation_prompt=True, tokenize=True
    )
    assert list(response.completions[0].prompt_token_ids) == list(expected["input_ids"])
    assert decode(list(expected["input_ids"])) == "system: add\nuser: 12+34=\nassistant: "
    empty = invalid(rollout_fp8, prompts=[rollout_pb2.Prompt(chat=rollout_pb2.ChatMessages())])
    assert empty.details() == "prompts[0].chat: at least one message is required"


def test_a_stop_string_is_cut_from_text_but_its_tokens_stay(rollout_fp8: InProcessRollout) -> None:
    """The contract the trainer relies on: what was sampled is in token_ids and logprobs."""
    greedy = common_pb2.SamplingParams(temperature=0.0, max_tokens=12)
    free = generate(rollout_fp8, prompts=[rollout_pb2.Prompt(text="7+8=")], sampling=greedy).completions[0]
    text = decode(list(free.token_ids))
    later = [ch for ch in text[1:] if ch.isascii() and ch.isprintable() and ch != text[0]]
    if not later:
        pytest.skip(f"the greedy completion {text!r} has no later ASCII character to stop at")
    stop = later[0]
    greedy.stop.append(stop)
    cut = generate(rollout_fp8, prompts=[rollout_pb2.Prompt(text="7+8=")], sampling=greedy).completions[0]
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert decode(list(cut.token_ids)) == cut.text + stop
    assert len(cut.logprobs) == len(cut.token_ids)
    assert list(cut.token_ids) == list(free.token_ids)[: len(cut.token_ids)]


def test_server_reflection_answers_v1_and_v1alpha(rollout_fp8: InProcessRollout) -> None:
    from grpc_reflection.v1alpha import reflection_pb2

    request = reflection_pb2.ServerReflectionRequest(list_services="")
    for version in ("v1", "v1alpha"):
        call = rollout_fp8.channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        [reply] = list(call(iter([request]), timeout=30))
        names = {s.name for s in reply.list_services_response.service}
        assert {
            "fp8rl.v1.Rollout",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= names


# -- the OpenAI-compatible endpoint, through the official client -------------------------------------


@pytest.fixture(scope="module")
def http(replica_http: str) -> str:
    return f"{replica_http}/v1"


@pytest.fixture(scope="module")
def client(http: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=http, api_key="unused", max_retries=0)


def error_body(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.body if isinstance(exc.body, dict) else {}
    return body.get("error", body)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL_NAME]


def test_completion_matches_the_grpc_path_with_logprobs_and_version(
    client: openai.OpenAI, rollout_fp8: InProcessRollout
) -> None:
    raw = client.completions.with_raw_response.create(
        model=MODEL_NAME, prompt="12+34=", max_tokens=6, temperature=1.0, seed=7, n=2, logprobs=0
    )
    answer = raw.parse()
    version = rollout_fp8.service.version
    assert raw.headers[VERSION_HEADER] == str(version) and answer.weight_version == version  # type: ignore[attr-defined]
    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=6, seed=7)
    reference = generate(rollout_fp8, prompts=[rollout_pb2.Prompt(text="12+34=")], n=2, sampling=sampling)
    assert [c.index for c in answer.choices] == [0, 1]
    for choice, expected in zip(answer.choices, reference.completions, strict=True):
        assert choice.token_ids == list(expected.token_ids)  # type: ignore[attr-defined]
        assert choice.prompt_token_ids == list(expected.prompt_token_ids)  # type: ignore[attr-defined]
        assert choice.text == expected.text and choice.logprobs is not None
        assert choice.logprobs.token_logprobs == pytest.approx(list(expected.logprobs), abs=1e-4)
        assert len(choice.logprobs.tokens or []) == len(expected.token_ids)
    assert answer.usage is not None and answer.usage.completion_tokens == sum(
        len(c.token_ids) for c in reference.completions
    )


def test_chat_completion_renders_the_template_and_reports_logprobs(
    client: openai.OpenAI, rollout_fp8: InProcessRollout
) -> None:
    answer = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "12+34="}],
        max_tokens=4,
        logprobs=True,
        seed=3,
    )
    [choice] = answer.choices
    assert decode(choice.prompt_token_ids) == "user: 12+34=\nassistant: "  # type: ignore[attr-defined]
    turn = rollout_pb2.ChatMessages(messages=[rollout_pb2.ChatMessage(role="user", content="12+34=")])
    sampling = common_pb2.SamplingParams(max_tokens=4, seed=3)
    [expected] = generate(rollout_fp8, prompts=[rollout_pb2.Prompt(chat=turn)], sampling=sampling).completions
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.token_ids == list(expected.token_ids)  # type: ignore[attr-defined]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(list(expected.logprobs), abs=1e-4)
    assert answer.weight_version == rollout_fp8.service.version  # type: ignore[attr-defined]


def test_logprobs_n_serves_the_engines_top_alternatives(
    client: openai.OpenAI, rollout_fp8: InProcessRollout
) -> None:
    """``logprobs: 3``: at every position the three most likely tokens, most likely first, the same
    over gRPC (``top_logprobs``, by id) and over HTTP (by text); the sampled token's logprob is the one
    gRPC without alternatives (and so the trainer) sees, and where it is among the three it has the
    same value there. Chat's ``top_logprobs`` serves the same."""
    answer = client.completions.create(
        model=MODEL_NAME, prompt="12+34=", max_tokens=6, temperature=1.0, seed=7, logprobs=3
    )
    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=6, seed=7)
    prompt = [rollout_pb2.Prompt(text="12+34=")]
    [plain] = generate(rollout_fp8, prompts=prompt, sampling=sampling).completions
    [expected] = generate(rollout_fp8, prompts=prompt, sampling=sampling, top_logprobs=3).completions
    assert list(expected.token_ids) == list(plain.token_ids)
    assert list(expected.logprobs) == pytest.approx(list(plain.logprobs), abs=1e-6)
    [choice] = answer.choices
    assert choice.logprobs is not None and choice.logprobs.top_logprobs is not None
    assert choice.token_ids == list(expected.token_ids)  # type: ignore[attr-defined]
    assert choice.logprobs.token_logprobs == pytest.approx(list(expected.logprobs), abs=1e-4)
    sampled_in_top = 0
    for token, logprob, top, by_id in zip(
        expected.token_ids,
        expected.logprobs,
        choice.logprobs.top_logprobs,
        expected.top_logprobs,
        strict=True,
    ):
        assert len(by_id.token_ids) == 3 and list(by_id.logprobs) == sorted(by_id.logprobs, reverse=True)
        assert by_id.logprobs[0] >= logprob - 1e-6 and sum(math.exp(v) for v in by_id.logprobs) <= 1 + 1e-5
        shown: dict[str, float] = {}
        for t, lp in zip(by_id.token_ids, by_id.logprobs, strict=True):
            shown.setdefault(rollout_fp8.service.engine.tokenizer.decode([t]), lp)
        assert top == pytest.approx(shown, abs=1e-4)
        if token in by_id.token_ids:
            sampled_in_top += 1
            assert by_id.logprobs[list(by_id.token_ids).index(token)] == pytest.approx(logprob, abs=1e-5)
    assert sampled_in_top > 0
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "1+2="}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


def test_echo_scores_a_prompt_as_generation_scored_its_tokens(
    client: openai.OpenAI, rollout_fp8: InProcessRollout
) -> None:
    """lm-evaluation-harness's loglikelihood call (``echo``, ``max_tokens: 0``, ``logprobs``): the prompt
    back, every token's logprob (the first has none), nothing generated. Scored so, a completion's own
    tokens get the logprobs generation gave them (temperature 1: the raw distribution)."""
    first = client.completions.create(model=MODEL_NAME, prompt="12+34=", max_tokens=5, seed=3, logprobs=0)
    generated = first.choices[0]
    ids = [*generated.prompt_token_ids, *generated.token_ids]  # type: ignore[attr-defined]
    scored = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    [choice] = scored.choices
    assert choice.text == rollout_fp8.service.engine.tokenizer.decode(ids)
    assert choice.token_ids == []  # type: ignore[attr-defined]
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    logprobs = choice.logprobs.token_logprobs
    assert logprobs[0] is None and len(logprobs) == len(choice.prompt_token_ids)  # type: ignore[attr-defined]
    tail = logprobs[-len(generated.token_ids) :]  # type: ignore[attr-defined]
    assert tail == pytest.approx(generated.logprobs.token_logprobs, abs=1e-3)  # type: ignore[union-attr]
    assert choice.logprobs.top_logprobs is not None and choice.logprobs.top_logprobs[0] is None
    assert all(len(t) == 1 for t in choice.logprobs.top_logprobs[1:])
    with pytest.raises(openai.BadRequestError):  # (max_tokens 0 without echo: nothing to answer)
        client.completions.create(model=MODEL_NAME, prompt="1+1=", max_tokens=0)


def test_streams_send_every_completion_then_end(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "1+2="}], max_tokens=3, n=2, stream=True
        )
    )
    ends = [c.choices[0] for c in chunks if c.choices[0].finish_reason is not None]
    assert sorted(choice.index for choice in ends) == [0, 1]
    assert all(choice.finish_reason in ("stop", "length") for choice in ends)
    pieces = list(
        client.completions.create(model=MODEL_NAME, prompt=["1+2=", "3+4="], max_tokens=3, stream=True)
    )
    assert sorted(c.choices[0].index for c in pieces if c.choices[0].finish_reason is not None) == [0, 1]
    counted = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "1+2="}],
            max_tokens=3,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *choices, usage = counted
    assert not usage.choices and usage.usage is not None
    tokens = sum(len(c.choices[0].token_ids) for c in choices)  # type: ignore[attr-defined]
    assert usage.usage.completion_tokens == tokens


def test_a_stream_sends_tokens_as_they_are_generated_and_adds_up_to_the_whole(
    client: openai.OpenAI,
) -> None:
    """Chunk by chunk (an engine step each: several per choice), the same text, token ids and logprobs
    as the same request unstreamed; the assistant's role and the weight version come first."""
    ask = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "12+34="}],
        max_tokens=8,
        n=2,
        seed=5,
        logprobs=True,
    )
    whole = client.chat.completions.create(**ask)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(stream=True, **ask))  # type: ignore[call-overload]
    assert chunks[0].weight_version == whole.weight_version  # type: ignore[attr-defined]
    for expected in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == expected.index]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == expected.finish_reason
        pieces = [m for m in mine if m.finish_reason is None]
        assert len(pieces) >= min(3, len(expected.token_ids)), len(pieces)  # type: ignore[attr-defined]
        assert "".join(m.delta.content or "" for m in pieces) == expected.message.content
        assert [t for m in pieces for t in m.token_ids] == expected.token_ids  # type: ignore[attr-defined]
        streamed = [t.logprob for m in pieces for t in (m.logprobs.content or [])]  # type: ignore[union-attr]
        assert streamed == pytest.approx([t.logprob for t in expected.logprobs.content], abs=1e-5)  # type: ignore[union-attr]
        assert mine[-1].prompt_token_ids == expected.prompt_token_ids  # type: ignore[attr-defined]
    text = client.completions.create(model=MODEL_NAME, prompt="7+8=", max_tokens=6, seed=2, logprobs=0)
    parts = list(
        client.completions.create(model=MODEL_NAME, prompt="7+8=", max_tokens=6, seed=2, stream=True)
    )
    assert "".join(p.choices[0].text for p in parts) == text.choices[0].text
    assert [t for p in parts for t in p.choices[0].token_ids] == text.choices[0].token_ids  # type: ignore[attr-defined]


def test_version_rules_and_errors_in_openais_shape(
    client: openai.OpenAI, rollout_fp8: InProcessRollout
) -> None:
    held = rollout_fp8.service.version
    ok = client.completions.create(
        model=MODEL_NAME, prompt="1+1=", max_tokens=2, extra_headers={VERSION_HEADER: str(held)}
    )
    assert ok.weight_version == held  # type: ignore[attr-defined]
    with pytest.raises(openai.ConflictError) as conflict:  # 409: the replica holds another version
        client.completions.create(
            model=MODEL_NAME, prompt="1+1=", max_tokens=2, extra_body={"weight_version": held + 1}
        )
    assert f"not {held + 1}" in error_body(conflict.value)["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_NAME, prompt="1+1=", max_tokens=0)
    assert error_body(bad.value)["param"] == "max_tokens"
    assert error_body(bad.value)["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], top_logprobs=21, logprobs=True
        )
    assert error_body(bad.value)["param"] == "top_logprobs"  # (beyond max_top_logprobs, 20)
    assert "max_top_logprobs" in error_body(bad.value)["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="1+1=", max_tokens=2)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "1+1=", "temperature": "0.5"}, "temperature"),
        ({"prompt": "1+1=", "n": True}, "n"),
        ({"prompt": "1+1=", "seed": 2**64}, "body"),
        ({"prompt": "1+1=", "top_k": 1.5}, "top_k"),
        ({"prompt": [[1, "a"]]}, "prompt"),
        ({"prompt": "1+1=", "weight_version": True}, "weight_version"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_badly_typed_bodies_are_400s_naming_the_field(http: str, body: dict[str, Any], param: str) -> None:
    import httpx

    path = "/chat/completions" if "messages" in body else "/completions"
    reply = httpx.post(f"{http}{path}", json={"model": MODEL_NAME, **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param), error


def test_a_body_past_the_request_limit_is_refused_before_it_is_parsed(
    http: str, rollout_fp8: InProcessRollout
) -> None:
    import httpx

    limit = rollout_fp8.service.limits.max_request_bytes
    huge = b'{"model": "tiny", "prompt": "' + b"1" * limit + b'"}'
    declared = httpx.post(f"{http}/completions", content=huge, timeout=30)
    # Sent in chunks without a declared length, it is cut once past the limit.
    chunked = httpx.post(
        f"{http}/completions",
        content=iter([huge[i : i + 65536] for i in range(0, len(huge), 65536)]),
        timeout=30,
    )
    for reply in (declared, chunked):
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "body" and f"limit of {limit}" in error["message"], error


def test_a_client_that_goes_away_cancels_its_generation(http: str, rollout_fp8: InProcessRollout) -> None:
    """Like gRPC: the generation of a client that disconnects (mid-stream, or while waiting for a plain
    answer) is cancelled instead of running to its end: the replica is idle again well before the same
    work, uninterrupted, would have finished."""
    import json as jsonlib
    import socket
    import time
    from urllib.parse import urlsplit

    import httpx

    loop = rollout_fp8.service.loop
    work = {"model": MODEL_NAME, "prompt": "1", "n": 32, "max_tokens": 240, "temperature": 1.0, "seed": 1}
    start, tokens_before = time.monotonic(), loop.tokens_generated
    assert httpx.post(f"{http}/completions", json=work, timeout=120).status_code == 200
    full, full_tokens = time.monotonic() - start, loop.tokens_generated - tokens_before
    where = urlsplit(http)
    for stream in (True, False):
        body = jsonlib.dumps({**work, "stream": stream}).encode()
        head = f"POST {where.path}/completions HTTP/1.1\r\nHost: {where.netloc}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        tokens_before = loop.tokens_generated
        with socket.create_connection((where.hostname, where.port), timeout=10) as raw:
            raw.sendall(head.encode() + body)
            deadline = time.monotonic() + 10
            while not loop.in_flight and time.monotonic() < deadline:  # admitted and generating
                time.sleep(0.01)
            assert loop.in_flight
        hung_up = time.monotonic()  # the socket is closed: the client went away mid-generation
        while loop.in_flight and time.monotonic() < hung_up + full:
            time.sleep(0.02)
        idle_after = time.monotonic() - hung_up
        tokens = loop.tokens_generated - tokens_before  # of the samples that finished before the cancel
        print(
            f"stream={stream}: idle {idle_after:.2f} s after hanging up, {tokens} of {full_tokens} tokens; "
            f"the whole work takes {full:.2f} s"
        )
        # Cancelled, not run to its end: the same seeded work would finish every sample (on an idle
        # machine the replica is idle again within 0.1 s; under load noticing the hang-up can take seconds).
        assert loop.in_flight == 0 and tokens < full_tokens and idle_after < full, (
            stream,
            idle_after,
            tokens,
        )
