"""Only the run's own processes train, publish or change weights: the attacks of issues 17 and 36 replayed
against real servers (the trainer on the tiny model, the session's vLLM replica), each refused with its
status code and leaving state unchanged; updates only the trainer can sign, a high-water mark that
outlives a replica's restart, registration proofs that expire, fences required under authentication;
mutual TLS; servers that refuse to bind beyond loopback unprotected."""

from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import ValidationError

from fp8rl.codec.encode import keyframe_parts
from fp8rl.codec.schema import build_weight_set
from fp8rl.codec.stream import header_of, parts_to_chunks, update_to_chunks
from fp8rl.codec.testing import encode_keyframe
from fp8rl.codec.weight_set import WeightSet
from fp8rl.errors import PermissionDenied, Unauthenticated
from fp8rl.run_secrets import BUNDLES, export_bundle, security_for, token_path, write_run_secrets
from fp8rl.security import (
    PROOF_TTL_S,
    AccessControl,
    SecurityConfig,
    caller_role,
    exposure_problem,
    proof_refusal,
    registration_proof,
    signer_id,
    token_digest,
)
from fp8rl.serving import FENCE_METADATA, InsecureBinding, RunningServer, start_server
from fp8rl.transport import channel
from fp8rl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc, weights_pb2
from rollout_service.high_water import HighWater
from rollout_service.service import RolloutService
from rollout_service.servicer import RolloutServicer
from tests.conftest import InProcessRollout
from tests.integration.test_rollout import random_state
from tests.integration.test_trainer import samples
from tests.support import serve_rollout, serve_trainer, trainer_config
from trainer_service.service import TrainerService
from trainer_service.servicer import SERVICE_NAME as TRAINER

Code = grpc.StatusCode


@pytest.fixture(scope="module")
def run_secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("secrets") / "run"
    write_run_secrets(directory, tls=True)
    return directory


def code_of(call: Callable[..., object], *args: object, **kwargs: object) -> tuple[grpc.StatusCode, str]:
    """The status ``call(*args, **kwargs)`` ends with, and its details."""
    try:
        call(*args, **kwargs)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return Code.OK, ""


# -- the run's secrets ----------------------------------------------------------------------------------


def test_run_secrets_are_private_and_kept(tmp_path: Path) -> None:
    directory = tmp_path / "s"
    write_run_secrets(directory, tls=True)
    assert directory.stat().st_mode & 0o777 == 0o700
    files = {p.name: p for p in directory.iterdir()}
    keys = {"update-signing.key", "update-verify.pub", "registration.key"}
    assert {"tokens", "ca.pem", "ca.key", "coordinator.token", "replica.pem", *keys} <= set(files)
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in files.values())
    tokens = (directory / "tokens").read_text()
    coordinator = token_path(directory, "coordinator").read_text().strip()
    assert coordinator not in tokens and f"coordinator {token_digest(coordinator)}" in tokens  # digests only
    before = {name: p.read_bytes() for name, p in files.items()}
    write_run_secrets(directory, tls=True)  # a resumed run keeps its identities
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    # An earlier version's symmetric key, which any replica could sign with, is removed.
    (directory / "update.key").write_text("00" * 32)
    write_run_secrets(directory, tls=True)
    assert not (directory / "update.key").exists()


def test_only_the_trainer_gets_the_signing_key(run_secrets: Path, tmp_path: Path) -> None:
    """The private key goes where the trainer reads it and nowhere else; replicas get the public key (and
    the registration key, which signs no update); clients get neither."""
    trainer, replica = (security_for(run_secrets, role, tls=True) for role in ("trainer", "replica"))
    assert trainer.update_public_key_file is None and replica.update_signing_key_file is None
    signing, public = trainer.update_signing_key(), replica.update_public_key()
    assert signing is not None and public is not None
    assert signer_id(signing.public_key()) == signer_id(public)
    for role in ("coordinator", "reader"):
        client = security_for(run_secrets, role, tls=True)
        assert client.update_signing_key_file is client.registration_key_file is None
    for role in BUNDLES:
        export_bundle(run_secrets, role, tmp_path / role)
        private = [p.name for p in (tmp_path / role).iterdir() if b"PRIVATE KEY" in p.read_bytes()]
        signing = [name for name in private if name != f"{role}.key"]  # (its own TLS key aside)
        assert signing == (["update-signing.key"] if role == "trainer" else []), (role, private)


# -- the trainer ------------------------------------------------------------------------------------------


def trainer_server(
    model: Path, security: SecurityConfig, tmp_path: Path
) -> tuple[TrainerService, RunningServer]:
    config = trainer_config(
        model,
        "fp8",
        micro_batch_size=3,
        checkpoint_dir=tmp_path / "ckpt",
        security=security,
    )
    service = TrainerService(config)
    return service, serve_trainer(service, security)


