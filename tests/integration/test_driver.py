"""The step loop's branches, fast: the real Driver, BatchMaker and Publishing over a real redis-server,
with in-process stand-ins for the trainer and rollout *clients* (the remote services, not the code under
test). Crashes are injected into the stand-ins; a second Driver then resumes the run from Redis."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import redis

from coordinator.clients import ReplicaFailed
from coordinator.config import CoordinatorConfig, TaskConfig
from coordinator.driver import Driver, TrainingRefused
from coordinator.metrics import MetricsSink
from coordinator.state import RunState, RunStore
from coordinator.tasks import ArithTask, CustomReward, Task
from fp8rl.config import config_hash
from fp8rl.v1 import common_pb2, rollout_pb2, trainer_pb2

run_ids = (f"run{i}" for i in itertools.count())


class Crash(RuntimeError):
    """A coordinator dying mid-step (what kill -9 would do, minus the process)."""


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakePool:
    """Stands in for RolloutPool: replicas are names holding a version. Generation checks the driver's
    invariant that every replica it is given holds the requested version."""

    def __init__(self, *addresses: str) -> None:
        self.versions = dict.fromkeys(addresses, 0)
        self.down: set[str] = set()  # unreachable: left out of held_versions
        self.failing: set[str] = set()  # reachable, but Generate fails (its prompts move on)
        self.generated: list[tuple[int, int]] = []  # (version, samples) per Generate call
        self.crash_generating = False
        self.sampling: list[common_pb2.SamplingParams] = []  # of each Generate call
        self.proofs: dict[str, str] = {}  # the fake trainer checks none
        self.wait_s = 0.0  # how long a step waits for a replica it can use (RolloutPool's)

    def held_versions(self) -> dict[str, int]:
        held = {a: v for a, v in self.versions.items() if a not in self.down}
        if not held:
            raise ReplicaFailed("no rollout replica is reachable")
        return held

    def generate(self, prompts, n, sampling, version, replicas, on_failure, routed_experts=False):  # type: ignore[no-untyped-def]
        assert not routed_experts  # (the tiny model is dense: nothing is routed)
        if self.crash_generating:
            raise Crash("while generating")
        assert all(self.versions[a] == version for a in replicas), (version, replicas, self.versions)
        for address in replicas:
            if address in self.failing:
                on_failure(address, FakeRpcError(grpc.StatusCode.INTERNAL, "engine died"))
        if not set(replicas) - self.failing:
            raise ReplicaFailed("every replica failed")
        self.generated.append((version, len(prompts) * n))
        self.sampling.append(sampling)
        return [
            rollout_pb2.Completion(
                prompt_id=p.id,
                prompt_token_ids=[1, 2],
                token_ids=[3, 4],
                logprobs=[-0.1, -0.2],
                text=str(i % 2),
            )
            for p in prompts
            for i in range(n)
        ]

    def close(self) -> None:
        pass


class FakeTrainer:
    """Stands in for TrainerClient: a step counter that trains each step once, replays the stored result
    of a trained step, and publishes by setting the replicas' versions (a delta to a replica one version
    behind, a keyframe otherwise)."""

    def __init__(self, pool: FakePool) -> None:
        self.pool, self.step = pool, 0
        self.trained: list[int] = []
        self.results: dict[int, trainer_pb2.TrainStepResponse] = {}
        self.crash_after_training: int | None = None  # crash the coordinator once this step is applied
        self.crash_publishing: int | None = None
        self.refuse: set[str] = set()  # replicas whose update fails
        self.non_finite: dict[int, int] = {}  # step -> how many more times its gradient is non-finite
        self.skip_detail = "step {k}: non-finite gradient: the gradient norm of mini-batch 0 is inf"
        self.skip_reason = trainer_pb2.StepSkipped.REASON_NON_FINITE_GRADIENT
        self.refusal: grpc.RpcError | None = None  # raised by the next TrainStep
        self.on_train: Callable[[int], None] = lambda step: None  # runs as a step starts training
        self.on_publish: Callable[[int], None] = lambda version: None  # runs as a publish call starts

    def status(self) -> trainer_pb2.TrainerStatus:
        return trainer_pb2.TrainerStatus(step=self.step, weight_version=self.step)

    def train(self, request: trainer_pb2.TrainStepRequest) -> trainer_pb2.TrainStepResponse:
        k = request.step
        if k < self.step:
            replay = trainer_pb2.TrainStepResponse()
            replay.CopyFrom(self.results[k])
            replay.replayed = True
            return replay
        self.on_train(k)
        if k > self.step:  # as the trainer answers a step it has not reached (trainer_service.service)
            raise FakeRpcError(
                grpc.StatusCode.FAILED_PRECONDITION, f"expected step {self.step}, got step {k}"
            )
        assert k == self.step, f"asked to train step {k} at step {self.step}"
        assert len(request.samples) > 0
        if self.refusal is not None:
            refusal, self.refusal = self.refusal, None
            raise refusal
        if self.non_finite.get(k, 0) > 0:  # skipped, as the trainer answers it: weights unchanged
            self.non_finite[k] -= 1
            skipped = trainer_pb2.StepSkipped(reason=self.skip_reason, detail=self.skip_detail.format(k=k))
            return trainer_pb2.TrainStepResponse(step=k, weight_version=k, skipped=skipped)
        self.step += 1
        self.trained.append(k)
        metrics = trainer_pb2.TrainMetrics(token_mult_prob_error=1.0, loss=0.1 * k)
        self.results[k] = trainer_pb2.TrainStepResponse(step=k, weight_version=k + 1, metrics=metrics)
        if self.crash_after_training == k:
            self.crash_after_training = None
            raise Crash(f"after training step {k}")
        return self.results[k]

    def publish(
        self, version: int, held: dict[str, int], proofs: dict[str, str] | None = None
    ) -> trainer_pb2.PublishWeightsResponse:
        assert version == self.step, f"publishing version {version} from weights at {self.step}"
        self.on_publish(version)
        if self.crash_publishing == version:
            self.crash_publishing = None
            raise Crash(f"while publishing version {version}")
        results = []
        for address, had in held.items():
            if address in self.refuse:
                results.append(trainer_pb2.PublishResult(address=address, ok=False, error="refused"))
                continue
            self.pool.versions[address] = version
            encoding = "delta" if had == version - 1 else "keyframe"
            results.append(
                trainer_pb2.PublishResult(address=address, ok=True, encoding=encoding, wire_bytes=10)
            )
        return trainer_pb2.PublishWeightsResponse(version=version, results=results)


class Run:
    """One run id on the shared redis-server, driven by fresh Drivers (as restarted coordinators)."""

    def __init__(self, redis_client: redis.Redis, run_dir: Path, *replicas: str, **config: object) -> None:
        self.id, self.run_dir = next(run_ids), run_dir
        self.store = RunStore(redis_client, self.id)
        self.pool = FakePool(*(replicas or ("r1",)))
        self.trainer = FakeTrainer(self.pool)
        defaults = {"steps": 3, "prompts_per_step": 2, "group_size": 2, "val_every": 0, "val_size": 4}
        self.config = CoordinatorConfig(**{**defaults, **config, "progress": "plain"})  # type: ignore[arg-type]
        self.store.init_config(self.config.identity(), config_hash(self.config))

    def drive(self, task: Task | None = None, **changes: object) -> list[dict]:
        config = CoordinatorConfig.model_validate(self.config.model_dump() | changes)
        sink = MetricsSink(self.run_dir, config.run.steps, "plain")
        task = task or ArithTask(config.run.seed, config.task.val_size)
        return Driver(config, self.id, self.store, self.trainer, self.pool, task, sink).run()  # type: ignore[arg-type]

    def put_batch(self, step: int, version: int, reward: float) -> None:
        """Store a batch for ``step`` generated at ``version``, as an earlier coordinator would have."""
        request = trainer_pb2.TrainStepRequest(
            run_id=self.id, step=step, samples=[trainer_pb2.Sample(reward=reward)]
        )
        info = {"reward_mean": reward, "generate_s": 0.0, "rollout_tokens": 0, "rollout_tokens_per_s": 0.0}
        self.store.acquire("test:0", 30)
        self.store.put_batch(step, request.SerializeToString(), version, info)
        self.store.release()

    def steps(self) -> list[int]:
        return [int(r["step"]) for r in self.store.metrics()]

    def events(self, kind: str) -> list[str]:
        return [e["detail"] for e in self.store.events() if e["kind"] == kind]


def test_a_reward_that_crashes_scores_0_is_counted_and_the_run_goes_on(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A --reward whose worker process dies on the completions "1" (half of FakePool's): those score 0,
    each step counts and records them, and the run trains every step."""
    run = Run(redis_client, tmp_path, steps=2)
    task = CustomReward(ArithTask(seed=0), "tests.envs.faulty:crash_on_one", TaskConfig())
    try:
        records = run.drive(task=task)
    finally:
        task.close()
    assert run.trainer.trained == [0, 1]
    assert [r["reward_failures"] for r in records[1:]] == [2, 2]  # of 2 prompts x 2 samples
    assert [r["reward_mean"] for r in records[1:]] == [0.5, 0.5]
    assert run.events("reward-failed") == [f"2 of 4 rewards of step {k} scored 0: 2 crashed" for k in (0, 1)]


