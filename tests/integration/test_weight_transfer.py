"""A replica's device plane as vLLM's own weight-transfer engine (rollout_service/vllm_transfer.py): a
real vLLM engine on CPU built with ``weight_transfer_config={"backend": "fp8rl-broadcast"}`` joins a
trainer's group and takes an FP8 update broadcast over Gloo (the code NCCL runs on GPUs), driven through
vLLM's own worker methods. It then computes with exactly what a gRPC refit of the same update gives,
and a plan that does not match the bytes is refused with nothing loaded. End to end, the trainer's
Publisher sends each update over the replica's device plane through its gRPC control plane
(``JoinWeightTransfer``, ``UpdateWeightsOnDevice``), and a plane that breaks leaves the update to gRPC."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, replace
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from fp8rl.codec import device_planes as planes
from fp8rl.codec.schema import build_weight_set
from fp8rl.codec.weight_set import WeightSet
from fp8rl.v1 import common_pb2, weights_pb2
from rollout_service.config import RolloutConfig
from rollout_service.engine import VllmEngine
from rollout_service.vllm_transfer import UpdateInfo
from tests.conftest import InProcessRollout, in_process_rollout
from tests.integration.test_compiled_replica import perturbed
from tests.integration.test_rollout import assert_engine_holds
from trainer_service.publisher import Publisher, Target


def greedy(engine: VllmEngine, prompt: list[int]) -> tuple[list[int], list[float]]:
    from vllm import SamplingParams

    out = engine.llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=0),
        use_tqdm=False,
    )[0].outputs[0]
    return list(out.token_ids), [p[t].logprob for p, t in zip(out.logprobs, out.token_ids, strict=True)]


def same_parameters(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
    )


@pytest.fixture(scope="session")
def replica(tiny_model_dir_f32: Path) -> Iterator[InProcessRollout]:
    """A replica whose engine takes updates over its device plane, behind a real gRPC server. Kept for the
    session, as the other in-process engines are: vLLM's process-wide parallel state goes with an engine
    torn down, and one torn down mid-session can take it from under another being built."""
    config = RolloutConfig(
        model=tiny_model_dir_f32,
        recipe="fp8",
        dtype="float32",
        device="cpu",
        port=0,
        max_model_len=256,
        weight_transfer="fp8rl-broadcast",
    )
    with in_process_rollout(config) as rollout:
        yield rollout


def test_a_replica_takes_a_broadcast_update_through_vllms_weight_transfer_engine(
    replica: InProcessRollout, gen: torch.Generator
) -> None:
    engine, tiny_model_dir_f32 = replica.service.engine, replica.model_dir
    sender = planes.BroadcastSender.listen(
        "127.0.0.1", world_size=2, backend="gloo", device="cpu", timeout_s=120
    )
    base = load_file(tiny_model_dir_f32 / "model.safetensors")
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    sets = [build_weight_set(s, "fp8-block128", torch.float32) for s in (base, perturbed(base, seed))]
    named = [planes.named_tensors(s.tensors.items()) for s in sets]
    prompt = [3, 14, 15, 9, 2, 6, 5, 3, 5, 8]
    try:
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(
                engine.join_device_plane,
                {
                    k: getattr(sender.init, k)
                    for k in (
                        "master_address",
                        "master_port",
                        "rank_offset",
                        "world_size",
                        "backend",
                        "timeout_s",
                    )
                },
            )
            sender.trainer_init()
            joined.result(timeout=120)
            before = greedy(engine, prompt)

            info = sender.plan(named[1], bucket_bytes=256 << 10)  # (several buckets)
            assert {f.name for f in fields(UpdateInfo)} == set(planes.to_json_dict(info))  # (vLLM's dict)
            assert len(planes.plan_buckets(info)) > 2
            loading = pool.submit(engine.load_from_device_plane, planes.to_json_dict(info))
            sender.send_weights(named[1], info)
            loading.result(timeout=120)
            broadcast = engine.named_parameters(), greedy(engine, prompt)
            assert broadcast[1] != before  # (another model: its logprobs moved)

            # The same update by the gRPC path's refit, from the starting weights: the same engine state.
            engine.load_weights(sets[0].tensors)
            assert greedy(engine, prompt) == before
            engine.load_weights(sets[1].tensors)
            assert same_parameters(engine.named_parameters(), broadcast[0])
            assert greedy(engine, prompt) == broadcast[1]

            # A plan whose fingerprint does not match what is broadcast: refused, nothing loaded.
            info0 = sender.plan(named[0], bucket_bytes=256 << 10)
            damaged = replace(info0, fingerprints=(info0.fingerprints[0] ^ 1, *info0.fingerprints[1:]))
            loading = pool.submit(engine.load_from_device_plane, planes.to_json_dict(damaged))
            sender.send_weights(named[0], info0)
            with pytest.raises(Exception, match="did not arrive as sent"):
                loading.result(timeout=120)
            assert same_parameters(engine.named_parameters(), broadcast[0])
            assert greedy(engine, prompt) == broadcast[1]

            # ... and the next update lands: the refusal ended every worker's update session.
            loading = pool.submit(engine.load_from_device_plane, planes.to_json_dict(info0))
            sender.send_weights(named[0], info0)
            loading.result(timeout=120)
            assert greedy(engine, prompt) == before
    finally:
        sender.shutdown()
        engine.llm.collective_rpc("shutdown_weight_transfer_engine")


def test_the_publisher_sends_each_update_over_the_replicas_device_plane_and_grpc_where_it_breaks(
    replica: InProcessRollout, gen: torch.Generator
) -> None:
    address = replica.server.address
    status = replica.stub.GetStatus(common_pb2.GetStatusRequest(), timeout=10)
    assert (status.weight_transfer, status.weight_transfer_ranks) == ("fp8rl-broadcast", 1)
    base = load_file(replica.model_dir / "model.safetensors")
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    sets = [build_weight_set(perturbed(base, seed + i), "fp8-block128", torch.float32) for i in range(3)]
    publisher = Publisher(
        "fp8-block128",
        torch.float32,
        "fp8",
        shared_memory=False,
        tcp_streams=0,
        weight_transfer=True,
        transfer_timeout_s=10,
    )
    try:
        for version in (40, 41):
            [delivery] = publisher.publish(
                version, dict, [Target(address, version - 1)], built=sets[version - 40]
            )
            assert delivery.ok and (delivery.encoding, delivery.plane) == ("keyframe", "device"), delivery
            assert 0 < delivery.apply_s < delivery.seconds
            assert replica.service.version == version
            assert_engine_holds(replica, sets[version - 40])
        assert len(publisher._device_planes) == 1  # (one group, formed once)

        # The trainer's end of the group goes away: the replica, receiving, sees its peer gone (or its
        # collective times out), refuses the update with its weights as they were, and the same update
        # goes over gRPC.
        publisher._device_planes[address].close()
        [delivery] = publisher.publish(42, dict, [Target(address, 41)], built=sets[2])
        assert delivery.ok and delivery.plane == "grpc" and delivery.encoding == "keyframe", delivery
        assert replica.service.version == 42
        assert_engine_holds(replica, sets[2])
    finally:
        publisher.close()


def test_a_plan_the_replica_refuses_is_refused_before_a_byte_is_broadcast(
    replica: InProcessRollout, gen: torch.Generator
) -> None:
    """A plan that is not the model's (a tensor missing) is refused by the replica's checks, so the trainer
    never broadcasts (no collective waits for its timeout); a join that names another host's store, or
    an unbounded wait, is refused."""
    address = replica.server.address
    ws = build_weight_set(load_file(replica.model_dir / "model.safetensors"), "fp8-block128", torch.float32)
    partial = WeightSet(ws.format, dict(list(ws.tensors.items())[1:]))
    publisher = Publisher(
        "fp8-block128",
        torch.float32,
        "fp8",
        shared_memory=False,
        tcp_streams=0,
        weight_transfer=True,
        transfer_timeout_s=60,
    )
    try:
        started = time.monotonic()
        [delivery] = publisher.publish(50, dict, [Target(address, -1)], built=partial)
        assert not delivery.ok and "names" in delivery.error, delivery  # (gRPC refuses it too)
        assert time.monotonic() - started < 30  # (not the group's 60 s)
        assert replica.service.version != 50
    finally:
        publisher.close()
    join = weights_pb2.WeightTransferJoin(
        master_address="10.9.8.7", master_port=1234, rank_offset=1, world_size=2, backend="gloo", timeout_s=10
    )
    for bad, field in (
        (join, "master_address"),
        (_with(join, master_address="127.0.0.1", timeout_s=float("nan")), "timeout_s"),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            replica.stub.JoinWeightTransfer(bad, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in refused.value.details()


def _with(message: weights_pb2.WeightTransferJoin, **fields: object) -> weights_pb2.WeightTransferJoin:
    changed = weights_pb2.WeightTransferJoin()
    changed.CopyFrom(message)
    for name, value in fields.items():
        setattr(changed, name, value)
    return changed