@pytest.fixture
def secured_trainer(
    tiny_model_dir_f32: Path, run_secrets: Path, tmp_path: Path
) -> Iterator[tuple[TrainerService, str]]:
    service, running = trainer_server(
        tiny_model_dir_f32, security_for(run_secrets, "trainer", tls=False), tmp_path
    )
    yield service, running.address
    running.stop(0)
    service.publisher.close()


def trainer_stub(address: str, security: SecurityConfig | None) -> trainer_pb2_grpc.TrainerStub:
    return trainer_pb2_grpc.TrainerStub(channel(address, security, "trainer"))


def test_trainer_refuses_callers_without_the_coordinator_role(
    secured_trainer: tuple[TrainerService, str], run_secrets: Path, tmp_path: Path
) -> None:
    service, address = secured_trainer
    weights_before = {k: v.clone() for k, v in service.learner.master_weights().items()}
    train = trainer_pb2.TrainStepRequest(run_id="r", step=0, samples=samples(0))
    publish = trainer_pb2.PublishWeightsRequest(
        version=0, targets=[trainer_pb2.PublishTarget(address="127.0.0.1:1", held_version=-1)]
    )
    forged = tmp_path / "forged.token"
    forged.write_text("not-a-token-of-this-run")
    callers = {
        "nobody": None,
        "forged token": SecurityConfig(token_file=forged),
        "reader": security_for(run_secrets, "reader", tls=False),
        "trainer": security_for(run_secrets, "trainer", tls=False),  # its own token: not the coordinator's
        "replica": security_for(run_secrets, "replica", tls=False),
    }
    for who, security in callers.items():
        stub = trainer_stub(address, security)
        expected = Code.UNAUTHENTICATED if who in ("nobody", "forged token") else Code.PERMISSION_DENIED
        for name, call, message in (
            ("TrainStep", stub.TrainStep, train),
            ("PublishWeights", stub.PublishWeights, publish),
            ("SaveCheckpoint", stub.SaveCheckpoint, trainer_pb2.SaveCheckpointRequest()),
        ):
            code, details = code_of(call, message, timeout=30)
            assert code == expected and name in details, (who, name, code, details)
        status = code_of(stub.GetStatus, common_pb2.GetStatusRequest(), timeout=10)[0]
        assert status == (Code.UNAUTHENTICATED if expected == Code.UNAUTHENTICATED else Code.OK), who
    # Nothing changed: no step, no checkpoint, the same weights.
    assert service.step == 0 and not service.results and not list((tmp_path / "ckpt").glob("step-*"))
    after = service.learner.master_weights()
    assert all(torch.equal(weights_before[k], after[k]) for k in weights_before)

    coordinator = trainer_stub(address, security_for(run_secrets, "coordinator", tls=False))
    assert coordinator.GetStatus(common_pb2.GetStatusRequest(), timeout=10).step == 0
    reply = coordinator.TrainStep(train, timeout=120, metadata=[(FENCE_METADATA, "1")])
    assert reply.metrics.loss == reply.metrics.loss and service.step == 1


def test_publish_goes_only_to_the_runs_replicas(
    secured_trainer: tuple[TrainerService, str], run_secrets: Path
) -> None:
    service, address = secured_trainer
    stub = trainer_stub(address, security_for(run_secrets, "coordinator", tls=False))
    fenced = [(FENCE_METADATA, "1")]
    key = bytes.fromhex((run_secrets / "registration.key").read_text())
    other_key, now = bytes(32), time.time()
    refused = {
        "203.0.113.5:50051": ("", "no proof"),
        "127.0.0.1:9": ("hmac-sha256:00", "not of the form"),  # an older version's static proof
        # A real proof, but for another address, under another run's key, expired (a captured one,
        # replayed), or valid far beyond a proof's lifetime (made by a clock set ahead).
        "127.0.0.1:10": (registration_proof(key, "127.0.0.1:11"), "does not verify"),
        "127.0.0.1:12": (registration_proof(other_key, "127.0.0.1:12"), "does not verify"),
        "127.0.0.1:13": (registration_proof(key, "127.0.0.1:13", now - 2 * PROOF_TTL_S), "expired"),
        "127.0.0.1:14": (registration_proof(key, "127.0.0.1:14", now + 10 * PROOF_TTL_S), "beyond"),
    }
    for target_address, (proof, why) in refused.items():
        target = trainer_pb2.PublishTarget(address=target_address, held_version=-1, proof=proof)
        request = trainer_pb2.PublishWeightsRequest(version=0, targets=[target])
        code, details = code_of(stub.PublishWeights, request, timeout=30, metadata=fenced)
        assert code == Code.PERMISSION_DENIED and "targets[0].address" in details and why in details, details
    assert service.publisher.last is None  # nothing was even quantized
    # An impostor beside a real target gets nothing, and does not stall the publish to the real one.
    real = trainer_pb2.PublishTarget(address="127.0.0.1:9", proof=registration_proof(key, "127.0.0.1:9"))
    impostor = trainer_pb2.PublishTarget(address="203.0.113.5:50051")
    reply = stub.PublishWeights(
        trainer_pb2.PublishWeightsRequest(version=0, targets=[impostor, real]), timeout=300, metadata=fenced
    )
    assert [r.address for r in reply.results] == [impostor.address, real.address]
    assert not reply.results[0].ok and reply.results[0].error.startswith(
        "PERMISSION_DENIED: targets[0].address"
    )
    assert not reply.results[1].ok and "UNAVAILABLE" in reply.results[1].error  # proven, but nobody listens
    assert proof_refusal(key, "127.0.0.1:9", registration_proof(key, "127.0.0.1:9")) is None


