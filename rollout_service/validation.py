"""Generate requests -> engine requests, with every bad field named (pure: no engine, no gRPC calls)."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fp8rl.errors import InvalidRequest, Overloaded
from fp8rl.sampling import sampling_settings
from fp8rl.v1 import common_pb2, rollout_pb2
from rollout_service.engine import EngineRequest, Sampling
from rollout_service.generation import ANY_VERSION


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    max_n: int
    max_request_bytes: int
    default_max_tokens: int  # for a request that leaves sampling.max_tokens unset (RolloutConfig's)
    max_samples: int = 1 << 62  # prompts x n of one request
    max_prompt_bytes: int = 1 << 62  # a text longer than this cannot fit the context: refused untokenized
    max_top_logprobs: int = 0  # alternatives per token a request may ask for


@dataclass(frozen=True)
class Slot:
    """Where an engine request's completion belongs in the response."""

    prompt_id: str
    sample_index: int
    prompt_token_ids: list[int]


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A distinct, reproducible seed per sample, so n samples of one prompt differ."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def parse_sampling(s: common_pb2.SamplingParams, max_model_len: int, default_max_tokens: int) -> Sampling:
    distribution = sampling_settings(s)
    temperature, top_p, top_k = distribution.temperature, distribution.top_p, distribution.top_k
    max_tokens = s.max_tokens if s.HasField("max_tokens") else min(default_max_tokens, max_model_len)
    if not 0 < max_tokens <= max_model_len:
        raise InvalidRequest("sampling.max_tokens", f"must lie in [1, {max_model_len}], got {max_tokens}")
    if any(not stop for stop in s.stop):
        raise InvalidRequest("sampling.stop", "stop strings must not be empty")
    seed = s.seed if s.HasField("seed") else None
    return Sampling(temperature, top_p, top_k, max_tokens, tuple(s.stop), seed)


@dataclass(frozen=True)
class Tokenizer:
    """The engine's tokenizer as validation needs it."""

    text: Callable[[str], list[int]]
    chat: Callable[[list[dict[str, str]]], list[int]] | None  # None: the model has no chat template


def prompt_token_ids(
    prompt: rollout_pb2.Prompt, index: int, limits: Limits, tokenize: Tokenizer
) -> list[int]:
    field = f"prompts[{index}]"
    kind = prompt.WhichOneof("input")
    text_bytes = len(prompt.text.encode()) + sum(len(m.content.encode()) for m in prompt.chat.messages)
    if text_bytes > limits.max_prompt_bytes:  # checked before the tokenizer spends time and memory on it
        raise InvalidRequest(
            field,
            f"{text_bytes} bytes of text cannot fit a context of {limits.max_model_len} tokens "
            f"(at most {limits.max_prompt_bytes} bytes)",
        )
    if kind == "text":
        ids = tokenize.text(prompt.text)
    elif kind == "chat":
        field += ".chat"
        messages = prompt.chat.messages
        if not messages:
            raise InvalidRequest(field, "at least one message is required")
        for j, m in enumerate(messages):
            if not m.role:
                raise InvalidRequest(f"{field}[{j}].role", "got (unset)")
        if tokenize.chat is None:
            raise InvalidRequest(field, "this model has no chat template; send text or token_ids")
        try:
            ids = tokenize.chat([{"role": m.role, "content": m.content} for m in messages])
        except Exception as exc:  # the template rejected the conversation (a role it does not know, ...)
            raise InvalidRequest(field, f"the chat template refused it: {exc}") from None
    elif kind == "token_ids":
        ids = list(prompt.token_ids.ids)
        field += ".token_ids"
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequest(field, f"token id {bad[0]} outside the vocabulary [0, {limits.vocab_size})")
    else:
        raise InvalidRequest(field, "set one of text, token_ids or chat, got (unset)")
    if not ids:
        raise InvalidRequest(field, "empty prompt")
    if len(ids) >= limits.max_model_len:
        raise InvalidRequest(field, f"{len(ids)} tokens leave no room in a context of {limits.max_model_len}")
    return ids


def required_version(request: rollout_pb2.GenerateRequest) -> int:
    """The weight version the request requires; ANY_VERSION (-1) when it leaves the field unset."""
    if not request.HasField("weight_version"):
        return ANY_VERSION
    if request.weight_version < ANY_VERSION:
        raise InvalidRequest(
            "weight_version", f"must be a version >= 0 or -1 (any), got {request.weight_version}"
        )
    return request.weight_version


def parse_generate(
    request: rollout_pb2.GenerateRequest, limits: Limits, tokenize: Tokenizer, stream: bool = False
) -> tuple[list[EngineRequest], list[Slot]]:
    """Validate a request and expand it into one engine request per sample; unset fields take their
    defaults (n 1, max_tokens ``limits.default_max_tokens``). Its version: :func:`required_version`."""
    size = request.ByteSize()
    if size > limits.max_request_bytes:
        raise InvalidRequest("request", f"{size} bytes exceed the limit of {limits.max_request_bytes}")
    if not request.prompts:
        raise InvalidRequest("prompts", "at least one prompt is required")
    n = request.n if request.HasField("n") else 1
    if not 1 <= n <= limits.max_n:
        raise InvalidRequest("n", f"must lie in [1, {limits.max_n}], got {n}")
    samples = len(request.prompts) * n
    if samples > limits.max_samples:
        raise Overloaded(
            f"prompts x n: {samples} samples pass the per-request limit of {limits.max_samples} "
            "(max_samples_per_request); split the request",
            transient=False,
        )
    sampling = parse_sampling(request.sampling, limits.max_model_len, limits.default_max_tokens)
    if not 0 <= request.top_logprobs <= limits.max_top_logprobs:
        raise InvalidRequest(
            "top_logprobs",
            f"must lie in [0, {limits.max_top_logprobs}] (max_top_logprobs), got {request.top_logprobs}",
        )
    tag = request.request_id or "req"
    batch = f"{tag}-{uuid.uuid4().hex[:12]}"
    engine_requests, slots = [], []
    seen: set[str] = set()
    for i, prompt in enumerate(request.prompts):
        prompt_id = prompt.id or str(i)
        if prompt_id in seen:
            raise InvalidRequest(f"prompts[{i}].id", f"duplicate prompt id {prompt_id!r}")
        seen.add(prompt_id)
        ids = prompt_token_ids(prompt, i, limits, tokenize)
        # The context bounds prompt + completion: a long prompt leaves fewer completion tokens.
        max_tokens = min(sampling.max_tokens, limits.max_model_len - len(ids))
        for j in range(n):
            seed = None if sampling.seed is None else sample_seed(sampling.seed, i, j)
            per_sample = Sampling(
                sampling.temperature,
                sampling.top_p,
                sampling.top_k,
                max_tokens,
                sampling.stop,
                seed,
                request.top_logprobs,
                request.prompt_logprobs,
            )
            engine_requests.append(EngineRequest(f"{batch}:{i}:{j}", ids, per_sample, stream))
            slots.append(Slot(prompt_id, j, ids))
    return engine_requests, slots
