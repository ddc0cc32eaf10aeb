"""OpenAI-compatible HTTP face of a replica, for agent and environment frameworks: ``POST /v1/completions``,
``POST /v1/chat/completions`` (plain, or SSE with ``stream``), ``GET /v1/models``.

The same engine, validation and version rules as gRPC: each request becomes a ``GenerateRequest`` for
:meth:`RolloutService.generate`. Requests are validated with the ``openai`` package's own parameter types
and answers are built from its response models, plus what RL needs: each choice's sampled ``token_ids``
and ``prompt_token_ids``, and the ``weight_version`` that produced them (also the ``X-Weight-Version``
header). A version can be required with the ``X-Weight-Version`` header or a ``weight_version`` body
field (409 when the replica holds another); ``top_k`` is accepted in the body too. Logprobs are those of
the sampled tokens (the distribution they were sampled from, as over gRPC), with up to the replica's
``max_top_logprobs`` alternatives per token when asked (``logprobs: N``; chat's ``top_logprobs``).
``echo`` returns the prompt with its logprobs (the model's raw distribution); with ``max_tokens: 0`` it
only scores the prompt (one token is generated and dropped: the engine generates at least one). A
stream sends the tokens as the engine generates them (a chunk per engine step and choice, with their
ids and logprobs; the last of each choice has its finish reason), then ``[DONE]``. A client that goes
away cancels its generation.

The modules, lowest first (each imports only modules listed before it; named ``openai_face``, not
``openai``, as the ``openai`` package is imported beside it):

* :mod:`~rollout_service.openai_face.requests`: OpenAI requests -> ``GenerateRequest`` (pure), every bad
  field named as OpenAI names it; a refused request -> its HTTP status and OpenAI error body (one table).
* :mod:`~rollout_service.openai_face.responses`: completions -> the pieces of OpenAI's answers (usage,
  an echoed prompt scored, the choice types the ``openai`` package lacks).
* :mod:`~rollout_service.openai_face.streaming`: a generation as it happens: waited for off the event
  loop, cancelled when the client goes away, sent as server-sent events; the body read within its limit.
* :mod:`~rollout_service.openai_face.schema`: the OpenAPI document's request and answer schemas.
* :mod:`~rollout_service.openai_face.face`: ``OpenAIFace``, the handlers: a request admitted as a Generate
  call (an episode's turn continued exactly), its completions as OpenAI's answers and stream chunks.
* :mod:`~rollout_service.openai_face.app`: ``build_app`` (routes, the bearer-token check, domain errors as
  HTTP answers, the OpenAPI document) and ``HttpServer`` (uvicorn on its own thread).
"""

from rollout_service.openai_face.app import HttpServer, build_app
from rollout_service.openai_face.requests import VERSION_HEADER

__all__ = ["VERSION_HEADER", "HttpServer", "build_app"]
