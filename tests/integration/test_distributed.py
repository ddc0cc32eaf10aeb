"""The trainer across ranks (CPU, gloo, the tiny model): two ranks train as one does, and the sharded
service under torchrun trains, scores, publishes and checkpoints through rank 0's gRPC face; a sharded
checkpoint resumes on another number of ranks."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from fp8rl.codec.schema import build_weight_set
from fp8rl.codec.stream import decode_parts, receive_parts
from fp8rl.codec.weight_set import WeightSet
from fp8rl.recipes import get_recipe
from fp8rl.sampling import SamplingSettings, sampling_settings
from fp8rl.v1 import common_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc, weights_pb2
from tests.families import FAMILIES, write_checkpoint
from tests.integration.test_trainer import samples
from tests.support import (
    assert_pickle_free,
    bound_address,
    child_process,
    free_port,
    health_address,
    serve_rollout,
    trainer_config,
    unpickling_forbidden,
    wait_for_line,
)
from trainer_service import checkpoint
from trainer_service.config import TrainerConfig
from trainer_service.learner import Learner, SampleData
from trainer_service.service import TrainerService

ROOT = Path(__file__).resolve().parents[2]
TIED = next(f for f in FAMILIES if f.name == "qwen3-tied")
LR = 1e-3


# 7 samples, micro-batches of 3: rank 0 gets two micro-batches, rank 1 one and a stand-in.
STEP_MESSAGES = samples(1, count=7)
STEP_SAMPLES = [
    SampleData(
        list(m.prompt_token_ids), list(m.completion_token_ids), list(m.gen_logprobs), m.reward, m.group_id
    )
    for m in STEP_MESSAGES
]


def learner_config(model: Path, recipe: str) -> TrainerConfig:
    # Adam's first step moves each weight by about lr * sign(g): eps well above float rounding keeps
    # gradients that are zero up to rounding from flipping a weight by 2 lr between the two runs.
    return trainer_config(
        model,
        recipe,
        micro_batch_size=3,
        optimizer={"lr": LR, "eps": 1e-3},
    )


def sampling() -> SamplingSettings:
    return sampling_settings(common_pb2.SamplingParams())


def torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def test_a_world_of_one_runs_its_collectives_without_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from trainer_service.distributed import ONE_PROCESS

    def collective(*args: object, **kwargs: object) -> None:
        raise AssertionError("a world of one called a collective")

    # (Whether or not this process has a group: an in-process vLLM engine of the suite sets one up.)
    for name in ("all_reduce", "all_gather", "broadcast", "barrier", "get_rank", "get_world_size"):
        monkeypatch.setattr(dist, name, collective)
    assert ONE_PROCESS.is_root and not ONE_PROCESS.sharded
    rows = torch.randn(5, 3)
    assert ONE_PROCESS.all_sum(2.5) == 2.5 and ONE_PROCESS.all_max(rows) is rows
    assert ONE_PROCESS.gather_rows(rows, [torch.arange(5)]) is rows
    assert ONE_PROCESS.from_root("step-00000001") == "step-00000001"
    ONE_PROCESS.announce("train", b"request")  # nobody to tell
    ONE_PROCESS.barrier()


@pytest.mark.parametrize(
    ("recipe", "tolerance", "update_tolerance"),
    [
        ("bf16", 1e-5, 1e-5),
        ("fp8", 1e-5, 1e-5),  # whole micro-batches per rank: FP8's wgrad groups the same tokens
        ("fp8-kv", 1e-5, 1e-5),  # and the KV-cache scales' amax is the maximum over every rank's share
    ],
)
def test_two_ranks_update_as_one_rank(
    recipe: str, tolerance: float, update_tolerance: float, tiny_model_dir_f32: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        torchrun(2, str(ROOT / "tests" / "rank_worker.py"), str(tiny_model_dir_f32), recipe, str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sharded = json.loads((tmp_path / "metrics.json").read_text())
    learner = Learner(learner_config(tiny_model_dir_f32, recipe), get_recipe(recipe))
    before = {k: v.clone() for k, v in learner.master_weights().items()}
    metrics = learner.train(STEP_SAMPLES, sampling())
    assert sharded["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
    assert sharded["token_mult_prob_error"] == pytest.approx(metrics["token_mult_prob_error"], rel=1e-6)
    assert sharded["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=tolerance)
    after, two_ranks = learner.master_weights(), load_file(tmp_path / "weights.safetensors")
    # The updates compared as a whole (Adam's per-weight normalisation amplifies a difference of a
    # weight's tiny gradient, so single weights say little): |update_2 - update_1| / |update_1|.
    one = torch.cat([(after[k] - before[k]).flatten() for k in sorted(after)]).double()
    two = torch.cat([(two_ranks[k] - before[k]).flatten() for k in sorted(after)]).double()
    apart = ((two - one).norm() / one.norm()).item()
    norms = f"grad_norm {sharded['grad_norm']:.6g} vs {metrics['grad_norm']:.6g}"
    print(f"{recipe}: {norms}; updates {apart:.2g} apart (relative L2)")
    assert one.abs().max() > LR / 2 and apart <= update_tolerance
    if learner.kv_cache is not None:  # calibrated on the ranks' shares of the batch: the same scales
        assert not torch.equal(learner.kv_cache.scales, torch.ones_like(learner.kv_cache.scales))
        assert all(torch.equal(two_ranks[n], t) for n, t in learner.kv_cache.tensors().items())


@pytest.mark.parametrize(("tied", "recipe"), [(False, "fp8-kv"), (True, "bf16")])
def test_checkpoints_go_between_rank_counts_both_ways_without_unpickling(
    tied: bool, recipe: str, tiny_model_dir_f32: Path, tmp_path: Path
) -> None:
    """One process checkpoints a step; two ranks resume it, train one more and checkpoint it; one process
    resumes theirs: every file safetensors or JSON, and no resume reads a pickle. ``tied``: a model whose
    lm_head is its embedding (safetensors holds it once)."""
    model, ckpt = tiny_model_dir_f32, tmp_path / "ckpt"
    if tied:
        model = write_checkpoint(TIED, tiny_model_dir_f32, tmp_path / "tied")
    one = Learner(learner_config(model, recipe), get_recipe(recipe))
    one.train(STEP_SAMPLES, sampling())
    assert_pickle_free(checkpoint.write(ckpt, one, {}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    worker = torchrun(2, str(ROOT / "tests" / "rank_worker.py"), str(model), recipe)
    done = subprocess.run(
        [*worker, str(tmp_path), str(ckpt)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    resumed = load_file(tmp_path / "resumed.safetensors")
    weights = {k: v.clone() for k, v in one.published_weights().items()}  # (views: copied before it trains)
    assert resumed.keys() == weights.keys() and all(torch.equal(resumed[n], weights[n]) for n in weights)
    sharded = ckpt / "step-00000002"
    assert_pickle_free(sharded)
    assert len(list((sharded / checkpoint.SHARDS).glob("*.safetensors"))) == 2  # a file a rank
    again = Learner(learner_config(model, recipe), get_recipe(recipe))
    with unpickling_forbidden():
        assert checkpoint.resume(ckpt, again) is not None
    trained = load_file(tmp_path / "weights.safetensors")
    assert again.step == 2 and all(torch.equal(trained[n], t) for n, t in again.published_weights().items())
    # AdamW's moments went through the two ranks: their step is one process's, to float32 rounding.
    one.train(STEP_SAMPLES, sampling())
    after = one.master_weights()
    update = torch.cat([(after[k] - weights[k]).flatten() for k in sorted(after)]).double()
    apart = torch.cat([(trained[k] - after[k]).flatten() for k in sorted(after)]).double()
    assert (apart.norm() / update.norm()).item() <= 1e-5


# -- the sharded service ---------------------------------------------------------------------------------


class KeptUpdates(rollout_pb2_grpc.RolloutServicer):
    """A stand-in replica that decodes what it is sent and keeps it (the codec's checks, no engine)."""

    def __init__(self) -> None:
        self.held: WeightSet | None = None
        self.version = -1

    def UpdateWeights(
        self, request_iterator: Iterable[weights_pb2.WeightChunk], context: grpc.ServicerContext
    ) -> weights_pb2.UpdateWeightsResponse:
        parts = receive_parts(request_iterator, max_bytes=1 << 30)
        decoded, _ = decode_parts(parts, self.held, self.version if self.held is not None else None)
        self.held, self.version = decoded.weights, decoded.version
        return weights_pb2.UpdateWeightsResponse(version=decoded.version, encoding=decoded.encoding)


@pytest.fixture
def kept() -> Iterator[tuple[KeptUpdates, str]]:
    servicer = KeptUpdates()
    running = serve_rollout(servicer)
    yield servicer, running.address
    running.stop(0)


def sharded_trainer(model: Path, nproc: int, ckpt: Path, log: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    args = [sys.executable, "-m", "trainer_service.cli", "serve", "--model", str(model), "--recipe", "fp8"]
    args += ["--compute-dtype", "float32", "--port", "0", "--nproc-per-node", str(nproc)]
    args += [
        "--checkpoint-dir",
        str(ckpt),
        "--resume",
        "--set",
        "micro_batch_size=3",
        "--set",
        "checkpoint_every=0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with child_process(args, log, env) as proc:
        address = bound_address(proc, log)
        wait_for_line(proc, log, "serving on", timeout=300)
        yield proc, address


def step_request(step: int) -> trainer_pb2.TrainStepRequest:
    return trainer_pb2.TrainStepRequest(run_id="sharded", step=step, samples=STEP_MESSAGES)


def publish(stub: trainer_pb2_grpc.TrainerStub, version: int, address: str, held: int) -> None:
    target = trainer_pb2.PublishTarget(address=address, held_version=held)
    reply = stub.PublishWeights(
        trainer_pb2.PublishWeightsRequest(version=version, targets=[target]), timeout=300
    )
    assert reply.results[0].ok, reply.results[0].error


def test_sharded_service_trains_publishes_and_resumes_on_another_rank_count(
    tiny_model_dir_f32: Path, tmp_path: Path, kept: tuple[KeptUpdates, str]
) -> None:
    replica, address = kept
    ckpt = tmp_path / "ckpt"
    with contextlib.contextmanager(sharded_trainer)(tiny_model_dir_f32, 2, ckpt, tmp_path / "two.log") as (
        _,
        trainer,
    ):
        stub = trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(trainer))
        # Version 0 from the shards is the checkpoint's own weights, code for code.
        publish(stub, 0, address, -1)
        plain = Learner(learner_config(tiny_model_dir_f32, "fp8"), get_recipe("fp8"))
        assert replica.held is not None
        assert (
            replica.held.digest
            == build_weight_set(plain.master_weights(), "fp8-block128", torch.float32).digest
        )
        # Bad input is answered by rank 0 alone; had it reached a collective, the next step would hang.
        bad = step_request(0)
        bad.samples[0].completion_token_ids.append(10**9)
        with pytest.raises(grpc.RpcError) as refused:
            stub.TrainStep(bad, timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        first = stub.TrainStep(step_request(0), timeout=300)
        assert first.weight_version == 1 and first.metrics.loss == first.metrics.loss
        scored = stub.ComputeLogprobs(
            trainer_pb2.ComputeLogprobsRequest(
                sequences=[trainer_pb2.TokenSequence(prompt_token_ids=[5, 6, 7], completion_token_ids=[8, 9])]
            ),
            timeout=120,
        )
        assert len(scored.results[0].logprobs) == 2 and scored.weight_version == 1
        publish(stub, 1, address, 0)
        assert replica.version == 1
        after_step = replica.held.digest
        saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=300)
        assert saved.step == 1 and len(list((Path(saved.path) / "shards").glob("*.safetensors"))) == 2
        assert_pickle_free(Path(saved.path))
        stub.TrainStep(step_request(1), timeout=300)
        publish(stub, 2, address, 1)
        two_steps = replica.held.digest
    # Two ranks again, from the checkpoint: weights and AdamW state back bit for bit, so the next step
    # lands on the same bytes.
    replica.held, replica.version = None, -1
    with contextlib.contextmanager(sharded_trainer)(tiny_model_dir_f32, 2, ckpt, tmp_path / "again.log") as (
        _,
        trainer,
    ):
        stub = trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(trainer))
        assert stub.TrainStep(step_request(1), timeout=300).weight_version == 2
        publish(stub, 2, address, -1)
        assert replica.held.digest == two_steps
    # One rank resumes the two ranks' checkpoint (resharded) and holds exactly the same weights.
    replica.held, replica.version = None, -1
    with contextlib.contextmanager(sharded_trainer)(tiny_model_dir_f32, 1, ckpt, tmp_path / "one.log") as (
        _,
        trainer,
    ):
        stub = trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(trainer))
        assert stub.GetStatus(common_pb2.GetStatusRequest(), timeout=30).step == 1
        publish(stub, 1, address, -1)
        assert replica.held.digest == after_step
        assert stub.TrainStep(step_request(0), timeout=60).replayed  # the step's result came back with it
        assert stub.TrainStep(step_request(1), timeout=300).weight_version == 2
    # And one plain process (no torchrun) resumes it too: one layout for any number of ranks.
    plain_service = TrainerService(
        service_config(tiny_model_dir_f32, ckpt).model_copy(update={"resume": True})
    )
    assert plain_service.step == 1 and digest(plain_service) == after_step
    plain_service.publisher.close()


