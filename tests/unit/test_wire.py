"""The wire contract: committed stubs match the .proto files, weight streams fit gRPC's limits, and
every server carries health and reflection."""

from __future__ import annotations

import filecmp
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from fp8rl.codec.encode import delta_parts, keyframe_parts
from fp8rl.codec.stream import decode_parts, parts_to_chunks, receive_parts, update_to_chunks
from fp8rl.codec.testing import decode_update, encode_keyframe
from fp8rl.codec.weight_set import WeightSet
from fp8rl.errors import CorruptUpdateError
from fp8rl.serving import map_errors, read_ahead, start_server
from fp8rl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2_grpc, weights_pb2

ROOT = Path(__file__).resolve().parents[2]
GRPC_DEFAULT_LIMIT = 4 * 1024 * 1024


def test_committed_stubs_match_protos(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True
    )
    fresh, committed = tmp_path / "fp8rl" / "v1", ROOT / "fp8rl" / "v1"
    generated = sorted(p.name for p in fresh.iterdir())
    assert generated == sorted(p.name for p in committed.glob("*_pb2*")), "stub files added or removed"
    _, mismatch, errors = filecmp.cmpfiles(fresh, committed, generated, shallow=False)
    assert not mismatch and not errors, f"stale stubs {mismatch + errors}: run `make protos` and commit"


def test_services_have_the_contracted_methods() -> None:
    rollout = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"]
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in rollout.methods}
    assert methods == {
        "Generate": (False, False),
        "GenerateStream": (False, True),
        "UpdateWeights": (True, False),
        "GetStatus": (False, False),
        "JoinWeightTransfer": (False, False),
        "UpdateWeightsOnDevice": (False, True),
    }
    from fp8rl.v1 import trainer_pb2

    trainer = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"]
    assert {m.name for m in trainer.methods} == {
        "TrainStep",
        "ComputeLogprobs",
        "PublishWeights",
        "SaveCheckpoint",
        "GetStatus",
    }
    prompt = rollout_pb2.Prompt(id="p", token_ids=rollout_pb2.TokenIds(ids=[1, 2]))
    assert prompt.WhichOneof("input") == "token_ids"


def big_weight_set(gen: torch.Generator) -> WeightSet:
    return WeightSet("bf16", {f"w{i}": torch.randn(1024, 1024, generator=gen).bfloat16() for i in range(5)})


def test_a_chat_prompt_reads_naturally_in_json_and_keeps_its_field_number() -> None:
    """{"chat": {"messages": [...]}} (not {"messages": {"messages": ...}}); field 4 as before the rename,
    so bytes written by an older client parse."""
    from google.protobuf import json_format

    request = json_format.Parse(
        '{"prompts": [{"chat": {"messages": [{"role": "user", "content": "12+34="}]}}]}',
        rollout_pb2.GenerateRequest(),
    )
    prompt = request.prompts[0]
    assert prompt.WhichOneof("input") == "chat" and prompt.chat.messages[0].content == "12+34="
    assert rollout_pb2.Prompt.DESCRIPTOR.fields_by_name["chat"].number == 4
    # Field 4, length-delimited, holding one ChatMessage (field 1) {role "user", content "hi"}.
    older = bytes([0x22, 0x0C, 0x0A, 0x0A, 0x0A, 0x04]) + b"user" + bytes([0x12, 0x02]) + b"hi"
    assert rollout_pb2.Prompt.FromString(older).chat.messages[0].role == "user"


def test_weight_stream_round_trip_within_message_limit(gen: torch.Generator) -> None:
    ws = big_weight_set(gen)
    update = encode_keyframe(ws, version=3, recipe="bf16")
    chunks = list(update_to_chunks(update))
    assert chunks[0].WhichOneof("part") == "header" and len(chunks) > 2
    assert all(c.ByteSize() <= GRPC_DEFAULT_LIMIT for c in chunks)
    ((header, blob),) = receive_parts(chunks)
    assert (header.version, header.base_version, header.encoding) == (3, -1, "keyframe")
    assert (header.part, header.parts) == (0, 1)
    assert header.total_bytes == len(blob) == update.wire_bytes
    assert decode_update(blob).weights.digest == ws.digest


