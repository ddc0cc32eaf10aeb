"""Batches of a step: generate completions on the replicas, score them, store them in Redis so a
restarted coordinator never regenerates a step's batch, and reuse a stored or generated-ahead batch only
while it is fresh enough (``max_staleness``). Also greedy validation on held-out prompts."""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from coordinator.clients import RolloutPool, rpc_code
from coordinator.config import CoordinatorConfig
from coordinator.environments import EpisodeRunner, PlayedEpisode
from coordinator.problems import CallFailed, Problem
from coordinator.state import RunStore
from coordinator.tasks import EnvironmentTask, Task
from fp8rl.architectures import moe_layers, read_config
from fp8rl.models import TINY_ARITH
from fp8rl.v1 import common_pb2, rollout_pb2, trainer_pb2

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """A step's training request, as stored in Redis: what the trainer trains on and its figures."""

    request: trainer_pb2.TrainStepRequest
    version: int  # weight version the completions were generated with
    info: dict[str, Any]


@dataclass
class Rollouts:
    """What generating for some problems gave: the samples to train on, one reward per rollout (a
    completion, or an episode), and the figures that come with them."""

    samples: list[trainer_pb2.Sample]
    rewards: list[float]
    tokens: int  # sampled by the policy
    failures: list[str] = field(default_factory=list)  # user code that cost a rollout (scored 0): how
    score_s: float = 0.0  # of the time taken, spent scoring
    extra: dict[str, float] = field(default_factory=dict)  # the kind's own figures


@dataclass(frozen=True)
class RolloutAsk:
    """What to generate: n rollouts of each problem at a weight version, on these replicas."""

    problems: list[Problem]
    n: int
    sampling: common_pb2.SamplingParams
    version: int
    replicas: list[str]
    label: str  # names a step's episodes (run id, then this: s3, val4)
    training: bool  # (validation: False)


RolloutKind = Callable[[RolloutAsk], Rollouts]
"""Single-turn completions or a multi-turn environment's episodes (BatchMaker picks one)."""