def test_a_run_trains_each_step_once_publishes_deltas_and_validates(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    run = Run(redis_client, tmp_path, "r1", "r2", val_every=2)
    records = run.drive()
    assert run.trainer.trained == [0, 1, 2] and run.steps() == [0, 1, 2, 3]
    assert run.store.read() == RunState(3, "generate")
    assert run.pool.versions == {"r1": 3, "r2": 3} and run.store.replica_versions() == {"r1": 3, "r2": 3}
    assert [r["gen_weight_version"] for r in records[1:]] == [0, 1, 2]  # on-policy
    assert [r["sync_keyframes"] for r in records[1:]] == [0, 0, 0]
    assert [("val_accuracy" in r) for r in records] == [True, False, True, True]  # base, every 2, last
    assert run.pool.generated[0] == (0, 4)  # base validation: 4 greedy prompts at version 0
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 4


@pytest.mark.parametrize("crash", ["generating", "after-training", "publishing"])
def test_a_crash_anywhere_resumes_without_training_a_step_twice(
    redis_client: redis.Redis, tmp_path: Path, crash: str
) -> None:
    run = Run(redis_client, tmp_path)
    if crash == "generating":
        run.drive(steps=1)
        run.pool.crash_generating = True
    elif crash == "after-training":
        run.trainer.crash_after_training = 1
    else:
        run.trainer.crash_publishing = 2
    with pytest.raises(Crash):
        run.drive()
    run.pool.crash_generating = False
    records = run.drive()
    assert run.trainer.trained == [0, 1, 2] and run.steps() == [0, 1, 2, 3]
    assert [r.get("replayed") for r in records[1:]] == [False, crash != "generating", False]
    assert run.store.read() == RunState(3, "generate") and run.pool.versions == {"r1": 3}
    assert any("resuming" in e for e in run.events("recovery"))


def test_a_trainer_restarted_from_an_older_checkpoint_rewinds_the_run(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    run = Run(redis_client, tmp_path)
    run.drive(steps=3)
    run.trainer.step = 1  # restarted from its checkpoint of step 1: steps 1 and 2 are lost
    records = run.drive(steps=4)
    assert run.trainer.trained == [0, 1, 2, 1, 2, 3]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]  # the redone steps count once
    assert [r["step"] for r in run.store.metrics()] == [0, 1, 2, 3, 4]  # in Redis's stream too
    written = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in written] == [0, 1, 2, 3, 4]
    assert run.store.read() == RunState(4, "generate")
    assert any("trainer is at step 1" in e and "rewound" in e for e in run.events("recovery"))


