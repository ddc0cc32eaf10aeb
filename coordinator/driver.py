"""The GRPO step loop over Redis state. Step k moves through phases

    generate -> train -> publish -> commit   (then step k+1, generate)

each move a compare-and-set under the leader lease, so a coordinator that crashes anywhere resumes
where the state says: a stored batch is not regenerated, a trained step is replayed by the trainer (never
trained twice), a commit is written once. See coordinator/state.py for the keys. The work of the phases
lives beside it: batches (coordinator/batches.py) and publishing (coordinator/publishing.py).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from coordinator.batches import BatchMaker, StepBatch
from coordinator.clients import RolloutPool, TrainerClient, rpc_code
from coordinator.config import CoordinatorConfig
from coordinator.metrics import MetricsSink, committed
from coordinator.publishing import Publishing
from coordinator.state import LeaseLost, RunState, RunStore
from coordinator.tasks import Task
from fp8rl.serving import pid_alive
from fp8rl.v1 import trainer_pb2

log = logging.getLogger(__name__)
LEASE_TTL_S = 30.0
REDO_NON_FINITE = 1  # fresh batches tried for a step whose gradient was non-finite, before stopping


class TrainingRefused(RuntimeError):
    """The trainer keeps refusing a step (non-finite gradients): the run stops."""


def coordinator_is_dead(holder: str) -> bool:
    """A lease holder ("host:pid") on this host whose process is gone, or whose PID is ours (an earlier
    incarnation of this process, e.g. PID 1 of a restarted container)."""
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    return int(pid) == os.getpid() or not pid_alive(int(pid))


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
        self.trainer, self.sink = trainer, sink
        self.weights = Publishing(store, trainer, pool, sink)
        self.batches = BatchMaker(config, run_id, store, pool, task, self.weights.ensure_version)
        self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate-ahead")
        self._stop_renewing = threading.Event()
        self._lease_lost: LeaseLost | None = None  # the renewer's finding: another coordinator took over
        self._redone: dict[int, int] = {}  # step -> batches regenerated after a non-finite gradient

    # -- the run ------------------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        me = f"{socket.gethostname()}:{os.getpid()}"
        # A lease this very process holds is an earlier attempt's (the supervisor restarted the run's
        # processes after a crash): take it over like a dead coordinator's.
        self.store.acquire(me, LEASE_TTL_S, lambda holder: holder == me or coordinator_is_dead(holder))
        self.trainer.fence = self.store.fence  # every model-changing call carries it: stale ones are refused
        renewer = threading.Thread(target=self._renew_lease, name="lease", daemon=True)
        renewer.start()
        try:
            self.store.clear_stop()
            self._recover()
            self.sink.rebuild(self.store.metrics(), self.store.read().step + 1)
            self._base_validation()
            ahead: Future[StepBatch | None] | None = None
            while (state := self.store.read()).step < self.config.run.steps:
                if self.store.stop_requested():
                    self.store.event("stop", "stopped on request at a step boundary", state.step)
                    self.sink.say(f"stopped on request after step {state.step}/{self.config.run.steps}")
                    break
                ahead = self._guarded_step(state, ahead)
            return committed(self.store.metrics())
        finally:
            self._stop_renewing.set()
            self._ahead.shutdown(wait=True, cancel_futures=True)
            self.batches.close()
            self.store.release()

    def _renew_lease(self) -> None:
        while not self._stop_renewing.wait(LEASE_TTL_S / 3):
            try:
                self.store.renew(LEASE_TTL_S)
            except LeaseLost as exc:  # the step under way stops with it (_guarded_step)
                log.error("lease renewal failed: %s", exc)
                self._lease_lost = exc
                return
            except Exception as exc:  # the next transition fails with LeaseLost and stops the run
                log.error("lease renewal failed: %s", exc)

    def _guarded_step(
        self, state: RunState, ahead: Future[StepBatch | None] | None
    ) -> Future[StepBatch | None] | None:
        """:meth:`_step`, unless the lease is known lost: then the step stops with LeaseLost (exit 3),
        whatever failed first (a coordinator cut off from Redis and back finds the replicas and the trainer
        moved on under another coordinator: what fails there is a consequence)."""
        if self._lease_lost is not None:
            raise self._lease_lost
        try:
            return self._step(state, ahead)
        except Exception as exc:
            if self._lease_lost is not None and not isinstance(exc, LeaseLost):
                raise self._lease_lost from exc
            if rpc_code(exc) == "FAILED_PRECONDITION" and self.trainer.status().step < state.step:
                # The trainer came back behind the run (restarted from an older checkpoint, or from none):
                # rewind to it, as a restarted coordinator would, and go on from there.
                self._recover()
                self.sink.rebuild(self.store.metrics(), self.store.read().step + 1)
                return None
            raise

    def _recover(self) -> None:
        """Reconcile the run's state with the trainer's step (it may have restarted from a checkpoint)."""
        trainer_step = self.trainer.status().step
        state = self.store.read()
        k = state.step
        if trainer_step < k or (trainer_step == k and state.phase in ("publish", "commit")):
            detail = (
                f"trainer is at step {trainer_step} (restarted from its newest checkpoint, or from none): "
                f"run rewound from {state}"
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
        replicas = self.weights.ensure_version(0)
        start = time.perf_counter()
        record = {
            "step": 0,
            "weight_version": 0,
            "val_accuracy": self.batches.validate(0, replicas),
            "validate_s": time.perf_counter() - start,
        }
        if self.store.record_base(record):
            self.sink.write(record)

    # -- one step -----------------------------------------------------------------------------------
    def _step(
        self, state: RunState, ahead: Future[StepBatch | None] | None
    ) -> Future[StepBatch | None] | None:
        k, started = state.step, time.perf_counter()
        if state.phase == "generate":
            batch = self.batches.batch_for(k, ahead)
            self.store.transition(
                RunState(k, "generate"),
                RunState(k, "train"),
                f"batch of {len(batch.request.samples)} samples at version {batch.version}",
            )
            state = RunState(k, "train")
        else:
            found = self.batches.find(k)
            if found is None:
                raise RuntimeError(f"the batch of step {k} ({state.phase}) is missing from Redis")
            batch = found
        ahead = None
        if self.config.run.max_staleness >= 1 and k + 1 < self.config.run.steps:
            ahead = self._ahead.submit(self.batches.generate_ahead, k + 1)  # overlaps training of step k
        t = time.perf_counter()
        result = self.trainer.train(batch.request)  # replays the stored result if step k was trained
        if result.HasField("skipped"):
            self._refused(k, result.skipped)
            return ahead
        train_s = time.perf_counter() - t
        if state.phase == "train":
            self.store.transition(
                state, RunState(k, "publish"), f"trained to version {result.weight_version}"
            )
            state = RunState(k, "publish")
        publish = self.weights.publish(k + 1) if state.phase == "publish" else {}
        if state.phase == "publish":
            self.store.transition(state, RunState(k, "commit"))
        record = self._record(k, batch, result, train_s, publish)
        every = self.config.run.val_every
        if k + 1 == self.config.run.steps or (every and (k + 1) % every == 0):
            record["val_accuracy"] = self.batches.validate(k + 1, self.weights.ensure_version(k + 1))
        record["step_s"] = time.perf_counter() - started
        self.store.commit(k, record)
        for warning in self.sink.write(record):
            self.store.event("warning", warning, k + 1)
        return ahead

    def _refused(self, k: int, skipped: trainer_pb2.StepSkipped) -> None:
        """The trainer skipped step k (weights unchanged). Policy for a non-finite gradient: generate the
        step's batch afresh once; if that fails too, stop the run (resuming retries it again). A reason
        this coordinator does not know stops the run."""
        detail = skipped.detail
        if skipped.reason != trainer_pb2.StepSkipped.REASON_NON_FINITE_GRADIENT:
            raise TrainingRefused(
                f"the trainer skipped step {k} for reason {skipped.reason}, unknown here ({detail}); "
                f"the run stopped at step {k}"
            )
        self.store.event("non-finite-gradient", detail, k)
        if self._redone.get(k, 0) >= REDO_NON_FINITE:
            raise TrainingRefused(
                f"step {k} failed twice with a non-finite gradient ({detail}); the run stopped at step {k}"
            )
        self._redone[k] = self._redone.get(k, 0) + 1
        self.store.redo_batch(k, f"non-finite gradient: generating the batch of step {k} afresh")
        self.sink.say(f"step {k}: non-finite gradient, the step is retried with a fresh batch")

    def _record(
        self,
        k: int,
        batch: StepBatch,
        result: trainer_pb2.TrainStepResponse,
        train_s: float,
        publish: dict[str, float],
    ) -> dict[str, Any]:
        info = batch.info
        return {
            "step": k + 1,
            "train_step": k,
            "weight_version": result.weight_version,
            "gen_weight_version": batch.version,
            "staleness": k - batch.version,
            "reward_mean": info["reward_mean"],
            # rollouts that user code cost, scored 0 (older stored batches counted timeouts only)
            "reward_failures": info.get("reward_failures", info.get("reward_timeouts", 0)),
            **trainer_figures(result.metrics),
            "generate_s": info["generate_s"],
            "score_s": info.get("score_s", 0.0),  # (a batch stored before this field: not timed)
            "rollout_tokens_per_s": info["rollout_tokens_per_s"],
            "rollout_tokens": info["rollout_tokens"],
            **{key: info[key] for key in ("episode_turns_mean", "episode_samples") if key in info},
            "train_s": train_s,
            **publish,
            "replayed": result.replayed,
        }


# The step record takes every figure of the trainer's TrainMetrics (protos/fp8rl/v1/trainer.proto) by its
# field name, but these: the record's own names for two, and three it has from the coordinator's side.
RECORDED_AS = {"tokens_per_s": "train_tokens_per_s", "num_tokens": "trained_tokens"}
NOT_RECORDED = {"num_samples", "train_s", "reward_mean"}  # (the batch's size, the call's time, the batch's)


def trainer_figures(metrics: trainer_pb2.TrainMetrics) -> dict[str, Any]:
    """The step record's figures from the trainer: each field of ``metrics`` (a histogram as its list of
    counts; an optional field, such as an MoE model's routing mismatch, only when set)."""
    figures: dict[str, Any] = {}
    for field in metrics.DESCRIPTOR.fields:
        if field.name in NOT_RECORDED or (field.has_presence and not metrics.HasField(field.name)):
            continue
        value = getattr(metrics, field.name)
        figures[RECORDED_AS.get(field.name, field.name)] = list(value) if field.is_repeated else value
    return figures