def test_an_update_streams_in_parts_each_applied_as_it_arrives(gen: torch.Generator) -> None:
    """Parts of about 2 MiB: each is handed on as soon as it is whole (when the next part's header
    arrives), not when the stream ends."""
    ws = big_weight_set(gen)  # five 2 MiB tensors
    chunks = list(parts_to_chunks(keyframe_parts(ws, version=3, part_bytes=2 << 20), epoch=2))
    headers = [c.header for c in chunks if c.WhichOneof("part") == "header"]
    assert [(h.part, h.parts, h.epoch) for h in headers] == [(i, 5, 2) for i in range(5)]
    read = 0

    def counted() -> Iterator[weights_pb2.WeightChunk]:
        nonlocal read
        for chunk in chunks:
            read += 1
            yield chunk

    seen = []
    for header, blob in receive_parts(counted()):
        seen.append((header.part, read))
        assert header.total_bytes == len(blob)
    # Part i is yielded once its data is in and the next header read, never later.
    starts = [i for i, c in enumerate(chunks) if c.WhichOneof("part") == "header"]
    assert [r for _, r in seen] == [*(s + 1 for s in starts[1:]), len(chunks)]
    decoded, received = decode_parts(receive_parts(chunks))
    assert decoded.weights.digest == ws.digest and received == sum(h.total_bytes for h in headers)

    base = WeightSet.verified(
        ws.format, {n: t.clone() for n, t in ws.tensors.items()}, ws.tensor_digests, owned=True
    )
    new = WeightSet(ws.format, {n: t + 1 if n in ("w1", "w3") else t for n, t in ws.tensors.items()})
    delta = list(parts_to_chunks(delta_parts(new, ws, 4, 3, part_bytes=2 << 20)))
    decoded, _ = decode_parts(receive_parts(delta), base, 3)
    assert decoded.weights.digest == new.digest and decoded.tensors_updated == 2


def test_read_ahead_reads_one_item_ahead_raises_in_turn_and_stops_when_closed() -> None:
    read: list[int] = []

    def items(fail_at: int | None = None) -> Iterator[int]:
        for i in range(100):
            if i == fail_at:
                raise ConnectionError("stream broke")
            read.append(i)
            yield i

    others = set(threading.enumerate())
    ahead = read_ahead(items())
    assert next(ahead) == 0
    (reader,) = [t for t in threading.enumerate() if t not in others and t.name == "read-ahead"]
    deadline = time.monotonic() + 10
    while len(read) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert read == [0, 1, 2] and reader.is_alive()  # 1 waits in the queue, 2 to be put: no further
    ahead.close()
    reader.join(timeout=5)
    assert not reader.is_alive() and read == [0, 1, 2]
    read.clear()
    failing = read_ahead(items(fail_at=2))
    assert [next(failing), next(failing)] == [0, 1]
    with pytest.raises(ConnectionError, match="stream broke"):
        next(failing)