def service_config(model: Path, ckpt: Path) -> TrainerConfig:
    """sharded_trainer's config, for a trainer in this process."""
    return learner_config(model, "fp8").model_copy(update={"checkpoint_dir": ckpt, "checkpoint_every": 0})


def digest(service: TrainerService) -> str:
    return build_weight_set(service.learner.master_weights(), "fp8-block128", torch.float32).digest


def test_two_ranks_resume_the_checkpoint_of_one_process(
    tiny_model_dir_f32: Path, tmp_path: Path, kept: tuple[KeptUpdates, str]
) -> None:
    replica, address = kept
    ckpt = tmp_path / "ckpt"
    plain = TrainerService(service_config(tiny_model_dir_f32, ckpt))
    plain.train_step(step_request(0))
    plain.save_checkpoint()
    saved = digest(plain)
    plain.publisher.close()
    with contextlib.contextmanager(sharded_trainer)(tiny_model_dir_f32, 2, ckpt, tmp_path / "two.log") as (
        _,
        trainer,
    ):
        stub = trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(trainer))
        assert stub.GetStatus(common_pb2.GetStatusRequest(), timeout=30).step == 1
        publish(stub, 1, address, -1)
        assert replica.held is not None and replica.held.digest == saved  # resharded, bit for bit
        assert stub.TrainStep(step_request(0), timeout=60).replayed
        assert stub.TrainStep(step_request(1), timeout=300).weight_version == 2