def test_calls_that_change_the_run_need_the_fence_when_authentication_is_on(
    secured_trainer: tuple[TrainerService, str], run_secrets: Path
) -> None:
    """A coordinator's call without its fencing token is refused (else any holder of the coordinator's
    token could act beside the lease holder, unfenced), before anything moves."""
    service, address = secured_trainer
    stub = trainer_stub(address, security_for(run_secrets, "coordinator", tls=False))
    key = bytes.fromhex((run_secrets / "registration.key").read_text())
    proven = trainer_pb2.PublishTarget(address="127.0.0.1:9", proof=registration_proof(key, "127.0.0.1:9"))
    for name, call, message in (
        ("TrainStep", stub.TrainStep, trainer_pb2.TrainStepRequest(run_id="r", step=0, samples=samples(0))),
        ("PublishWeights", stub.PublishWeights, trainer_pb2.PublishWeightsRequest(targets=[proven])),
        ("SaveCheckpoint", stub.SaveCheckpoint, trainer_pb2.SaveCheckpointRequest()),
    ):
        code, details = code_of(call, message, timeout=30)
        assert code == Code.FAILED_PRECONDITION, (name, code, details)
        assert details.startswith(f"{name}: call metadata {FENCE_METADATA} is missing"), details
    assert service.step == 0 and service.fence == 0 and service.publisher.last is None
    assert not list((service.config.checkpoint_dir or Path("-")).glob("step-*"))
    saved = stub.SaveCheckpoint(
        trainer_pb2.SaveCheckpointRequest(), timeout=60, metadata=[(FENCE_METADATA, "3")]
    )
    assert saved.step == 0 and service.fence == 3


def test_mutual_tls_identifies_callers_by_certificate(
    tiny_model_dir_f32: Path, run_secrets: Path, tmp_path: Path
) -> None:
    service, running = trainer_server(
        tiny_model_dir_f32, security_for(run_secrets, "trainer", tls=True), tmp_path
    )
    try:
        certs_only = {  # the certificate alone identifies: no tokens on these channels
            role: security_for(run_secrets, role, tls=True).model_copy(update={"token_file": None})
            for role in ("coordinator", "reader")
        }
        status = common_pb2.GetStatusRequest()
        assert (
            trainer_stub(running.address, certs_only["coordinator"]).GetStatus(status, timeout=10).step == 0
        )
        reader = trainer_stub(running.address, certs_only["reader"])
        assert reader.GetStatus(status, timeout=10).step == 0
        save = trainer_pb2.SaveCheckpointRequest()
        assert code_of(reader.SaveCheckpoint, save, timeout=10)[0] == Code.PERMISSION_DENIED
        # Without a certificate of the run's CA there is no connection at all; nor in plaintext.
        elsewhere = tmp_path / "other"
        write_run_secrets(elsewhere, tls=True)
        strangers = [
            SecurityConfig(tls_ca=run_secrets / "ca.pem"),
            security_for(elsewhere, "coordinator", tls=True).model_copy(
                update={"tls_ca": run_secrets / "ca.pem"}
            ),
            None,
        ]
        for stranger in strangers:
            stub = trainer_stub(running.address, stranger)
            assert code_of(stub.GetStatus, status, timeout=5)[0] == Code.UNAVAILABLE
        # A client checks the server too: the trainer's certificate does not pass for a replica's.
        as_replica = rollout_pb2_grpc.RolloutStub(
            channel(running.address, certs_only["coordinator"], "rollout")
        )
        assert code_of(as_replica.GetStatus, status, timeout=5)[0] == Code.UNAVAILABLE
        assert service.step == 0
    finally:
        running.stop(0)
        service.publisher.close()