def test_a_trainer_that_comes_back_empty_mid_run_rewinds_the_running_run(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    run = Run(redis_client, tmp_path)

    def restart_without_checkpoints(k: int) -> None:
        if k == 2 and run.trainer.trained == [0, 1]:
            run.trainer.step, run.trainer.results = 0, {}  # killed and back at step 0, within the call

    run.trainer.on_train = restart_without_checkpoints
    records = run.drive(steps=3)  # no exception: the same driver rewinds and finishes
    assert run.trainer.trained == [0, 1, 0, 1, 2]
    assert [r["step"] for r in records] == [0, 1, 2, 3] == [r["step"] for r in run.store.metrics()]
    written = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in written] == [0, 1, 2, 3]
    assert any("trainer is at step 0" in e and "rewound" in e for e in run.events("recovery"))


def test_a_trainer_ahead_of_the_run_is_refused(redis_client: redis.Redis, tmp_path: Path) -> None:
    run = Run(redis_client, tmp_path)
    run.trainer.step = 5
    with pytest.raises(RuntimeError, match="another run's trainer"):
        run.drive()
    assert run.trainer.trained == [] and run.store.read() == RunState(0, "generate")


def test_a_stored_batch_staler_than_allowed_is_regenerated(redis_client: redis.Redis, tmp_path: Path) -> None:
    run = Run(redis_client, tmp_path)
    run.drive(steps=1)
    run.put_batch(1, version=0, reward=9.0)
    records = run.drive(steps=2)
    assert run.events("stale-batch") == ["batch of step 1 from version 0 is staler than 0"]
    assert records[-1]["gen_weight_version"] == 1 and records[-1]["reward_mean"] != 9.0