def test_two_machines_form_one_trainer_and_each_answers_its_probes(
    tiny_model_dir_f32: Path, tmp_path: Path
) -> None:
    """The layout of deploy/kubernetes' trainer: one torchrun per machine (pod), node i of a static
    rendezvous at node 0, each with a plaintext health port for its pod's probes. Rank 0 serves gRPC; the
    other machine's rank answers health once it has joined and loaded its shard."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    master = free_port()  # (both machines are told it: static rendezvous)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with contextlib.ExitStack() as stack:
        procs = []
        for node in (0, 1):
            args = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
            args += [f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={master}"]
            args += ["--module", "trainer_service.cli", "serve", "--model", str(tiny_model_dir_f32)]
            args += ["--compute-dtype", "float32", "--port", "0", "--set", "micro_batch_size=3"]
            args += ["--set", "health_port=0"]
            log = tmp_path / f"node{node}.log"
            procs.append((stack.enter_context(child_process(args, log, env)), log))
        health = [health_address(*proc) for proc in procs]
        address = bound_address(*procs[0])
        wait_for_line(*procs[0], "serving on", timeout=300)
        stub = trainer_pb2_grpc.TrainerStub(stack.enter_context(grpc.insecure_channel(address)))
        assert stub.TrainStep(step_request(0), timeout=300).weight_version == 1  # both ranks took part
        for probe_address in health:
            probes = stack.enter_context(grpc.insecure_channel(probe_address))
            reply = health_pb2_grpc.HealthStub(probes).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