class BatchMaker:
    def __init__(
        self,
        config: CoordinatorConfig,
        run_id: str,
        store: RunStore,
        pool: RolloutPool,
        task: Task,
        ensure_version: Callable[[int], list[str]],
    ) -> None:
        self.config, self.run_id, self.store, self.pool, self.task = config, run_id, store, pool, task
        self.ensure_version = ensure_version  # replicas holding a version, after publishing it to them
        c = config.sampling
        self.sampling = common_pb2.SamplingParams(
            temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, max_tokens=c.max_tokens, stop=c.stop
        )
        self.greedy = common_pb2.SamplingParams(temperature=0.0, max_tokens=c.max_tokens, stop=c.stop)
        self._rewards = ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward")
        # An MoE model's samples carry the experts the rollout routed them to: the trainer measures its
        # routers' disagreement with them (routing_mismatch) and, with routing_replay, routes as they did.
        self.routed_experts = bool(moe_layers(read_config(config.run.model or TINY_ARITH)))
        self._closing: list[Callable[[], None]] = [functools.partial(self._rewards.shutdown, wait=False)]
        self.rollouts: RolloutKind = self._completions
        if isinstance(task, EnvironmentTask):  # episodes on the replicas' HTTP faces instead
            limits = config.task
            runner = EpisodeRunner(
                task.spec, task.seed, pool.security, limits.episode_deadline_s, limits.user_code_memory_mb
            )
            self.rollouts = functools.partial(self._episodes, runner)
            self._closing.append(runner.close)

    def close(self) -> None:
        for close in self._closing:
            close()

    def batch_for(self, k: int, ahead: Future[StepBatch | None] | None) -> StepBatch:
        """The stored batch of step k if fresh enough, else the one generated ahead, else a new one."""
        limit = self.config.run.max_staleness
        stored = self.find(k)
        if stored is None and ahead is not None:
            stored = ahead.result()
        if stored is not None:
            if k - stored.version <= limit:
                return stored
            self.store.event(
                "stale-batch", f"batch of step {k} from version {stored.version} is staler than {limit}", k
            )
        batch = self.generate(k, k, self.ensure_version(k))
        self._store(k, batch)
        return batch

    def generate_ahead(self, step: int) -> StepBatch | None:
        """Generate step's batch with whatever the replicas hold now (no publishing: the trainer is busy)."""
        try:
            held = self.pool.held_versions()
            version = max(held.values())
            if step - version > self.config.run.max_staleness:
                return None
            batch = self.generate(step, version, [a for a, v in held.items() if v == version])
            self._store(step, batch)
            return batch
        except Exception as exc:  # the step will generate in line instead
            log.warning("generating ahead for step %d failed: %s", step, exc)
            return None

    def find(self, k: int) -> StepBatch | None:
        stored = self.store.get_batch(k)
        if stored is None:
            return None
        request = trainer_pb2.TrainStepRequest()
        request.ParseFromString(stored[0])
        return StepBatch(request, stored[1], stored[2])

    def _store(self, k: int, batch: StepBatch) -> None:
        self.store.put_batch(k, batch.request.SerializeToString(), batch.version, batch.info)

    def generate(self, step: int, version: int, replicas: list[str]) -> StepBatch:
        c = self.config.sampling
        problems = self.task.train_problems(step, c.prompts_per_step)
        start = time.perf_counter()
        got = self.rollouts(
            RolloutAsk(problems, c.group_size, self.sampling, version, replicas, f"s{step}", True)
        )
        generate_s = time.perf_counter() - start - got.score_s
        self._failures(got, f"of step {step}", step)
        request = trainer_pb2.TrainStepRequest(
            run_id=self.run_id, step=step, samples=got.samples, sampling=self.sampling
        )
        info = {
            "generate_s": generate_s,
            "score_s": got.score_s,
            "rollout_tokens": got.tokens,
            "rollout_tokens_per_s": got.tokens / max(generate_s, 1e-9),
            "reward_mean": sum(got.rewards) / len(got.rewards),
            "reward_failures": len(got.failures),
            **got.extra,
        }
        return StepBatch(request, version, info)

    def validate(self, version: int, replicas: list[str]) -> float:
        """Mean reward of greedy completions (or episodes) of the held-out prompts."""
        problems = self.task.val_problems()
        got = self.rollouts(RolloutAsk(problems, 1, self.greedy, version, replicas, f"val{version}", False))
        self._failures(got, f"of validation at version {version}")
        return sum(got.rewards) / len(got.rewards)

    def _failures(self, got: Rollouts, of: str, step: int | None = None) -> None:
        """One event for the rollouts that user code cost (scored 0): how many, and how they failed."""
        if got.failures:
            what = "rewards" if self.rollouts == self._completions else "episodes"
            kinds = ", ".join(f"{n} {reason}" for reason, n in sorted(Counter(got.failures).items()))
            text = f"{len(got.failures)} of {len(got.rewards)} {what} {of} scored 0: {kinds}"
            self.store.event(f"{what[:-1]}-failed", text, step)

    def _completions(self, ask: RolloutAsk) -> Rollouts:
        """Single-turn: n completions per problem over gRPC, each scored by the task's reward."""
        routed = ask.training and self.routed_experts
        completions = self._complete(ask.problems, ask.n, ask.sampling, ask.version, ask.replicas, routed)
        start = time.perf_counter()
        rewards, failures = self._rewards_of(ask.problems, completions)
        score_s = time.perf_counter() - start
        samples = [
            trainer_pb2.Sample(
                prompt_token_ids=c.prompt_token_ids,
                completion_token_ids=c.token_ids,
                gen_logprobs=c.logprobs,
                reward=r,
                group_id=c.prompt_id,
                routed_experts=c.routed_experts if c.HasField("routed_experts") else None,
            )
            for c, r in zip(completions, rewards, strict=True)
        ]
        return Rollouts(samples, rewards, sum(len(c.token_ids) for c in completions), failures, score_s)

    def _episodes(self, runner: EpisodeRunner, ask: RolloutAsk) -> Rollouts:
        """A multi-turn environment: n episodes per problem, each recorded sample of an episode (one,
        unless a turn rewrote the conversation) trained with the episode's reward."""
        episodes = self._play(runner, ask)
        samples = [
            trainer_pb2.Sample(
                prompt_token_ids=s["prompt_token_ids"],
                completion_token_ids=s["completion_token_ids"],
                gen_logprobs=s["logprobs"],
                loss_mask=s["loss_mask"],
                reward=e.reward,
                group_id=e.problem.id,
            )
            for e in episodes
            for s in e.recorded["samples"]
        ]
        extra = {
            "episode_turns_mean": sum(e.turns for e in episodes) / len(episodes),
            "episode_samples": len(samples),
        }
        tokens = sum(sum(s.loss_mask) for s in samples)
        failures = [e.failure.reason for e in episodes if e.failure is not None]
        return Rollouts(samples, [e.reward for e in episodes], tokens, failures, extra=extra)

    def _play(self, runner: EpisodeRunner, ask: RolloutAsk) -> list[PlayedEpisode]:
        if any(a not in self.pool.http for a in ask.replicas):
            self.pool.held_versions()  # (their HTTP faces' addresses come with their status)
        served = {a: self.pool.http.get(a, "") for a in ask.replicas}

        def failed(address: str, exc: Exception) -> None:
            self.store.event("replica-failed", f"{address}: episode failed: {type(exc).__name__}: {exc}")
            log.warning("replica %s failed an episode (%s); it is played again elsewhere", address, exc)

        jobs = [(p, ask.n) for p in ask.problems]
        return runner.play(jobs, ask.sampling, ask.version, served, f"{self.run_id}.{ask.label}", failed)

    def _rewards_of(
        self, problems: list[Problem], completions: list[rollout_pb2.Completion]
    ) -> tuple[list[float], list[str]]:
        """Each completion's reward, on the reward threads, and how each that user code failed did (those
        score 0)."""
        by_id = {p.id: p for p in problems}

        def score(c: rollout_pb2.Completion) -> float | CallFailed:
            try:
                return self.task.reward(by_id[c.prompt_id], c.text)
            except CallFailed as exc:
                log.warning("reward of %s scored 0: %s", c.prompt_id, exc)
                return exc

        scores = list(self._rewards.map(score, completions))
        failures = [r.reason for r in scores if isinstance(r, CallFailed)]
        return [0.0 if isinstance(r, CallFailed) else r for r in scores], failures

    def _complete(
        self,
        problems: list[Problem],
        n: int,
        sampling: common_pb2.SamplingParams,
        version: int,
        replicas: list[str],
        routed_experts: bool = False,
    ) -> list[rollout_pb2.Completion]:
        prompts = [wire_prompt(p) for p in problems]

        def failed(address: str, exc: grpc.RpcError) -> None:
            self.store.event("replica-failed", f"{address}: {rpc_code(exc)} {exc.details()}")
            log.warning("replica %s failed (%s); its prompts move to another replica", address, rpc_code(exc))

        return self.pool.generate(
            prompts, n, sampling, version, replicas, failed, routed_experts=routed_experts
        )


def wire_prompt(problem: Problem) -> rollout_pb2.Prompt:
    if problem.messages is None:
        return rollout_pb2.Prompt(id=problem.id, text=problem.prompt)
    turns = [rollout_pb2.ChatMessage(role=role, content=content) for role, content in problem.messages]
    return rollout_pb2.Prompt(id=problem.id, chat=rollout_pb2.ChatMessages(messages=turns))