def test_servers_refuse_to_bind_beyond_loopback_unprotected(
    run_secrets: Path, tiny_model_dir_f32: Path
) -> None:
    with pytest.raises(InsecureBinding, match="tokens_file"):
        start_server(lambda s: None, [TRAINER], host="0.0.0.0")
    tokens_only = SecurityConfig(tokens_file=run_secrets / "tokens")
    with pytest.raises(InsecureBinding, match="plaintext"):
        start_server(lambda s: None, [TRAINER], host="0.0.0.0", security=tokens_only)
    args = [
        sys.executable,
        "-m",
        "trainer_service.cli",
        "serve",
        "--model",
        str(tiny_model_dir_f32),
        "--host",
        "0.0.0.0",
    ]
    done = subprocess.run([*args, "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "refusing to serve" in done.stderr and "tokens_file" in done.stderr
    with pytest.raises(ValueError, match="plaintext"):  # nor does a client send its token in plaintext
        channel("203.0.113.5:50052", security_for(run_secrets, "coordinator", tls=False), "trainer")


# -- the replica ------------------------------------------------------------------------------------------


@pytest.fixture
def secured_replica(
    rollout_fp8: InProcessRollout, run_secrets: Path
) -> Iterator[tuple[InProcessRollout, str]]:
    """The session's replica behind a second server that checks tokens, holding the trainer's public key
    and the run's registration key for the test's duration (its high-water mark in memory)."""
    security = security_for(run_secrets, "replica", tls=False)
    service = rollout_fp8.service
    running = serve_rollout(rollout_fp8.servicer, security)
    public = security.update_public_key()
    assert public is not None
    service.update_public_key, service.high_water = public, HighWater(None, signer_id(public))
    service.registration_key, service.address = security.registration_key(), running.address
    try:
        yield rollout_fp8, running.address
    finally:
        service.update_public_key = service.high_water = service.registration_key = None
        running.stop(0)


def trainer_key(run_secrets: Path) -> Ed25519PrivateKey:
    key = security_for(run_secrets, "trainer", tls=False).update_signing_key()
    assert key is not None
    return key


def push(
    stub: rollout_pb2_grpc.RolloutStub,
    weights: WeightSet,
    version: int,
    epoch: int,
    signer: Ed25519PrivateKey | None,
) -> None:
    update = encode_keyframe(weights, version)
    stub.UpdateWeights(update_to_chunks(update, header=header_of(update, epoch, signer)), timeout=120)


def test_replica_applies_only_signed_updates_from_the_trainer_role(
    secured_replica: tuple[InProcessRollout, str], run_secrets: Path, gen: torch.Generator
) -> None:
    rollout, address = secured_replica
    service = rollout.service
    key = trainer_key(run_secrets)
    weights = build_weight_set(random_state(rollout.model_dir, 0), "fp8-block128", hp_dtype=torch.float32)
    as_trainer = rollout_pb2_grpc.RolloutStub(
        channel(address, security_for(run_secrets, "trainer", tls=False), "rollout")
    )
    epoch = 10**6 + int(torch.randint(0, 1000, (1,), generator=gen))  # newer than anything the session pushed
    push(as_trainer, weights, 100, epoch, key)
    assert service.version == 100

    def held() -> tuple[int, int]:
        return service.version, service.held_epoch

    attempts = {
        "no token": (None, lambda stub: push(stub, weights, 101, epoch, key), Code.UNAUTHENTICATED),
        "coordinator": (
            "coordinator",
            lambda stub: push(stub, weights, 101, epoch, key),
            Code.PERMISSION_DENIED,
        ),
        "reader": ("reader", lambda stub: push(stub, weights, 101, epoch, key), Code.PERMISSION_DENIED),
        "unsigned": ("trainer", lambda stub: push(stub, weights, 101, epoch, None), Code.UNAUTHENTICATED),
        "signed with another key": (
            "trainer",
            lambda stub: push(stub, weights, 101, epoch, Ed25519PrivateKey.generate()),
            Code.UNAUTHENTICATED,
        ),
        "older version": (
            "trainer",
            lambda stub: push(stub, weights, 99, epoch, key),
            Code.FAILED_PRECONDITION,
        ),
        "older epoch": (
            "trainer",
            lambda stub: push(stub, weights, 500, epoch - 1, key),
            Code.FAILED_PRECONDITION,
        ),
        "negative version": (
            "trainer",
            lambda stub: push(stub, weights, -5, epoch + 5, key),
            Code.INVALID_ARGUMENT,
        ),
    }
    for what, (role, attempt, expected) in attempts.items():
        security = security_for(run_secrets, role, tls=False) if role else None
        stub = rollout_pb2_grpc.RolloutStub(channel(address, security, "rollout"))
        code, details = code_of(attempt, stub)
        assert code == expected, (what, code, details)
        assert held() == (100, epoch), what
    # A signed header whose blob was swapped after signing: the signature covers every byte, not just the
    # digest.
    update = encode_keyframe(weights, 102)
    header = header_of(update, epoch, key)
    other = encode_keyframe(
        WeightSet(weights.format, {k: v.clone() for k, v in weights.tensors.items()}), 102
    )
    data = bytearray(b"".join(bytes(p) for p in other.pieces(1 << 30)))
    data[-1] ^= 1
    chunks = [weights_pb2.WeightChunk(header=header), weights_pb2.WeightChunk(data=bytes(data))]
    code, details = code_of(as_trainer.UpdateWeights, iter(chunks), timeout=60)
    assert code == Code.UNAUTHENTICATED and "header.signature" in details and held() == (100, epoch)
    # Each part is signed with its index and the part count: the first part of a signed update, relabelled
    # as the whole of it, does not verify.
    parted = list(parts_to_chunks(keyframe_parts(weights, 102, part_bytes=1 << 16), epoch, key))
    second = next(i for i, c in enumerate(parted) if c.WhichOneof("part") == "header" and c.header.part == 1)
    relabelled = weights_pb2.WeightChunk()
    relabelled.CopyFrom(parted[0])
    relabelled.header.parts = 1
    code, details = code_of(as_trainer.UpdateWeights, iter([relabelled, *parted[1:second]]), timeout=60)
    assert code == Code.UNAUTHENTICATED and "header.signature" in details and held() == (100, epoch)
    # A signed keyframe of NaN weights is refused all the same.
    poisoned = dict(weights.tensors)
    name = next(k for k, v in poisoned.items() if v.dtype == torch.float32 and v.dim() == 1)
    poisoned[name] = torch.full_like(poisoned[name], math.nan)
    code = code_of(push, as_trainer, WeightSet(weights.format, poisoned), 103, epoch, key)[0]
    assert code == Code.INVALID_ARGUMENT and held() == (100, epoch)
    # The healing cases: the same version again (a replica whose bytes diverged), and a coordinator that
    # took the run over (a newer epoch) bringing an older version back.
    push(as_trainer, weights, 100, epoch, key)
    assert held() == (100, epoch)
    push(as_trainer, weights, 7, epoch + 1, key)
    assert held() == (7, epoch + 1)
    # A signature that is no signature at all, on an update that would otherwise apply.
    update = encode_keyframe(weights, 8)
    header = header_of(update, epoch + 1, key)
    header.signature = "ed25519:not-hex"
    code, details = code_of(as_trainer.UpdateWeights, update_to_chunks(update, header=header), timeout=60)
    assert code == Code.UNAUTHENTICATED and "header.signature" in details and held() == (7, epoch + 1)
    # The replica proves its membership of the run, with a proof that expires; reads need an identity.
    reader = rollout_pb2_grpc.RolloutStub(
        channel(address, security_for(run_secrets, "reader", tls=False), "rollout")
    )
    status = reader.GetStatus(common_pb2.GetStatusRequest(), timeout=10)
    registration = service.registration_key
    assert registration is not None and status.weight_epoch == epoch + 1
    assert proof_refusal(registration, address, status.registration_proof) is None
    later = time.time() + PROOF_TTL_S + 120
    assert "expired" in str(proof_refusal(registration, address, status.registration_proof, later))
    anonymous = rollout_pb2_grpc.RolloutStub(channel(address, None, "rollout"))
    generate = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(text="1+1=")])
    assert code_of(anonymous.Generate, generate, timeout=30)[0] == Code.UNAUTHENTICATED
    assert len(reader.Generate(generate, timeout=60).completions) == 1


