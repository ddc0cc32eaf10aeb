"""``OpenAIFace``, the handlers: an OpenAI request admitted as a Generate call (within its call's scope:
an episode's turn continued exactly, rollout_service/episodes.py), and its completions answered as
OpenAI's response models and stream chunks."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from fp8rl.errors import InvalidRequest
from fp8rl.security import is_run_caller
from fp8rl.v1 import rollout_pb2
from rollout_service.episodes import OUTSIDE_EPISODES, CallScope, Episodes
from rollout_service.openai_face.requests import (
    UnknownModel,
    chat_prompt,
    completion_prompts,
    fitting,
    generate_request,
    is_int,
    refuse_unsupported,
    request_adapters,
    validated,
)
from rollout_service.openai_face.responses import (
    completion_logprobs,
    scored_prompt,
    streamed_choice,
    usage_of,
)
from rollout_service.service import Generation, RolloutService
from rollout_service.validation import parse_sampling

SCORE_ONLY = "fp8rl_score_only"  # (in the admitted body: echo with max_tokens 0)


class OpenAIFace:
    """Turns OpenAI requests into Generate calls and completions into OpenAI answers."""

    def __init__(self, service: RolloutService, model_name: str) -> None:
        self.service, self.model_name = service, model_name
        self.completion_params, self.chat_params = request_adapters()
        self.episodes = Episodes(service.config.episodes)

    def token_texts(self, ids: Iterable[int]) -> list[str]:
        return [self.service.engine.tokenizer.decode([t]) for t in ids]

    def check_model(self, body: dict[str, Any]) -> None:
        if body.get("model") != self.model_name:
            raise UnknownModel("model", f"this replica serves {self.model_name!r}, not {body.get('model')!r}")

    # -- /v1/completions ----------------------------------------------------------------------------
    def completions(
        self, body: Any, headers: Any, scope: CallScope = OUTSIDE_EPISODES
    ) -> tuple[Generation, dict[str, Any]]:
        body = validated(self.completion_params, body)
        self.check_model(body)
        refuse_unsupported(body, {"best_of": 1, "suffix": "", "presence_penalty": 0, "frequency_penalty": 0})
        if body.get("logit_bias"):
            raise InvalidRequest("logit_bias", "not supported by this server")
        top = body.get("logprobs")
        if top is not None and not (is_int(top) and top >= 0):
            raise InvalidRequest("logprobs", f"must be an integer >= 0, got {top!r}")
        echo = bool(body.get("echo"))
        score_only = echo and body.get("max_tokens") == 0
        asked = {**body, "max_tokens": 1} if score_only else body
        with fitting("prompt"):
            prompts = completion_prompts(body["prompt"])
        prompts = scope.prompts(prompts, body, self.service.engine)
        request = generate_request(asked, headers, prompts, "max_tokens")
        with fitting("logprobs"):  # (an int32 on the wire: 2**31 found by schemathesis)
            request.top_logprobs = top or 0
        request.prompt_logprobs = echo and top is not None
        if echo and body.get("stream"):
            raise InvalidRequest("echo", "not streamed by this server: ask without stream")
        self.check_room(scope, request)
        try:
            generation = self.service.generate(request, bool(body.get("stream")), is_run_caller())
        except InvalidRequest as exc:
            if exc.field != "top_logprobs":
                raise
            # (ours; these completions call it logprobs: found by schemathesis)
            raise InvalidRequest("logprobs", str(exc).removeprefix("top_logprobs: ")) from None
        return generation, {**body, SCORE_ONLY: score_only}

    def check_room(self, scope: CallScope, request: rollout_pb2.GenerateRequest) -> None:
        """The scope's refusal of a request whose prompt and most completion tokens (as validation reads
        them) could pass its bounds (an episode's tokens)."""
        limits = self.service.limits

        def most_tokens() -> int:  # (read only by a scope with a bound: a plain call does no extra work)
            sampling = parse_sampling(request.sampling, limits.max_model_len, limits.default_max_tokens)
            return sampling.max_tokens

        scope.check_room(request, most_tokens)

    def completion_choice(self, c: rollout_pb2.Completion, n: int, body: dict[str, Any]) -> Any:
        """OpenAI's choice of ``c``; with ``echo`` the prompt comes first, in the text and in the logprobs
        (its first token has none). ``token_ids`` stay the sampled ids, as gRPC's."""
        from openai.types import CompletionChoice

        echo, top = bool(body.get("echo")), body.get("logprobs")
        prompt = self.service.engine.tokenizer.decode(list(c.prompt_token_ids)) if echo else ""
        choice = CompletionChoice(
            index=int(c.prompt_id) * n + c.sample_index,
            text=prompt + c.text,
            finish_reason=c.finish_reason or "stop",
            token_ids=list(c.token_ids),
            prompt_token_ids=list(c.prompt_token_ids),
        )
        if top is not None:
            ids = [*(c.prompt_token_ids if echo else []), *c.token_ids]
            tokens = self.token_texts(ids)
            scored: list[float | None] = [*([None, *c.prompt_logprobs] if echo else []), *c.logprobs]
            offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
            alternatives = [*([None, *c.prompt_top_logprobs] if echo else []), *c.top_logprobs]
            choice.logprobs = completion_logprobs()(
                tokens=tokens,
                token_logprobs=scored,
                text_offset=offsets,
                top_logprobs=[None if a is None else self.alternatives(a) for a in alternatives]
                if top
                else None,
            )
        return choice

    def alternatives(self, a: rollout_pb2.TokenAlternatives) -> dict[str, float]:
        """A position's alternatives as OpenAI's legacy completions show them: token text -> logprob (two
        tokens with one text, e.g. partial UTF-8 bytes, keep the more likely's)."""
        shown: dict[str, float] = {}
        for text, logprob in zip(self.token_texts(a.token_ids), a.logprobs, strict=True):
            shown.setdefault(text, logprob)
        return shown

    def completion(
        self, completions: list[rollout_pb2.Completion], version: int, body: dict[str, Any]
    ) -> Any:
        completions = [scored_prompt(c) if body[SCORE_ONLY] else c for c in completions]
        prompt_tokens = sum(len(c.prompt_token_ids) for c in completions if c.sample_index == 0)
        return self.completion_of(completions, version, body, usage_of(completions, prompt_tokens))

    def completion_of(
        self, completions: list[rollout_pb2.Completion], version: int, body: dict[str, Any], usage: Any
    ) -> Any:
        from openai.types import Completion

        n = body.get("n") or 1
        return Completion(
            id=f"cmpl-{uuid.uuid4().hex}",
            object="text_completion",
            created=int(time.time()),
            model=self.model_name,
            choices=[self.completion_choice(c, n, body) for c in completions],
            usage=usage,
            weight_version=version,
        )

    # -- /v1/chat/completions -----------------------------------------------------------------------
    def chat(
        self, body: Any, headers: Any, scope: CallScope = OUTSIDE_EPISODES
    ) -> tuple[Generation, dict[str, Any]]:
        body = validated(self.chat_params, body, lazy=("messages",))
        self.check_model(body)
        refuse_unsupported(body, {"presence_penalty": 0, "frequency_penalty": 0})
        top = body.get("top_logprobs")
        if top and not body.get("logprobs"):
            raise InvalidRequest("top_logprobs", "needs logprobs: true")
        for name in (
            "tools",
            "functions",
            "function_call",
            "logit_bias",
            "response_format",
            "audio",
            "modalities",
        ):
            if body.get(name):
                raise InvalidRequest(name, "not supported by this server")
        with fitting("messages"):
            prompts = [chat_prompt(body["messages"])]
        prompts = scope.prompts(prompts, body, self.service.engine)
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        request = generate_request(body, headers, prompts, key)
        with fitting("top_logprobs"):
            request.top_logprobs = top or 0
        self.check_room(scope, request)
        return self.service.generate(request, bool(body.get("stream")), is_run_caller()), body

    def chat_logprobs(self, c: rollout_pb2.Completion) -> Any:
        from openai.types.chat.chat_completion import ChoiceLogprobs
        from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob, TopLogprob

        def top(i: int) -> list[TopLogprob]:
            if not c.top_logprobs:
                return []
            a = c.top_logprobs[i]
            return [
                TopLogprob(token=t, logprob=lp, bytes=list(t.encode()))
                for t, lp in zip(self.token_texts(a.token_ids), a.logprobs, strict=True)
            ]

        return ChoiceLogprobs(
            content=[
                ChatCompletionTokenLogprob(token=t, logprob=lp, bytes=list(t.encode()), top_logprobs=top(i))
                for i, (t, lp) in enumerate(zip(self.token_texts(c.token_ids), c.logprobs, strict=True))
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

    def chat_completion(
        self, completions: list[rollout_pb2.Completion], version: int, body: dict[str, Any]
    ) -> Any:
        from openai.types.chat import ChatCompletion, ChatCompletionMessage
        from openai.types.chat.chat_completion import Choice

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
            usage=usage_of(completions, len(completions[0].prompt_token_ids) if completions else 0),
            weight_version=version,
        )

    def chat_chunks(
        self, version: int, body: dict[str, Any]
    ) -> Callable[[rollout_pb2.Completion, bool], Any]:
        """The stream's chunks, all under one id: a piece of a completion as it is generated (the first
        of a choice with the assistant's role), then, once it finished, one with its finish reason and
        prompt ids but nothing new."""
        from openai.types.chat import ChatCompletionChunk
        from openai.types.chat.chat_completion_chunk import Choice, ChoiceDelta, ChoiceLogprobs

        chunk_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        started: set[int] = set()

        def chunk(c: rollout_pb2.Completion, done: bool) -> Any:
            first = c.sample_index not in started
            started.add(c.sample_index)
            if done:
                fields = self.chat_choice_fields(c, body) | {"logprobs": None, "token_ids": []}
                delta = ChoiceDelta(role="assistant") if first else ChoiceDelta()
            else:
                fields = {
                    "index": c.sample_index,
                    "logprobs": ChoiceLogprobs(content=self.chat_logprobs(c).content)
                    if body.get("logprobs")
                    else None,
                    "token_ids": list(c.token_ids),
                }
                delta = ChoiceDelta(role="assistant" if first else None, content=c.text)
            return ChatCompletionChunk(
                id=chunk_id,
                object="chat.completion.chunk",
                created=created,
                model=self.model_name,
                choices=[Choice(delta=delta, **fields)],
                weight_version=version,
            )

        return chunk

    def completion_chunks(
        self, version: int, body: dict[str, Any]
    ) -> Callable[[rollout_pb2.Completion, bool], Any]:
        """The stream's chunks: a piece of a completion as it is generated, then, once it finished, one
        with its finish reason and prompt ids but nothing new."""

        def chunk(c: rollout_pb2.Completion, done: bool) -> Any:
            answer = self.completion_of([c], version, body, usage=None)
            choice = answer.choices[0]
            if done:  # (everything was sent in pieces)
                choice.text, choice.token_ids, choice.logprobs = "", [], None
            else:
                answer.choices = [streamed_choice()(**choice.model_dump() | {"finish_reason": None})]
            return answer

        return chunk