def test_a_stored_batch_within_the_staleness_limit_is_used(redis_client: redis.Redis, tmp_path: Path) -> None:
    run = Run(redis_client, tmp_path, max_staleness=1)
    run.drive(steps=1)
    run.put_batch(1, version=0, reward=9.0)
    records = run.drive(steps=2)
    assert run.events("stale-batch") == []
    assert records[-1]["reward_mean"] == 9.0 and records[-1]["staleness"] == 1


def test_generation_ahead_overlaps_training_one_version_behind(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    run = Run(redis_client, tmp_path, max_staleness=1, steps=4)

    def wait_for_the_next_batch(k: int) -> None:  # training of step k outlasts generating step k+1
        deadline = time.monotonic() + 10
        while k + 1 < 4 and len(run.pool.generated) < k + 3 and time.monotonic() < deadline:
            time.sleep(0.01)

    run.trainer.on_train = wait_for_the_next_batch
    records = run.drive()
    assert run.trainer.trained == [0, 1, 2, 3]
    assert [r["staleness"] for r in records[1:]] == [0, 1, 1, 1]


def test_a_restarted_replica_is_healed_with_a_keyframe(redis_client: redis.Redis, tmp_path: Path) -> None:
    run = Run(redis_client, tmp_path, "r1", "r2")
    run.drive(steps=2)
    run.pool.versions["r2"] = 0  # restarted with the base weights
    records = run.drive(steps=3)
    assert run.events("heal") == ["r2 reported version 0, the run had it at 2: sent keyframe"]
    assert run.pool.versions == {"r1": 3, "r2": 3} and records[-1]["sync_keyframes"] == 0


def test_unreachable_refusing_and_failing_replicas_are_worked_around(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    run = Run(redis_client, tmp_path, "r1", "r2", "r3")
    run.pool.down.add("r1")  # unreachable: dropped from the step
    run.trainer.refuse.add("r2")  # takes no update: never asked to generate at a version it lacks
    run.pool.failing.add("r3")  # fails Generate: its prompts move on (here: nowhere left)
    with pytest.raises(ReplicaFailed, match="every replica failed"):
        run.drive(steps=1)
    assert any(e.startswith("r3: INTERNAL engine died") for e in run.events("replica-failed"))
    run.pool.failing.clear()
    run.drive(steps=2)
    assert run.trainer.trained == [0, 1]
    assert run.pool.versions == {"r1": 0, "r2": 0, "r3": 2}
    assert run.events("publish-failed")[0] == "r2: refused"


def test_no_replica_at_the_version_stops_the_step(redis_client: redis.Redis, tmp_path: Path) -> None:
    run = Run(redis_client, tmp_path)
    run.drive(steps=1)
    run.trainer.refuse.add("r1")
    run.pool.versions["r1"] = 0
    with pytest.raises(ReplicaFailed, match="no replica could be brought to version 1, after trying"):
        run.drive(steps=2)
    assert run.trainer.trained == [0] and run.store.read() == RunState(1, "generate")


def test_a_step_waits_for_a_replica_to_come_back(redis_client: redis.Redis, tmp_path: Path) -> None:
    run = Run(redis_client, tmp_path)
    run.pool.wait_s = 30.0
    run.drive(steps=1)
    run.trainer.refuse.add("r1")  # r1's update fails (a partition), the first two tries
    run.pool.versions["r1"] = 0  # (restarted: it needs version 1 again)
    tries: list[int] = []

    def heal_after_two(k: int) -> None:
        tries.append(k)
        if len(tries) == 2:
            run.trainer.refuse.clear()

    run.trainer.on_publish = heal_after_two
    started = time.monotonic()
    run.drive(steps=2)
    assert run.trainer.trained == [0, 1] and time.monotonic() - started < 10
    assert run.events("replicas-unavailable") == [
        "no replica could be brought to version 1: trying for up to 30 s"
    ]


def test_a_stop_request_ends_the_run_at_a_step_boundary(redis_client: redis.Redis, tmp_path: Path) -> None:
    run = Run(redis_client, tmp_path)
    run.trainer.on_train = lambda k: run.store.request_stop() if k == 1 else None
    records = run.drive()
    assert run.trainer.trained == [0, 1] and [r["step"] for r in records] == [0, 1, 2]
    run.trainer.on_train = lambda k: None
    assert run.events("stop") == ["stopped on request at a step boundary"]
    run.drive()  # a new start clears the request
    assert run.trainer.trained == [0, 1, 2]


def test_the_base_validation_is_recorded_once(redis_client: redis.Redis, tmp_path: Path) -> None:
    run = Run(redis_client, tmp_path)
    run.pool.crash_generating = True
    with pytest.raises(Crash):
        run.drive()
    run.pool.crash_generating = False
    run.drive(steps=1)
    run.drive(steps=2)
    assert run.steps() == [0, 1, 2]


def test_validation_is_greedy_and_training_samples_as_configured(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    run = Run(redis_client, tmp_path, top_k=5, top_p=0.5, temperature=0.75)
    run.drive(steps=1)
    greedy = common_pb2.SamplingParams(temperature=0.0, max_tokens=8, stop=["\n"])
    sampled = common_pb2.SamplingParams(temperature=0.75, top_p=0.5, top_k=5, max_tokens=8, stop=["\n"])
    assert run.pool.sampling == [greedy, sampled, greedy]  # base validation, step 0, final validation


def test_a_non_finite_gradient_retries_the_step_once_with_a_fresh_batch(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    run = Run(redis_client, tmp_path)
    run.trainer.non_finite = {1: 1}
    records = run.drive()
    assert run.trainer.trained == [0, 1, 2] and [r["step"] for r in records] == [0, 1, 2, 3]
    assert run.events("non-finite-gradient") == [
        "step 1: non-finite gradient: the gradient norm of mini-batch 0 is inf"
    ]
    assert run.events("redo-batch") == ["non-finite gradient: generating the batch of step 1 afresh"]
    assert [v for v, _ in run.pool.generated] == [
        0,
        0,
        1,
        1,
        2,
        3,
    ]  # base val, steps 0, 1 (twice), 2, final val


def test_a_step_that_stays_non_finite_stops_the_run_and_resumes_later(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    run = Run(redis_client, tmp_path)
    run.trainer.non_finite = {1: 2}
    with pytest.raises(TrainingRefused, match="step 1 failed twice with a non-finite gradient"):
        run.drive()
    assert run.trainer.trained == [0] and run.store.read() == RunState(1, "train")
    run.drive()  # fixed (here: the trainer no longer refuses): the run resumes at step 1
    assert run.trainer.trained == [0, 1, 2] and run.steps() == [0, 1, 2, 3]


def test_the_driver_reads_a_skipped_step_from_its_typed_outcome_not_its_message(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    run = Run(redis_client, tmp_path)
    run.trainer.non_finite = {1: 1}
    run.trainer.skip_detail = "step {k}: the update overflowed"  # reworded: the policy still applies
    run.drive()
    assert run.trainer.trained == [0, 1, 2] and run.events("non-finite-gradient") == [
        "step 1: the update overflowed"
    ]
    # An error that merely reads like one is an error: it propagates, and nothing is redone.
    run = Run(redis_client, tmp_path)
    run.trainer.refusal = FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "step 0: non-finite gradient")
    with pytest.raises(grpc.RpcError):
        run.drive()
    assert run.trainer.trained == [] and run.events("redo-batch") == []
    # A reason this driver does not know stops the run rather than retrying blindly.
    run = Run(redis_client, tmp_path)
    run.trainer.non_finite, run.trainer.skip_reason = {0: 1}, 7  # type: ignore[assignment]
    with pytest.raises(TrainingRefused, match="reason 7, unknown here"):
        run.drive()
    assert run.trainer.trained == [] and run.store.read() == RunState(0, "train")


def test_a_step_failing_after_the_lease_was_lost_reports_the_lost_lease() -> None:
    """Found by the network-fault tests: a coordinator cut off from Redis past its lease, back on the
    network, found the replicas moved on under its successor and ended with ReplicaFailed (exit 1); the
    renewer knew the lease was lost, and that is what the run ends with now (LeaseLost: exit 3)."""
    from coordinator.clients import ReplicaFailed
    from coordinator.driver import Driver
    from coordinator.state import LeaseLost, RunState

    driver = Driver.__new__(Driver)  # (only the step's guard is under test)
    driver._lease_lost = None

    def step(state: RunState, ahead: object) -> None:
        driver._lease_lost = LeaseLost("lost the lease on run r")  # the renewer found out meanwhile
        raise ReplicaFailed("no replica could be brought to version 2")

    driver._step = step  # type: ignore[method-assign,assignment]
    with pytest.raises(LeaseLost, match="lost the lease"):
        driver._guarded_step(RunState(2, "generate"), None)
    with pytest.raises(LeaseLost):  # and no further step starts
        driver._guarded_step(RunState(2, "generate"), None)