@contextlib.contextmanager
def replica_process_state(
    rollout: InProcessRollout, security: SecurityConfig, run_secrets: Path
) -> Iterator[tuple[RolloutService, rollout_pb2_grpc.RolloutStub]]:
    """A replica as a fresh process would start it, over the session's engine: its handlers built anew
    from ``security`` (what a restart rereads: keys, and the high-water file), behind a server of its own
    that checks tokens; the trainer's stub to it."""
    service = RolloutService(
        rollout.service.config.model_copy(update={"security": security}), rollout.service.engine
    )
    running = serve_rollout(RolloutServicer(service), security)
    as_trainer = channel(running.address, security_for(run_secrets, "trainer", tls=False), "rollout")
    try:
        yield service, rollout_pb2_grpc.RolloutStub(as_trainer)
    finally:
        as_trainer.close()
        running.stop(0)
        service.close()


def test_a_restarted_replica_refuses_a_replayed_older_update(
    rollout_fp8: InProcessRollout, run_secrets: Path, tmp_path: Path, gen: torch.Generator
) -> None:
    """The high-water mark outlives the replica: an older signed update, captured off the wire and
    replayed after a restart, is refused (FAILED_PRECONDITION naming it and the mark); a newer one
    applies and raises the mark on disk."""
    mark = tmp_path / "state" / "high-water.json"
    security = security_for(run_secrets, "replica", tls=False).model_copy(
        update={"update_high_water_file": mark}
    )
    key = trainer_key(run_secrets)
    weights = build_weight_set(random_state(rollout_fp8.model_dir, 1), "fp8-block128", hp_dtype=torch.float32)
    epoch = 3 * 10**6 + int(torch.randint(0, 1000, (1,), generator=gen))

    def signed(version: int) -> list[weights_pb2.WeightChunk]:  # what a wire tap would have captured
        return list(parts_to_chunks(keyframe_parts(weights, version, part_bytes=1 << 16), epoch, key))

    captured = signed(5)
    with replica_process_state(rollout_fp8, security, run_secrets) as (service, stub):
        assert stub.UpdateWeights(iter(captured), timeout=120).version == 5
        assert stub.UpdateWeights(iter(signed(6)), timeout=120).version == 6
        assert service.version == 6
    assert json.loads(mark.read_text())["epoch"] == epoch and json.loads(mark.read_text())["version"] == 6
    assert mark.stat().st_mode & 0o777 == 0o600 and mark.parent.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in mark.parent.iterdir()) == ["high-water.json", "high-water.json.lock"]

    with replica_process_state(rollout_fp8, security, run_secrets) as (service, stub):  # restarted
        before = service.version
        code, details = code_of(stub.UpdateWeights, iter(captured), timeout=120)
        assert code == Code.FAILED_PRECONDITION, (code, details)
        assert f"keyframe of version 5 (epoch {epoch}) refused" in details, details
        assert f"older than version 6 (epoch {epoch})" in details and str(mark) in details, details
        assert service.version == before and service.held is None  # nothing was decoded or applied
        assert stub.UpdateWeights(iter(signed(7)), timeout=120).version == 7
        assert service.version == 7 and service.held_epoch == epoch
    assert json.loads(mark.read_text())["version"] == 7
    # Without the file (a replica that keeps its mark in memory only), the same replay would apply.
    in_memory = security.model_copy(update={"update_high_water_file": None})
    with replica_process_state(rollout_fp8, in_memory, run_secrets) as (_, stub):
        assert stub.UpdateWeights(iter(captured), timeout=120).version == 5


