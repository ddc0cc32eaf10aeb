"""Multi-turn environments (``--env module:factory``): episodes that talk to the policy through an OpenAI
client, for several turns, and end with a reward.

An environment hands out problems as a task does and plays one episode of a problem against a
:class:`Policy`: an ``openai.OpenAI`` client whose base URL is the episode's on a replica
(``/episodes/{id}/v1``, rollout_service/episodes.py), pinned to the step's weight version. The replica
records every turn as the engine saw it; when the episode ends, the coordinator takes its recorded
samples (the conversation as one token sequence, the policy's own tokens under a loss mask) and trains
on them with the episode's reward, a GRPO group per problem.

The factory is called as ``factory(seed=...)``; ``--env arith-feedback`` names the shipped one
(coordinator/arith_feedback.py). The coordinator's instance hands out the problems; each episode is
played in a worker process (coordinator/user_code.py) by the worker's own instance, so an episode that
hangs, crashes, leaks or raises costs that episode (scored 0), never the run.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import ssl
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import httpx

from coordinator.problems import CallFailed, Problem
from coordinator.user_code import WorkerPool, load_plugin
from fp8rl.security import SERVER_NAMES, SecurityConfig
from fp8rl.v1 import common_pb2

if TYPE_CHECKING:
    import openai

log = logging.getLogger(__name__)

BUILT_IN = {"arith-feedback": "coordinator.arith_feedback:ArithFeedback"}
TURN_DEADLINE_S = 600.0  # one HTTP call of an episode
CONCURRENT_EPISODES = 16
ATTEMPTS = 3  # an episode is played at most this often (on each replica once, if there are more)


@dataclass
class Policy:
    """The policy as an episode reaches it. ``client`` is an ``openai.OpenAI`` client at the episode's
    URL (every call through it is one of the episode's turns); ``sampling`` holds the run's sampling
    parameters as keyword arguments of ``client.chat.completions.create`` (and ``completions.create``)."""

    client: openai.OpenAI
    model: str
    sampling: dict[str, Any] = field(default_factory=dict)

    def chat(self, messages: list[dict[str, str]]) -> str:
        """One turn: the assistant's reply to ``messages``."""
        answer = self.client.chat.completions.create(
            model=self.model, messages=cast(Any, messages), **self.sampling
        )
        return answer.choices[0].message.content or ""


class Environment(Protocol):
    def train_problems(self, step: int, count: int) -> list[Problem]: ...
    def val_problems(self) -> list[Problem]: ...
    def play(self, problem: Problem, policy: Policy) -> float:
        """One episode of ``problem``: as many turns as it takes; its reward."""
        ...

    def close(self) -> None: ...


def load_environment(spec: str, seed: int) -> Environment:
    """``module:factory`` (or a built-in's name) called with the run's seed. Raises ValueError."""
    if spec not in BUILT_IN and ":" not in spec:
        raise ValueError(f"env {spec!r} is neither module:factory nor one of {', '.join(BUILT_IN)}")
    factory = load_plugin(BUILT_IN.get(spec, spec), "env", "module:factory")
    env = factory(seed=seed)
    for method in ("train_problems", "val_problems", "play", "close"):
        if not callable(getattr(env, method, None)):
            raise ValueError(f"env {spec!r}: what its factory made has no method {method}")
    return cast(Environment, env)


@dataclass(frozen=True)
class PlayedEpisode:
    """A finished episode: its problem, reward and the replica's recording (GET /episodes/{id}); an
    episode the environment's code failed (``failure``: how) scores 0, with what it had recorded."""

    problem: Problem
    reward: float
    recorded: dict[str, Any]
    failure: CallFailed | None = None

    @property
    def turns(self) -> int:
        return len(self.recorded["turns"])


class EpisodeFailed(RuntimeError):
    """Every replica failed an episode (the step's batch cannot be made)."""


def openai_sampling(sampling: common_pb2.SamplingParams) -> dict[str, Any]:
    """The run's sampling as OpenAI request arguments (top_k in the body: not OpenAI's)."""
    args: dict[str, Any] = {"temperature": sampling.temperature, "max_tokens": sampling.max_tokens}
    if sampling.top_p and sampling.top_p < 1:
        args["top_p"] = sampling.top_p
    if sampling.stop:
        args["stop"] = list(sampling.stop)
    if sampling.top_k > 0:
        args["extra_body"] = {"top_k": sampling.top_k}
    return args


def http_client(token: str, tls_ca: Path | None) -> httpx.Client:
    """One client for every replica, with the coordinator's bearer token; over TLS the replica's
    certificate must name the replica's role (as gRPC checks)."""
    verify: Any = True
    transport: httpx.BaseTransport | None = None
    if tls_ca is not None:
        verify = ssl.create_default_context(cafile=str(tls_ca))
        transport = NamedServer(SERVER_NAMES["rollout"], verify)
    return httpx.Client(
        headers={"Authorization": f"Bearer {token}"},
        timeout=TURN_DEADLINE_S,
        transport=transport,
        verify=verify,
    )


def read_token(token_file: Path | None) -> str:
    return token_file.read_text().strip() if token_file is not None else "none"


EpisodeOutcome = tuple[str, Any]
"""What an episode worker answers: ("reward", r), or ("replica", what failed) when the replica did."""


def episode_player(
    spec: str, seed: int, token_file: Path | None, tls_ca: Path | None
) -> Callable[[Problem, str, int, str, dict[str, Any]], EpisodeOutcome]:
    """An episode worker's callable (coordinator/user_code.py): the worker's own instance of the
    environment, playing one episode at a time at an episode URL. The token is read from its file here,
    never passed along."""
    import openai

    env = load_environment(spec, seed)
    token = read_token(token_file)
    http = http_client(token, tls_ca)

    def play(
        problem: Problem, url: str, version: int, model: str, sampling: dict[str, Any]
    ) -> EpisodeOutcome:
        client = openai.OpenAI(
            base_url=f"{url}/v1",
            api_key=token,  # (sent as the bearer token)
            http_client=cast(Any, http),  # (openai 3 takes httpx's clients beside its httpx2's)
            default_headers={"X-Weight-Version": str(version)},
            max_retries=0,
        )
        try:
            reward = float(env.play(problem, Policy(client, model, sampling)))
        except (openai.APIError, OSError) as exc:
            return "replica", f"{type(exc).__name__}: {exc}"
        if not math.isfinite(reward):
            raise ValueError(f"the environment's reward of {problem.id} is {reward}: it must be finite")
        return "reward", reward

    return play


class EpisodeRunner:
    """Plays an environment's episodes on the replicas' HTTP faces (their ``RolloutStatus.http_address``),
    a few at once, each in a worker process (coordinator/user_code.py) with its own instance of the
    environment, bounded by ``deadline_s`` and ``memory_mb``.

    An episode whose replica fails (a connection error, an HTTP error: e.g. 409 once the replica holds
    another version) is played again from the start on the next one (on the same one when it is the only
    one), at most ATTEMPTS times or once per replica. An episode whose environment code hangs, crashes,
    leaks or raises scores 0 with the turns it had (``PlayedEpisode.failure``)."""

    def __init__(
        self,
        spec: str,
        seed: int,
        security: SecurityConfig | None,
        deadline_s: float = 900.0,
        memory_mb: int = 2048,
    ) -> None:
        self.security = security or SecurityConfig()
        self._models: dict[str, str] = {}  # HTTP address -> the model name it serves
        self._pool = ThreadPoolExecutor(max_workers=CONCURRENT_EPISODES, thread_name_prefix="episode")
        self._http = http_client(read_token(self.security.token_file), self.security.tls_ca)
        self.players = WorkerPool(
            "coordinator.environments:episode_player",
            (spec, seed, self.security.token_file, self.security.tls_ca),
            name=f"episode of {spec}",
            workers=CONCURRENT_EPISODES,
            deadline_s=deadline_s,
            memory_mb=memory_mb,
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.players.close()
        self._http.close()

    def base(self, http_address: str) -> str:
        return f"{'https' if self.security.tls_ca is not None else 'http'}://{http_address}"

    def play(
        self,
        problems: Sequence[tuple[Problem, int]],
        sampling: common_pb2.SamplingParams,
        version: int,
        replicas: dict[str, str],
        prefix: str,
        on_failure: Callable[[str, Exception], None],
    ) -> list[PlayedEpisode]:
        """Each (problem, count) ``count`` times under ``version`` on ``replicas`` (gRPC address -> HTTP
        address); ``prefix`` names the episodes (with a random part: a replayed step never meets an
        episode of an earlier attempt)."""
        served = [(grpc, http) for grpc, http in sorted(replicas.items()) if http]
        if not served:
            raise EpisodeFailed(
                "no replica serves HTTP (RolloutStatus.http_address): start them with --http-port"
            )
        jobs = [(p, i) for p, count in problems for i in range(count)]
        start = itertools.count()
        args = openai_sampling(sampling)

        def one(job: tuple[Problem, int]) -> PlayedEpisode:
            problem, i = job
            first = next(start)
            last: Exception | None = None
            for attempt in range(max(len(served), ATTEMPTS)):
                address, http = served[(first + attempt) % len(served)]
                episode_id = _episode_id(f"{prefix}.{problem.id}.{i}.{uuid.uuid4().hex[:8]}")
                try:
                    return self._one(problem, args, version, http, episode_id)
                except _ReplicaError as exc:
                    last = exc.cause
                    on_failure(address, exc.cause)
            raise EpisodeFailed(f"episode of {problem.id} failed on every replica; last: {last}")

        return list(self._pool.map(one, jobs))

    def _one(
        self, problem: Problem, sampling: dict[str, Any], version: int, http: str, episode_id: str
    ) -> PlayedEpisode:
        url = f"{self.base(http)}/episodes/{episode_id}"
        model = self.model_of(http)
        try:
            kind, value = self.players(problem, url, version, model, sampling)
        except CallFailed as exc:  # the environment's code: the episode scores 0 with what it recorded
            log.warning("episode %s scored 0: %s", episode_id, exc)
            return PlayedEpisode(problem, 0.0, self._end(url), failure=exc)
        if kind == "replica":
            self._end(url)
            raise _ReplicaError(ReplicaCallFailed(value))
        try:
            answer = self._http.delete(url)
            answer.raise_for_status()
        except Exception as exc:  # (httpx's errors; the episode is lost with the replica)
            raise _ReplicaError(exc) from exc
        return PlayedEpisode(problem, float(value), answer.json())

    def model_of(self, http: str) -> str:
        """The model name the replica at ``http`` serves (its /v1/models), asked once."""
        if http not in self._models:
            try:
                answer = self._http.get(f"{self.base(http)}/v1/models", timeout=30)
                answer.raise_for_status()
                self._models[http] = answer.json()["data"][0]["id"]
            except Exception as exc:  # (httpx's errors, or not an OpenAI answer)
                raise _ReplicaError(exc) from exc
        return self._models[http]

    def _end(self, url: str) -> dict[str, Any]:
        """End the episode on its replica: what it recorded (nothing, when the replica cannot say)."""
        try:  # (the replica forgets it when idle anyway)
            answer = self._http.delete(url)
            answer.raise_for_status()
            recorded: dict[str, Any] = answer.json()
            return recorded
        except Exception:
            return {"turns": [], "samples": []}


class ReplicaCallFailed(Exception):
    """A call of an episode to its replica failed (what the worker saw: the error's type and text)."""


class _ReplicaError(Exception):
    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _episode_id(text: str) -> str:
    """An episode id the replica accepts (rollout_service.episodes.EPISODE_ID)."""
    return re.sub(r"[^A-Za-z0-9._:-]", "-", text)[-128:]


class NamedServer(httpx.HTTPTransport):
    """TLS to an address whose certificate names a role, not the host (gRPC's target-name override)."""

    def __init__(self, name: str, verify: ssl.SSLContext) -> None:
        super().__init__(verify=verify)
        self.name = name

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.extensions = {**request.extensions, "sni_hostname": self.name}
        return super().handle_request(request)
