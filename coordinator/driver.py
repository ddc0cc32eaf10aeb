"""The GRPO step loop over Redis state. Step k moves through phases

    generate -> train -> publish -> commit   (then step k+1, generate)

each move a compare-and-set under the leader lease, so a coordinator that crashes anywhere resumes
where the state says: a stored batch is not regenerated, a trained step is replayed by the trainer (never
trained twice), a commit is written once. See coordinator/state.py for the keys.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from coordinator.clients import ReplicaFailed, RolloutPool, TrainerClient, rpc_code
from coordinator.config import CoordinatorConfig
from coordinator.metrics import MetricsSink
from coordinator.state import RunState, RunStore
from coordinator.tasks import Problem, Task
from fp8rl.v1 import common_pb2, rollout_pb2, trainer_pb2

log = logging.getLogger(__name__)
LEASE_TTL_S = 30.0


@dataclass
class Batch:
    request: trainer_pb2.TrainStepRequest
    version: int  # weight version the completions were generated with
    info: dict[str, Any]


def coordinator_is_dead(holder: str) -> bool:
    """A lease holder ("host:pid") on this host whose process is gone, or whose PID is ours (an earlier
    incarnation of this process, e.g. PID 1 of a restarted container)."""
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Driver:
    def __init__(
        self,
        config: CoordinatorConfig,
        run_id: str,
        store: RunStore,
        trainer: TrainerClient,
        pool: RolloutPool,
        task: Task,
        sink: MetricsSink,
    ) -> None:
        self.config, self.run_id, self.store = config, run_id, store
        self.trainer, self.pool, self.task, self.sink = trainer, pool, task, sink
        c = config
        self.sampling = common_pb2.SamplingParams(
            temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, max_tokens=c.max_tokens, stop=c.stop
        )
        self.greedy = common_pb2.SamplingParams(temperature=0.0, max_tokens=c.max_tokens, stop=c.stop)
        self._rewards = ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward")
        self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate-ahead")
        self._stop_renewing = threading.Event()

    # -- the run ------------------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        self.store.acquire(f"{socket.gethostname()}:{os.getpid()}", LEASE_TTL_S, coordinator_is_dead)
        renewer = threading.Thread(target=self._renew_lease, name="lease", daemon=True)
        renewer.start()
        try:
            self.store.clear_stop()
            self.sink.rebuild(self.store.metrics())
            self._recover()
            self._base_validation()
            ahead: Future[Batch | None] | None = None
            while (state := self.store.read()).step < self.config.steps:
                if self.store.stop_requested():
                    self.store.event("stop", "stopped on request at a step boundary", state.step)
                    self.sink.say(f"stopped on request after step {state.step}/{self.config.steps}")
                    break
                ahead = self._step(state, ahead)
            return self.store.metrics()
        finally:
            self._stop_renewing.set()
            self._ahead.shutdown(wait=True, cancel_futures=True)
            self._rewards.shutdown(wait=False)
            self.store.release()

    def _renew_lease(self) -> None:
        while not self._stop_renewing.wait(LEASE_TTL_S / 3):
            try:
                self.store.renew(LEASE_TTL_S)
            except Exception as exc:  # the next transition fails with LeaseLost and stops the run
                log.error("lease renewal failed: %s", exc)

    def _recover(self) -> None:
        """Reconcile the run's state with the trainer's step (it may have restarted from a checkpoint)."""
        trainer_step = self.trainer.status().step
        state = self.store.read()
        k = state.step
        if trainer_step < k or (trainer_step == k and state.phase in ("publish", "commit")):
            detail = (
                f"trainer is at step {trainer_step} (restarted from a checkpoint): run rewound from {state}"
            )
            self.store.rewind(trainer_step, detail)
            self.sink.say(f"recovery: {detail}")
        elif trainer_step > k + 1 or (trainer_step == k + 1 and state.phase == "generate"):
            raise RuntimeError(
                f"the trainer is at step {trainer_step}, ahead of run {self.run_id} at {state}: "
                "is it another run's trainer?"
            )
        elif state.step or state.phase != "generate":
            self.store.event("recovery", f"resuming at {state}", k)
            self.sink.say(f"resuming run {self.run_id} at step {k} ({state.phase})")

    def _base_validation(self) -> None:
        if self.store.base_recorded() or self.store.read().step != 0 or self.trainer.status().step != 0:
            return
        replicas = self._ensure_version(0)
        start = time.perf_counter()
        record = {
            "step": 0,
            "weight_version": 0,
            "val_accuracy": self._validate(0, replicas),
            "validate_s": time.perf_counter() - start,
        }
        if self.store.record_base(record):
            self.sink.write(record)

    # -- one step -----------------------------------------------------------------------------------
    def _step(self, state: RunState, ahead: Future[Batch | None] | None) -> Future[Batch | None] | None:
        k, started = state.step, time.perf_counter()
        if state.phase == "generate":
            batch = self._batch_for(k, ahead)
            self.store.transition(
                RunState(k, "generate"),
                RunState(k, "train"),
                f"batch of {len(batch.request.samples)} samples at version {batch.version}",
            )
            state = RunState(k, "train")
        else:
            found = self._find_batch(k)
            if found is None:
                raise RuntimeError(f"the batch of step {k} ({state.phase}) is missing from Redis")
            batch = found
        ahead = None
        if self.config.max_staleness >= 1 and k + 1 < self.config.steps:
            ahead = self._ahead.submit(self._generate_ahead, k + 1)  # overlaps training of step k
        t = time.perf_counter()
        result = self.trainer.train(batch.request)  # replays the stored result if step k was already trained
        train_s = time.perf_counter() - t
        if state.phase == "train":
            self.store.transition(
                state, RunState(k, "publish"), f"trained to version {result.weight_version}"
            )
            state = RunState(k, "publish")
        publish = self._publish(k + 1) if state.phase == "publish" else {}
        if state.phase == "publish":
            self.store.transition(state, RunState(k, "commit"))
        record = self._record(k, batch, result, train_s, publish)
        every = self.config.val_every
        if k + 1 == self.config.steps or (every and (k + 1) % every == 0):
            record["val_accuracy"] = self._validate(k + 1, self._ensure_version(k + 1))
        record["step_s"] = time.perf_counter() - started
        self.store.commit(k, record)
        for warning in self.sink.write(record):
            self.store.event("warning", warning, k + 1)
        return ahead

    def _record(
        self,
        k: int,
        batch: Batch,
        result: trainer_pb2.TrainStepResponse,
        train_s: float,
        publish: dict[str, float],
    ) -> dict[str, Any]:
        m = result.metrics
        return {
            "step": k + 1,
            "train_step": k,
            "weight_version": result.weight_version,
            "gen_weight_version": batch.version,
            "staleness": k - batch.version,
            "reward_mean": batch.info["reward_mean"],
            "token_mult_prob_error": m.token_mult_prob_error,
            "gen_kl_error": m.gen_kl_error,
            "is_weight_mean": m.is_weight_mean,
            "is_weight_min": m.is_weight_min,
            "is_weight_max": m.is_weight_max,
            "is_clipped_fraction": m.is_clipped_fraction,
            "max_seq_mult_prob_error": m.max_seq_mult_prob_error,
            "out_of_support_fraction": m.out_of_support_fraction,
            "loss": m.loss,
            "grad_norm": m.grad_norm,
            "learning_rate": m.learning_rate,
            "ppo_clipped_fraction": m.ppo_clipped_fraction,
            "train_tokens_per_s": m.tokens_per_s,
            "generate_s": batch.info["generate_s"],
            "rollout_tokens_per_s": batch.info["rollout_tokens_per_s"],
            "rollout_tokens": batch.info["rollout_tokens"],
            "train_s": train_s,
            **publish,
            "replayed": result.replayed,
        }

    # -- batches --------------------------------------------------------------------------------------
    def _batch_for(self, k: int, ahead: Future[Batch | None] | None) -> Batch:
        """The stored batch of step k if fresh enough, else the one generated ahead, else a new one."""
        limit = self.config.max_staleness
        stored = self._find_batch(k)
        if stored is None and ahead is not None:
            stored = ahead.result()
        if stored is not None:
            if k - stored.version <= limit:
                return stored
            self.store.event(
                "stale-batch", f"batch of step {k} from version {stored.version} is staler than {limit}", k
            )
        batch = self._generate(k, k, self._ensure_version(k))
        self._store_batch(k, batch)
        return batch

    def _generate_ahead(self, step: int) -> Batch | None:
        """Generate step's batch with whatever the replicas hold now (no publishing: the trainer is busy)."""
        try:
            held = self.pool.held_versions()
            version = max(held.values())
            if step - version > self.config.max_staleness:
                return None
            batch = self._generate(step, version, [a for a, v in held.items() if v == version])
            self._store_batch(step, batch)
            return batch
        except Exception as exc:  # the step will generate in line instead
            log.warning("generating ahead for step %d failed: %s", step, exc)
            return None

    def _find_batch(self, k: int) -> Batch | None:
        stored = self.store.get_batch(k)
        if stored is None:
            return None
        request = trainer_pb2.TrainStepRequest()
        request.ParseFromString(stored[0])
        return Batch(request, stored[1], stored[2])

    def _store_batch(self, k: int, batch: Batch) -> None:
        self.store.put_batch(k, batch.request.SerializeToString(), batch.version, batch.info)

    def _generate(self, step: int, version: int, replicas: list[str]) -> Batch:
        problems = self.task.train_problems(step, self.config.prompts_per_step)
        start = time.perf_counter()
        completions = self._complete(problems, self.config.group_size, self.sampling, version, replicas)
        generate_s = time.perf_counter() - start
        by_id = {p.id: p for p in problems}
        rewards = list(self._rewards.map(lambda c: self.task.reward(by_id[c.prompt_id], c.text), completions))
        samples = [
            trainer_pb2.Sample(
                prompt_token_ids=c.prompt_token_ids,
                completion_token_ids=c.token_ids,
                gen_logprobs=c.logprobs,
                reward=r,
                group_id=c.prompt_id,
            )
            for c, r in zip(completions, rewards, strict=True)
        ]
        tokens = sum(len(c.token_ids) for c in completions)
        request = trainer_pb2.TrainStepRequest(
            run_id=self.run_id, step=step, samples=samples, sampling=self.sampling
        )
        info = {
            "generate_s": generate_s,
            "rollout_tokens": tokens,
            "rollout_tokens_per_s": tokens / generate_s,
            "reward_mean": sum(rewards) / len(rewards),
        }
        return Batch(request, version, info)

    def _complete(
        self,
        problems: list[Problem],
        n: int,
        sampling: common_pb2.SamplingParams,
        version: int,
        replicas: list[str],
    ) -> list[rollout_pb2.Completion]:
        prompts = [wire_prompt(p) for p in problems]

        def failed(address: str, exc: grpc.RpcError) -> None:
            self.store.event("replica-failed", f"{address}: {rpc_code(exc)} {exc.details()}")
            log.warning("replica %s failed (%s); its prompts move to another replica", address, rpc_code(exc))

        return self.pool.generate(prompts, n, sampling, version, replicas, failed)

    def _validate(self, version: int, replicas: list[str]) -> float:
        problems = self.task.val_problems()
        completions = self._complete(problems, 1, self.greedy, version, replicas)
        by_id = {p.id: p for p in problems}
        rewards = list(self._rewards.map(lambda c: self.task.reward(by_id[c.prompt_id], c.text), completions))
        return sum(rewards) / len(rewards)

    # -- weights --------------------------------------------------------------------------------------
    def _ensure_version(self, version: int) -> list[str]:
        """Replicas holding ``version`` after publishing it to those that do not (fresh replicas get a
        keyframe). Raises if none can be brought there."""
        held = self.pool.held_versions()
        stale = {a: v for a, v in held.items() if v != version}
        if stale:
            self._deliver(version, stale)
        ready = [a for a, v in self.pool.held_versions().items() if v == version]
        if not ready:
            raise ReplicaFailed(f"no replica could be brought to version {version}")
        return ready

    def _publish(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        results = self._deliver(version, self.pool.held_versions())
        ok = [r for r in results if r.ok]
        return {
            "publish_s": time.perf_counter() - start,
            "sync_bytes": sum(r.wire_bytes for r in ok) / max(len(ok), 1),
            "sync_density": sum(r.density for r in ok) / max(len(ok), 1),
            "sync_keyframes": sum(r.encoding == "keyframe" for r in ok),
        }

    def _deliver(self, version: int, held: dict[str, int]) -> list[trainer_pb2.PublishResult]:
        recorded = self.store.replica_versions()
        reply = self.trainer.publish(version, held)
        for r in reply.results:
            if not r.ok:
                self.store.event("publish-failed", f"{r.address}: {r.error}", version)
                log.warning("publishing version %d to %s failed: %s", version, r.address, r.error)
                continue
            self.store.set_replica_version(r.address, version)
            was = recorded.get(r.address)
            if was is not None and was != held.get(r.address):  # restarted, or diverged some other way
                reported = held.get(r.address)
                detail = (
                    f"{r.address} reported version {reported}, the run had it at {was}: sent {r.encoding}"
                )
                self.store.event("heal", detail, version)
                self.sink.say(f"recovery: {detail}")
        return list(reply.results)


def wire_prompt(problem: Problem) -> rollout_pb2.Prompt:
    if problem.messages is None:
        return rollout_pb2.Prompt(id=problem.id, text=problem.prompt)
    turns = [rollout_pb2.ChatMessage(role=role, content=content) for role, content in problem.messages]
    return rollout_pb2.Prompt(id=problem.id, messages=rollout_pb2.ChatMessages(messages=turns))