def test_trainer_publishes_signed_updates_to_a_replica_that_proves_itself(
    secured_replica: tuple[InProcessRollout, str], tiny_model_dir_f32: Path, run_secrets: Path, tmp_path: Path
) -> None:
    rollout, address = secured_replica
    service, running = trainer_server(
        tiny_model_dir_f32, security_for(run_secrets, "trainer", tls=False), tmp_path
    )
    try:
        stub = trainer_stub(running.address, security_for(run_secrets, "coordinator", tls=False))
        proof = rollout.service.registration_proof()
        fence = str(2 * 10**6)  # newer than the epochs other tests left on the replica
        request = trainer_pb2.PublishWeightsRequest(
            version=0, targets=[trainer_pb2.PublishTarget(address=address, held_version=-1, proof=proof)]
        )
        reply = stub.PublishWeights(request, timeout=300, metadata=[("fp8rl-fence", fence)])
        assert reply.results[0].ok, reply.results[0].error
        assert rollout.service.version == 0 and rollout.service.held_epoch == int(fence)
    finally:
        running.stop(0)
        service.publisher.close()


def test_requests_of_refused_callers_are_never_parsed(
    secured_trainer: tuple[TrainerService, str], run_secrets: Path
) -> None:
    """Bytes that are no TrainStepRequest at all: without a token they are refused, not parsed (a parse
    error would be INTERNAL); with the coordinator's token they reach the parser."""
    _, address = secured_trainer
    for security, expected in (
        (None, Code.UNAUTHENTICATED),
        (security_for(run_secrets, "reader", tls=False), Code.PERMISSION_DENIED),
        (security_for(run_secrets, "coordinator", tls=False), Code.INTERNAL),
    ):
        with channel(address, security, "trainer") as chan:
            raw = chan.unary_unary("/fp8rl.v1.Trainer/TrainStep")
            assert code_of(raw, b"\xff\xff\xff garbage", timeout=10)[0] == expected


def test_a_refused_publish_or_an_absurd_fence_moves_nothing(
    secured_trainer: tuple[TrainerService, str], run_secrets: Path
) -> None:
    service, address = secured_trainer
    stub = trainer_stub(address, security_for(run_secrets, "coordinator", tls=False))
    unknown = trainer_pb2.PublishWeightsRequest(
        version=0, targets=[trainer_pb2.PublishTarget(address="203.0.113.5:50051")]
    )
    code = code_of(stub.PublishWeights, unknown, timeout=30, metadata=[("fp8rl-fence", "100")])[0]
    assert code == Code.PERMISSION_DENIED and service.fence == 0  # the fence did not move either
    status = common_pb2.GetStatusRequest()
    code, details = code_of(
        stub.SaveCheckpoint,
        trainer_pb2.SaveCheckpointRequest(),
        timeout=30,
        metadata=[("fp8rl-fence", "9" * 20)],
    )
    assert code == Code.INVALID_ARGUMENT and "fencing token" in details and service.fence == 0
    assert stub.GetStatus(status, timeout=10).step == 0


