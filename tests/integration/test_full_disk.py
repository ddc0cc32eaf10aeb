"""The trainer's checkpoints on a disk that really fills (a tmpfs of 40 MB), through a real gRPC server: a
save that fails, wherever it fails, never fails the step, leaves no partial checkpoint, is counted and
retried; a trainer that resumes on the full disk starts from its last complete checkpoint and trains on."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from fp8rl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from tests.integration.test_trainer import samples, step_request
from tests.support import fill_disk, serve_trainer, tmpfs, trainer_config
from trainer_service import checkpoint
from trainer_service.config import TrainerConfig
from trainer_service.service import TrainerService

PAGE = 4096  # a tmpfs's block


def pages(nbytes: int) -> int:
    """Bytes a file of ``nbytes`` takes on a tmpfs."""
    return math.ceil(nbytes / PAGE) * PAGE


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "disk", "40m") as mounted:
        yield mounted


def config_on(model: Path, root: Path, **overrides: object) -> TrainerConfig:
    return trainer_config(
        model,
        "fp8",
        device="cpu",
        fp8_backend="emulated",
        port=0,
        micro_batch_size=3,
        optimizer={"lr": 1e-3},
        checkpoint_dir=root,
        checkpoint_every=1,
        **overrides,
    )


class Served:
    """A trainer behind a real gRPC server on port 0."""

    def __init__(self, service: TrainerService) -> None:
        self.service = service
        self.server = serve_trainer(service)
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = trainer_pb2_grpc.TrainerStub(self.channel)

    def train(self, step: int) -> None:
        response = self.stub.TrainStep(step_request(step, samples(step)), timeout=60)
        assert (response.step, response.weight_version, response.replayed) == (step, step + 1, False)
        assert not response.HasField("skipped") and response.metrics.num_samples == 6

    def status(self) -> tuple[int, int, bool, int]:
        s = self.stub.GetStatus(common_pb2.GetStatusRequest(), timeout=10)
        return s.step, s.checkpoint_failures, s.checkpoint_pending, s.last_checkpoint_step

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0)


def on_disk(root: Path) -> list[str]:
    """What the checkpoint directory holds, but the ballast; every ``step-*`` must verify."""
    names = sorted(p.name for p in root.iterdir() if p.name != ".ballast")
    for name in names:
        assert not name.startswith(".") and checkpoint.verify(root / name), f"{name} is partial"
    return names


def test_a_full_disk_fails_no_step_leaves_no_partial_checkpoint_and_resumes(
    tiny_model_dir_f32: Path, disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="trainer_service.service")
    config = config_on(tiny_model_dir_f32, disk, keep_checkpoints=1)
    served = Served(TrainerService(config))
    try:
        served.train(0)
        assert on_disk(disk) == ["step-00000001"] and served.status() == (1, 0, False, 1)
        sizes = {p.name: pages(p.stat().st_size) for p in (disk / "step-00000001").rglob("*") if p.is_file()}
        shards = sum(v for k, v in sizes.items() if k.startswith("shard-"))
        # Each step's save runs out of space in another file: the ranks' shards (torch.distributed.
        # checkpoint's CheckpointException, a BaseException), rng.safetensors (safetensors'
        # SafetensorError, an Exception) and trainer.json (OSError).
        for step, leave, raised in (
            (1, PAGE, "CheckpointException"),
            (2, shards + PAGE, "SafetensorError"),
            (3, shards + sizes["rng.safetensors"], "OSError"),
        ):
            fill_disk(disk, leave)
            caplog.clear()
            served.train(step)  # the normal trained answer
            assert on_disk(disk) == ["step-00000001"]  # nothing partial, the last complete one kept
            assert served.status() == (step + 1, step, True, 1)
            # (torch's checkpoint logger may log the failure too, once anything set its handlers up)
            (record,) = [r for r in caplog.records if r.name == "trainer_service.service"]
            failure = record.args[0]  # type: ignore[index]
            assert isinstance(failure, checkpoint.SaveFailed), record.getMessage()
            assert type(failure.__cause__).__name__ == raised, repr(failure.__cause__)
            assert "No space left on device" in record.getMessage(), record.getMessage()
        (disk / ".ballast").unlink()
        served.train(4)  # room again: the retried save goes through
        assert on_disk(disk) == ["step-00000005"] and served.status() == (5, 3, False, 5)
        prometheus = {s.name: s.value for s in served.service.prometheus()}
        assert prometheus["trainer_checkpoint_failures"] == 3
        served.train(5)  # (a third checkpoint of the same size would not fit beside two: keep 1)
        fill_disk(disk, 0)
        # An explicit SaveCheckpoint on the full disk is answered (not left to its deadline) and says why.
        with pytest.raises(grpc.RpcError) as err:
            served.stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=60)
        assert err.value.code() == grpc.StatusCode.INTERNAL, err.value
        assert "No space left on device" in err.value.details(), err.value.details()
        assert on_disk(disk) == ["step-00000006"] and served.status() == (6, 3, False, 6)
    finally:
        served.close()


def test_resuming_on_a_full_disk_starts_from_the_last_complete_checkpoint(
    tiny_model_dir_f32: Path, disk: Path
) -> None:
    config = config_on(tiny_model_dir_f32, disk, keep_checkpoints=1)
    served = Served(TrainerService(config))
    try:
        served.train(0)
        served.train(1)
        fill_disk(disk, 0)
        served.train(2)  # trained, its checkpoint lost to the full disk
        assert on_disk(disk) == ["step-00000002"]
    finally:
        served.close()
    # A save cut short for good (its process killed mid-write) leaves its staging directory: the next
    # start removes it, and resumes from the newest complete checkpoint, on the still-full disk.
    (disk / f".tmp-step-00000003-{2**22 + 1}").mkdir()  # (a pid above Linux's largest pid_max)
    resumed = Served(TrainerService(config.model_copy(update={"resume": True})))
    try:
        assert on_disk(disk) == ["step-00000002"] and resumed.status() == (2, 0, False, 2)
        for step in (2, 3):  # the lost step trained again, and the next, on the full disk
            resumed.train(step)
        assert on_disk(disk) == ["step-00000002"] and resumed.status() == (4, 2, True, 2)
        (disk / ".ballast").unlink()
        resumed.train(4)
        assert on_disk(disk) == ["step-00000005"] and resumed.status() == (5, 2, False, 5)
    finally:
        resumed.close()


# TensorBoard's writer thread dies of the full disk, printing its traceback (its writer then raises it at
# every call: the sink starts a new one once there is room).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_coordinator_s_files_on_a_full_disk_stop_no_run_and_catch_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """metrics.jsonl and TensorBoard are views of the records in Redis: on a full disk the sink goes on,
    metrics.jsonl keeps whole lines (the records before the disk filled), and both catch up once there is
    room."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from coordinator.metrics import MetricsSink, read_metrics

    def record(step: int) -> dict[str, object]:
        # (60 scalars: a few records fill TensorBoard's last page as well as metrics.jsonl's)
        return {"step": step, "reward_mean": step / 10} | {f"figure_{i}": step + i / 7 for i in range(60)}

    with tmpfs(tmp_path / "run", "1m") as run_dir:
        sink = MetricsSink(run_dir, steps=40, progress="plain")
        sink.rebuild([record(1)], next_step=2)
        sink.write(record(2))
        fill_disk(run_dir, 0)
        for step in range(3, 8):
            assert sink.write(record(step)) == []  # no exception: the run goes on
        assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]  # whole lines only
        assert sink.write_failures >= 5
        failed = [r for r in caplog.records if "not written" in r.getMessage()]
        assert {r.getMessage().split()[0] for r in failed} == {"metrics.jsonl", "TensorBoard"}
        assert len(failed) == 2  # once each, not at every step
        (run_dir / ".ballast").unlink()
        sink.write(record(8))
        assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 9))
        sink.close()
        events = EventAccumulator(str(run_dir / "tensorboard"))
        events.Reload()
        assert sorted({e.step for e in events.Scalars("reward_mean")}) == list(range(2, 9))
        # A resume on a full disk rebuilds nothing and stops nothing: the file is written whole later.
        fill_disk(run_dir, 0)
        again = MetricsSink(run_dir, steps=40, progress="plain", tensorboard=False)
        again.rebuild([record(s) for s in range(1, 10)], next_step=10)
        again.write(record(10))
        assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 9))
        (run_dir / ".ballast").unlink()
        again.write(record(11))
        assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 12))
        again.close()
