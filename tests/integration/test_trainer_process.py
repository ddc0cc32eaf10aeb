"""The trainer as a real process: kill -9 after a checkpoint, resume, and the next step is bit-identical
to an uninterrupted run; torn checkpoint directories are ignored."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from fp8rl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from tests.integration.test_rollout_cli import scrape
from tests.integration.test_trainer import samples, step_request
from tests.support import bound_address, child_process, health_address, wait_for_line

PROBE = trainer_pb2.ComputeLogprobsRequest(
    sequences=[trainer_pb2.TokenSequence(prompt_token_ids=[5, 6, 7], completion_token_ids=[8, 9, 10, 11])],
    sampling=common_pb2.SamplingParams(temperature=1.0),
)
TIMING = ("train_s", "tokens_per_s")


@contextmanager
def trainer_process(
    model: Path, log: Path, *extra: str
) -> Iterator[tuple[object, trainer_pb2_grpc.TrainerStub]]:
    args = [
        sys.executable,
        "-m",
        "trainer_service.cli",
        "serve",
        "--model",
        str(model),
        "--recipe",
        "fp8",
        "--port",
        "0",
        "--compute-dtype",
        "float32",
        "--set",
        "optimizer.lr=0.001",
        "--set",
        "micro_batch_size=2",
        *extra,
    ]
    with child_process(args, log) as proc, grpc.insecure_channel(bound_address(proc, log)) as channel:
        wait_for_line(proc, log, r"serving on", timeout=120)
        yield proc, trainer_pb2_grpc.TrainerStub(channel)


def without_timing(result: trainer_pb2.TrainStepResponse) -> trainer_pb2.TrainStepResponse:
    copy = trainer_pb2.TrainStepResponse()
    copy.CopyFrom(result)
    for field in TIMING:
        copy.metrics.ClearField(field)
    return copy


def test_kill_and_resume_is_bit_identical(tiny_model_dir_f32: Path, tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    with trainer_process(tiny_model_dir_f32, log, "--metrics-port", "0") as (_, stub):
        url = re.search(r"Prometheus metrics on (http://\S+)", log.read_text()).group(1)  # type: ignore[union-attr]
        assert scrape(url)["fp8rl_trainer_train_step_seconds_count"] == 0
        stub.TrainStep(step_request(0, samples(0)), timeout=120)
        expected = stub.TrainStep(step_request(1, samples(1)), timeout=120)
        expected_logprobs = stub.ComputeLogprobs(PROBE, timeout=60)
        metrics = scrape(url)
        assert metrics["fp8rl_trainer_step"] == 2 and metrics["fp8rl_trainer_train_step_seconds_count"] == 2
        assert metrics["fp8rl_trainer_token_mult_prob_error"] == expected.metrics.token_mult_prob_error

    ckpt = tmp_path / "ckpt"
    with trainer_process(tiny_model_dir_f32, tmp_path / "b.log", "--checkpoint-dir", str(ckpt)) as (
        proc,
        stub,
    ):
        first = stub.TrainStep(step_request(0, samples(0)), timeout=120)
        saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=120)
        assert saved.step == 1 and Path(saved.path).is_dir()
        os.kill(proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        proc.wait()  # type: ignore[attr-defined]
    # A torn newer checkpoint (its manifest does not verify) and a half-written temporary directory.
    torn = ckpt / "step-00000007"
    shutil.copytree(saved.path, torn)
    next((torn / "shards").glob("*.safetensors")).write_bytes(b"truncated")  # the weights and AdamW state
    (ckpt / ".tmp-step-00000008-123").mkdir()

    with trainer_process(
        tiny_model_dir_f32, tmp_path / "c.log", "--checkpoint-dir", str(ckpt), "--resume"
    ) as (_, stub):
        status = stub.GetStatus(common_pb2.GetStatusRequest(), timeout=10)
        assert (status.step, status.run_id) == (1, "run")
        replay = stub.TrainStep(step_request(0, samples(0)), timeout=120)
        assert replay.replayed and replay.metrics == first.metrics
        resumed = stub.TrainStep(step_request(1, samples(1)), timeout=120)
        assert without_timing(resumed) == without_timing(expected)
        assert stub.ComputeLogprobs(PROBE, timeout=60) == expected_logprobs
    assert "skipping incomplete checkpoint" in (tmp_path / "c.log").read_text()


def test_a_plaintext_health_port_answers_probes_beside_a_mutual_tls_server(
    tiny_model_dir_f32: Path, tmp_path: Path
) -> None:
    """Kubernetes' native gRPC probes speak no TLS: with ``health_port`` the trainer answers gRPC health
    there in plaintext, with the main server's statuses, and nothing else; its own port stays mutual TLS."""
    import yaml
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from fp8rl.run_secrets import security_for, write_run_secrets

    write_run_secrets(tmp_path / "secrets", tls=True)
    security = security_for(tmp_path / "secrets", "trainer", tls=True).model_dump(mode="json")
    config = tmp_path / "trainer.yaml"
    config.write_text(yaml.safe_dump({"security": security, "compute_dtype": "float32"}))
    args = [sys.executable, "-m", "trainer_service.cli", "serve", "--model", str(tiny_model_dir_f32)]
    args += ["--config", str(config), "--port", "0", "--set", "health_port=0"]
    log = tmp_path / "trainer.log"
    with child_process(args, log) as proc:
        probes_at, served_at = health_address(proc, log), bound_address(proc, log)
        with grpc.insecure_channel(probes_at) as probes, grpc.insecure_channel(served_at) as plaintext:
            wait_for_line(proc, log, r"serving on", timeout=120)
            check = health_pb2_grpc.HealthStub(probes).Check
            for service in ("", "fp8rl.v1.Trainer"):
                reply = check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as no_watch:  # (a stream and a kept status per name asked)
                next(
                    health_pb2_grpc.HealthStub(probes).Watch(
                        health_pb2.HealthCheckRequest(service="x"), timeout=5
                    )
                )
            assert no_watch.value.code() == grpc.StatusCode.UNIMPLEMENTED
            with pytest.raises(grpc.RpcError) as only_health:
                trainer_pb2_grpc.TrainerStub(probes).GetStatus(common_pb2.GetStatusRequest(), timeout=10)
            assert only_health.value.code() == grpc.StatusCode.UNIMPLEMENTED
            with pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(plaintext).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