def test_policy_is_closed_by_default_and_keys_are_checked(run_secrets: Path, tmp_path: Path) -> None:
    control = AccessControl(security_for(run_secrets, "replica", tls=False))
    assert isinstance(control.refusal("/fp8rl.v1.Rollout/SomethingNew", "coordinator"), PermissionDenied)
    assert isinstance(control.refusal("/fp8rl.v1.Rollout/SomethingNew", None), Unauthenticated)
    assert control.refusal("/fp8rl.v1.Rollout/Generate", "reader") is None
    assert isinstance(control.refusal("/fp8rl.v1.Rollout/UpdateWeights", "coordinator"), PermissionDenied)
    opened = AccessControl(
        security_for(run_secrets, "replica", tls=False).model_copy(update={"open_reads": True})
    )
    assert opened.refusal("/fp8rl.v1.Rollout/GetStatus", None) is None
    assert isinstance(opened.refusal("/fp8rl.v1.Rollout/UpdateWeights", None), Unauthenticated)
    short = tmp_path / "short.key"
    short.write_text("00" * 8)
    with pytest.raises(ValueError, match=r"registration_key_file: .* at least 16"):
        SecurityConfig(registration_key_file=short).registration_key()
    tokens_only = SecurityConfig(
        tokens_file=run_secrets / "tokens",
        tls_cert=run_secrets / "replica.pem",
        tls_key=run_secrets / "replica.key",
    )
    assert exposure_problem(tokens_only, "0.0.0.0") is None
    problem = exposure_problem(tokens_only, "0.0.0.0", applies_updates=True)
    assert "update_public_key_file" in str(problem)
    with_key = tokens_only.model_copy(update={"update_public_key_file": run_secrets / "update-verify.pub"})
    assert "update_high_water_file" in str(exposure_problem(with_key, "0.0.0.0", applies_updates=True))