def test_weight_stream_rejects_malformed_streams(gen: torch.Generator) -> None:
    ws = big_weight_set(gen)
    chunks = list(update_to_chunks(encode_keyframe(ws, version=1)))
    header, data = chunks[0], chunks[1:]
    parted = list(parts_to_chunks(keyframe_parts(ws, version=1, part_bytes=4 << 20)))
    starts = [i for i, c in enumerate(parted) if c.WhichOneof("part") == "header"]
    assert len(starts) == 3
    other = list(parts_to_chunks(keyframe_parts(ws, version=2, part_bytes=4 << 20)))
    no_parts = weights_pb2.WeightChunk(header=weights_pb2.WeightHeader())
    no_parts.header.CopyFrom(header.header)
    no_parts.header.parts = 0
    cases = {
        "no header": data,
        "empty": [],
        "two headers": [header, header, *data],
        "truncated": [header, *data[:-1]],
        "reordered": [header, data[1], data[0], *data[2:]],
        "corrupted": [header, weights_pb2.WeightChunk(data=b"\0" + data[0].data[1:]), *data[1:]],
        "zero parts": [no_parts, *data],
        "a part missing at the end": parted[: starts[2]],
        "a part missing in the middle": parted[: starts[1]] + parted[starts[2] :],
        "parts swapped": parted[starts[1] : starts[2]] + parted[: starts[1]] + parted[starts[2] :],
        "a part of another update": parted[: starts[1]] + other[starts[1] : starts[2]] + parted[starts[2] :],
        "a part after the last": [*parted, *parted[starts[2] :]],
    }
    for name, stream in cases.items():
        with pytest.raises(CorruptUpdateError):
            for _ in receive_parts(stream):
                pass
        print("rejected:", name)


def test_servers_expose_health_and_reflection() -> None:
    running = start_server(
        lambda s: (
            rollout_pb2_grpc.add_RolloutServicer_to_server(rollout_pb2_grpc.RolloutServicer(), s),
            trainer_pb2_grpc.add_TrainerServicer_to_server(trainer_pb2_grpc.TrainerServicer(), s),
        ),
        ["fp8rl.v1.Rollout", "fp8rl.v1.Trainer"],
    )
    try:
        assert running.port > 0
        with grpc.insecure_channel(running.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            check = lambda name: health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status  # noqa: E731
            assert check("fp8rl.v1.Rollout") == health_pb2.HealthCheckResponse.NOT_SERVING
            running.set_serving()
            assert check("") == check("fp8rl.v1.Rollout") == health_pb2.HealthCheckResponse.SERVING
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
            [reply] = list(
                reflect.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
                )
            )
            names = {s.name for s in reply.list_services_response.service}
            assert {"fp8rl.v1.Rollout", "fp8rl.v1.Trainer", "grpc.health.v1.Health"} <= names
    finally:
        running.stop(0)


class Escaped(BaseException):
    """Not an Exception, not an exit: what torch.distributed.checkpoint raises for a failed save."""


class EscapingTrainer(trainer_pb2_grpc.TrainerServicer):
    @map_errors
    def GetStatus(self, request: object, context: grpc.ServicerContext) -> object:
        raise Escaped("the disk is full")


class EscapingRollout(rollout_pb2_grpc.RolloutServicer):
    @map_errors
    def GenerateStream(self, request: object, context: grpc.ServicerContext) -> Iterator[object]:
        raise Escaped("the engine is gone")
        yield  # (a streaming method)


def test_a_base_exception_in_a_handler_is_answered_internal_not_left_to_the_deadline() -> None:
    running = start_server(
        lambda s: (
            trainer_pb2_grpc.add_TrainerServicer_to_server(EscapingTrainer(), s),
            rollout_pb2_grpc.add_RolloutServicer_to_server(EscapingRollout(), s),
        ),
        ["fp8rl.v1.Trainer", "fp8rl.v1.Rollout"],
    )
    try:
        with grpc.insecure_channel(running.address) as channel:
            for call, text in (
                (
                    lambda: trainer_pb2_grpc.TrainerStub(channel).GetStatus(
                        common_pb2.GetStatusRequest(), timeout=30
                    ),
                    "the disk is full",
                ),
                (
                    lambda: list(
                        rollout_pb2_grpc.RolloutStub(channel).GenerateStream(
                            rollout_pb2.GenerateRequest(), timeout=30
                        )
                    ),
                    "the engine is gone",
                ),
            ):
                started = time.monotonic()
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.INTERNAL and text in err.value.details()
                assert time.monotonic() - started < 10  # answered, not timed out
    finally:
        running.stop(0)
