"""Episodes on the real replica (vLLM on CPU) through the official `openai` client: a multi-turn
conversation under /episodes/{id}/v1 is recorded as the engine saw it, later turns continue the sampled
ids, and the recorded turns become training samples with a loss mask over the policy's tokens."""

from __future__ import annotations

import itertools
import json
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from rollout_service.openai_face import HttpServer, build_app
from tests.conftest import InProcessRollout

MODEL = "tiny"


@pytest.fixture(scope="module")
def http(replica_http: str) -> str:
    return replica_http


def client(http: str, episode: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http}/episodes/{episode}/v1", api_key="unused", max_retries=0)


def call(method: str, url: str) -> tuple[int, Any]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def chat(c: openai.OpenAI, messages: list[dict[str, str]], **extra: Any) -> Any:
    return c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, logprobs=True, **extra)


def test_a_three_turn_chat_is_one_sample_of_the_sampled_ids(http: str, rollout_fp8: InProcessRollout) -> None:
    tokenizer = AutoTokenizer.from_pretrained(rollout_fp8.model_dir)
    c = client(http, "three-turns")
    messages = [{"role": "user", "content": "12+34="}]
    replies = []
    for turn, follow_up in enumerate(["and 5+6=", "and 7+8=", None]):
        answer = chat(c, messages, seed=turn)
        replies.append(answer)
        if follow_up is not None:
            messages = [
                *messages,
                {"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": follow_up},
            ]
    status, episode = call("GET", f"{http}/episodes/three-turns")
    assert status == 200
    turns = episode["turns"]
    assert [t["extends"] for t in turns] == [False, True, True]
    for turn, answer in zip(turns, replies, strict=True):  # what the client was answered is what is recorded
        choice = answer.choices[0]
        assert turn["token_ids"] == choice.token_ids and turn["prompt_token_ids"] == choice.prompt_token_ids
        assert turn["logprobs"] == pytest.approx([t.logprob for t in choice.logprobs.content], abs=1e-6)
        assert turn["weight_version"] == answer.weight_version
    # Each later prompt continues the previous prompt and its sampled ids exactly...
    for before, after in itertools.pairwise(turns):
        prefix = before["prompt_token_ids"] + before["token_ids"]
        assert after["prompt_token_ids"][: len(prefix)] == prefix
    # ...and is the template's rendering of the conversation with each reply's text replaced by the ids
    # the policy sampled for it (the tiny template closes a turn with "\n", no end-of-turn token; its
    # tokenizer has one token per byte, so the template's text between replies tokenizes on its own).
    hole = "\x00"
    shown = [{**m, "content": hole} if m["role"] == "assistant" else m for m in messages]
    pieces = tokenizer.apply_chat_template(shown, add_generation_prompt=True, tokenize=False).split(hole)
    expected = tokenizer(pieces[0], add_special_tokens=False).input_ids
    for turn, piece in zip(turns, pieces[1:], strict=False):
        expected += turn["token_ids"] + tokenizer(piece, add_special_tokens=False).input_ids
    assert turns[2]["prompt_token_ids"] == expected

    [sample] = episode["samples"]
    first = turns[0]["prompt_token_ids"]
    assert sample["prompt_token_ids"] == first and sample["turns"] == [0, 1, 2]
    completion, mask = sample["completion_token_ids"], sample["loss_mask"]
    assert completion == turns[2]["prompt_token_ids"][len(first) :] + turns[2]["token_ids"]
    policy = [i for i, m in enumerate(mask) if m]
    expected = []
    for t in turns:
        start = len(t["prompt_token_ids"]) - len(first)
        expected += range(start, start + len(t["token_ids"]))
    assert policy == expected
    assert [completion[i] for i in policy] == [x for t in turns for x in t["token_ids"]]
    assert [sample["logprobs"][i] for i in policy] == [x for t in turns for x in t["logprobs"]]
    assert sample["weight_versions"] == [t["weight_version"] for t in turns]

    status, ended = call("DELETE", f"{http}/episodes/three-turns")
    assert status == 200 and ended == episode
    assert call("GET", f"{http}/episodes/three-turns")[0] == 404