def test_old_or_misplaced_update_keys_are_config_errors_that_say_what_to_do(
    run_secrets: Path, tmp_path: Path
) -> None:
    """A replica still configured as before issue 36 (a symmetric update.key) is refused with the field
    named and the fix; so is one handed the trainer's private key, or a file that is no Ed25519 key."""
    old_key = tmp_path / "update.key"
    old_key.write_text("ab" * 32 + "\n")
    with pytest.raises(ValidationError) as refused:
        SecurityConfig(update_key_file=old_key)
    assert refused.value.errors()[0]["loc"] == ("update_key_file",)
    assert "update_public_key_file" in str(refused.value) and "fp8rl.run_secrets" in str(refused.value)
    misplaced = {
        "holds a symmetric key": old_key,
        "holds a private key": run_secrets / "update-signing.key",
        "is not an Ed25519 key": run_secrets / "replica.pem",
    }
    for why, path in misplaced.items():
        with pytest.raises(ValueError, match=re.escape(f"security.update_public_key_file: {path} {why}")):
            SecurityConfig(update_public_key_file=path).update_public_key()
    with pytest.raises(ValueError, match=r"security\.update_signing_key_file: .* is not an Ed25519 key"):
        SecurityConfig(update_signing_key_file=run_secrets / "trainer.key").update_signing_key()  # (ECDSA)
    # The real command line, before vLLM is imported: the old YAML, then the old key under the new field.
    old_yaml = tmp_path / "rollout.yaml"
    old_yaml.write_text(f"security:\n  update_key_file: {old_key}\n")
    new_field = f"security.update_public_key_file={old_key}"
    for args in (["--config", str(old_yaml)], ["--set", new_field]):
        done = subprocess.run(
            [sys.executable, "-m", "rollout_service.cli", "serve", "--port", "0", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        assert "update_key_file" in done.stderr or "update_public_key_file" in done.stderr, done.stderr
        assert "update-verify.pub" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_certificates_name_their_role_only_and_bundles_leave_the_ca_key(
    run_secrets: Path, tmp_path: Path
) -> None:
    from cryptography import x509

    for role in ("trainer", "replica", "coordinator"):
        cert = x509.load_pem_x509_certificate((run_secrets / f"{role}.pem").read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.DNSName) == [role] and not names.get_values_for_type(
            x509.IPAddress
        )
    for role, files in BUNDLES.items():
        export_bundle(run_secrets, role, tmp_path / role)
        exported = {p.name for p in (tmp_path / role).iterdir()}
        assert exported == set(files) and "ca.key" not in exported
        assert all((tmp_path / role / name).stat().st_mode & 0o777 == 0o600 for name in exported)


def test_the_http_endpoint_takes_the_same_tokens_over_https(
    rollout_fp8: InProcessRollout, run_secrets: Path
) -> None:
    import ssl

    import httpx

    from rollout_service.openai_face import HttpServer, build_app

    security = security_for(run_secrets, "replica", tls=True)
    server = HttpServer("127.0.0.1", 0).serve(build_app(rollout_fp8.service, "tiny", security), security)
    try:
        trust = ssl.create_default_context(cafile=str(run_secrets / "ca.pem"))
        url = f"https://127.0.0.1:{server.port}/v1/models"
        as_replica = {"sni_hostname": "replica"}  # the name its certificate shows, as gRPC clients check
        reader = token_path(run_secrets, "reader").read_text().strip()
        with httpx.Client(verify=trust) as client:
            assert client.get(url, extensions=as_replica).status_code == 401
            forged = client.get(url, headers={"Authorization": "Bearer forged"}, extensions=as_replica)
            assert forged.status_code == 401 and forged.json()["error"]["type"] == "authentication_error"
            ok = client.get(url, headers={"Authorization": f"Bearer {reader}"}, extensions=as_replica)
            assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny"
            episode = url.replace("/v1/models", "/episodes/e1")
            for method in ("GET", "DELETE"):
                assert client.request(method, episode, extensions=as_replica).status_code == 401
            turn = client.post(f"{episode}/v1/completions", json={}, extensions=as_replica)
            assert turn.status_code == 401
            unknown = client.get(
                episode, headers={"Authorization": f"Bearer {reader}"}, extensions=as_replica
            )
            assert unknown.status_code == 404
        # The coordinator plays an environment's episodes there with its own token, over TLS to the name
        # the replica's certificate shows.
        from coordinator.environments import EpisodeRunner
        from fp8rl.v1 import common_pb2
        from tests.envs.arith_retry import ArithRetry

        env = ArithRetry(seed=0)
        spec = "tests.envs.arith_retry:ArithRetry"  # (its episodes play in a worker, with the token file)
        runner = EpisodeRunner(spec, 0, security_for(run_secrets, "coordinator", tls=True))
        failures: list[Exception] = []
        try:
            [played] = runner.play(
                [(env.train_problems(0, 1)[0], 1)],
                common_pb2.SamplingParams(temperature=1.0, max_tokens=4),
                rollout_fp8.service.version,
                {"replica-grpc": f"127.0.0.1:{server.port}"},
                "tls-run",
                lambda _, exc: failures.append(exc),
            )
        finally:
            runner.close()
        assert not failures and played.turns >= 1 and len(played.recorded["samples"]) == 1
        with (
            httpx.Client(verify=ssl.create_default_context()) as untrusting,
            pytest.raises(httpx.ConnectError),
        ):
            untrusting.get(url, extensions=as_replica)  # a certificate of the run's own CA, nobody else's
    finally:
        server.stop()


class RoleEcho(rollout_pb2_grpc.RolloutServicer):
    """Answers each Generate with the role it was served as (``caller_role``), as a completion's text."""

    def Generate(self, request: Any, context: grpc.ServicerContext) -> rollout_pb2.GenerateResponse:
        completion = rollout_pb2.Completion(text=str(caller_role()))
        return rollout_pb2.GenerateResponse(completions=[completion])

    def GenerateStream(self, request: Any, context: grpc.ServicerContext) -> Iterator[rollout_pb2.Completion]:
        yield rollout_pb2.Completion(text=str(caller_role()))


@pytest.mark.parametrize("tls", [False, True], ids=["tokens", "certificates"])
def test_a_call_is_served_as_its_callers_role(run_secrets: Path, tls: bool) -> None:
    """By token or by verified certificate, the servicer knows whose call it serves (the run's own calls
    come before readers': rollout_service.generation); nothing of one call's role stays for the next."""
    running = serve_rollout(RoleEcho(), security_for(run_secrets, "replica", tls=tls))
    try:
        for role in ("coordinator", "reader", "coordinator"):
            caller = security_for(run_secrets, role, tls=tls)
            if tls:
                caller = caller.model_copy(update={"token_file": None})  # the certificate alone
            stub = rollout_pb2_grpc.RolloutStub(channel(running.address, caller, "rollout"))
            request = rollout_pb2.GenerateRequest()
            assert stub.Generate(request, timeout=10).completions[0].text == role
            assert [c.text for c in stub.GenerateStream(request, timeout=10)] == [role]
    finally:
        running.stop(0)


def test_the_http_face_serves_the_runs_own_calls_first(
    rollout_fp8: InProcessRollout, run_secrets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import httpx

    from rollout_service.openai_face import HttpServer, build_app

    service = rollout_fp8.service
    asked: list[bool] = []
    generate = service.generate

    def recorded(request: Any, stream: bool = False, run: bool = False) -> Any:
        asked.append(run)
        return generate(request, stream, run)

    monkeypatch.setattr(service, "generate", recorded)
    security = security_for(run_secrets, "replica", tls=False)
    server = HttpServer("127.0.0.1", 0).serve(build_app(service, "tiny", security))
    try:
        body = {"model": "tiny", "prompt": "12+34=", "max_tokens": 2}
        for role in ("coordinator", "reader"):
            token = token_path(run_secrets, role).read_text().strip()
            answer = httpx.post(
                f"http://127.0.0.1:{server.port}/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {token}"},
                timeout=60,
            )
            assert answer.status_code == 200, answer.text
    finally:
        server.stop()
    assert asked == [True, False]