def test_a_turn_that_rewrites_the_history_is_a_sample_of_its_own(http: str) -> None:
    c = client(http, "rewritten")
    first = chat(c, [{"role": "user", "content": "1+2="}], seed=1)
    edited = [
        {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": first.choices[0].message.content + " (edited)"},
        {"role": "user", "content": "3+4="},
    ]
    chat(c, edited, seed=2)
    _, episode = call("GET", f"{http}/episodes/rewritten")
    assert [t["extends"] for t in episode["turns"]] == [False, False]
    assert [s["turns"] for s in episode["samples"]] == [[0], [1]]
    assert all(all(s["loss_mask"]) for s in episode["samples"])


def test_completions_turns_continue_text_and_ids(http: str) -> None:
    c = client(http, "completions")
    one = c.completions.create(model=MODEL, prompt="12+34=", max_tokens=4, seed=3)
    text = "12+34=" + one.choices[0].text + "\n5+6="
    two = c.completions.create(model=MODEL, prompt=text, max_tokens=4, seed=4)
    ids = two.choices[0].prompt_token_ids + two.choices[0].token_ids + [9]  # type: ignore[attr-defined]
    c.completions.create(model=MODEL, prompt=ids, max_tokens=4, seed=5)
    _, episode = call("GET", f"{http}/episodes/completions")
    turns = episode["turns"]
    assert [t["extends"] for t in turns] == [False, True, True]
    assert turns[1]["prompt_token_ids"][: len(turns[0]["prompt_token_ids"]) + len(turns[0]["token_ids"])] == (
        turns[0]["prompt_token_ids"] + turns[0]["token_ids"]
    )
    assert turns[2]["prompt_token_ids"] == ids
    assert len(episode["samples"]) == 1


def test_a_streamed_turn_is_recorded_as_a_whole_one(http: str) -> None:
    c = client(http, "streamed")
    messages = [{"role": "user", "content": "2+2="}]
    chunks = list(chat(c, messages, seed=11, stream=True))
    streamed = [t for ch in chunks if ch.choices for t in (ch.choices[0].token_ids or [])]  # type: ignore[attr-defined]
    _, episode = call("GET", f"{http}/episodes/streamed")
    [turn] = episode["turns"]
    assert turn["token_ids"] == streamed
    plain = chat(client(http, "not-streamed"), messages, seed=11)
    assert plain.choices[0].token_ids == streamed  # type: ignore[attr-defined]


def test_episodes_refuse_what_a_turn_cannot_be(http: str) -> None:
    c = client(http, "bounded")
    with pytest.raises(openai.BadRequestError, match="n: 1"):
        chat(c, [{"role": "user", "content": "1+1="}], n=2)
    with pytest.raises(openai.BadRequestError) as bad:
        client(http, "bad id!").completions.create(model=MODEL, prompt="1+1=", max_tokens=2)
    assert "episode_id" in str(bad.value)
    assert call("GET", f"{http}/episodes/never")[0] == 404


def test_a_full_store_is_a_429_to_retry_and_a_capped_request_one_not_to(
    http: str, rollout_fp8: InProcessRollout
) -> None:
    import httpx

    limits = rollout_fp8.service.config.episodes
    held = limits.max_episodes
    body = {"model": MODEL, "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 1}
    server = HttpServer("127.0.0.1", 0).serve(build_app(rollout_fp8.service, MODEL))  # (a store of its own)
    own = f"http://127.0.0.1:{server.port}"
    try:
        limits.max_episodes = 1
        refused = httpx.post(f"{own}/episodes/first/v1/chat/completions", json={**body, "n": 2}, timeout=60)
        assert refused.status_code == 400  # (a refused first turn holds no episode)
        first = httpx.post(f"{own}/episodes/first/v1/chat/completions", json=body, timeout=60)
        assert first.status_code == 200, first.text
        full = httpx.post(f"{own}/episodes/second/v1/chat/completions", json=body, timeout=60)
        assert full.status_code == 429 and full.headers["retry-after"] == "1", full.text
        assert "episodes are open" in full.json()["error"]["message"]
    finally:
        limits.max_episodes = held
        server.stop()
    # Over the per-request cap (prompts x n past max_samples_per_request): asking again cannot help.
    many = {"model": MODEL, "prompt": ["1+1="] * 65, "n": 64, "max_tokens": 1}
    capped = httpx.post(f"{http}/v1/completions", json=many, timeout=60)
    assert capped.status_code == 429 and capped.headers["x-should-retry"] == "false", capped.text
