"""The trainer's side of a replica's device plane (fp8rl/codec/device_planes.py): a broadcast group with
that replica's workers, formed on first use through the replica's ``JoinWeightTransfer``, and each
update sent whole over it as a keyframe. The plan goes first, signed, in ``UpdateWeightsOnDevice``; the
replica answers ``receiving`` once it passed every check, and only then are its buckets broadcast; it
answers ``applied`` once its engine serves them. gRPC stays the control plane (versions, signatures,
refusals); the publisher falls back to it where this fails."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fp8rl.codec import device_planes as planes
from fp8rl.codec.weight_set import WeightSet
from fp8rl.security import sign_update
from fp8rl.v1 import rollout_pb2_grpc, weights_pb2


@dataclass(frozen=True)
class DevicePayload:
    """One update as every device plane of a publish sends it: the tensors on the trainer's device, their
    plan (fingerprints, digests) and the signed request naming it. Built once per publish."""

    named: list[tuple[str, torch.Tensor]]
    info: planes.UpdateInfo
    request: weights_pb2.DeviceUpdate

    @classmethod
    def build(
        cls,
        weights: WeightSet,
        version: int,
        epoch: int,
        recipe: str,
        signer: Ed25519PrivateKey | None,
        device: torch.device,
        bucket_bytes: int = planes.DEFAULT_BUCKET_BYTES,
    ) -> DevicePayload:
        named = [(n, t.to(device)) for n, t in planes.named_tensors(weights.tensors.items())]
        info = planes.plan_update(named, device, bucket_bytes)
        plan = json.dumps(planes.to_json_dict(info), sort_keys=True).encode()
        header = weights_pb2.WeightHeader(
            version=version,
            base_version=-1,
            encoding=planes.DEVICE_KEYFRAME,
            total_bytes=len(plan),
            format=weights.format,
            recipe=recipe,
            epoch=epoch,
            part=0,
            parts=1,
        )
        if signer is not None:
            header.signature = sign_update(signer, header, [plan])
        return cls(named, info, weights_pb2.DeviceUpdate(header=header, plan=plan))


class DevicePlane:
    """One replica's broadcast group: rank 0 here, its ``ranks`` workers after it."""

    def __init__(
        self,
        address: str,
        stub: rollout_pb2_grpc.RolloutStub,
        ranks: int,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        """Form the group: returns once the replica's workers joined; raises as soon as the replica
        refuses to join (the half-formed group is then dropped)."""
        self.stub, self.timeout_s = stub, timeout_s
        host = address.rsplit(":", 1)[0].strip("[]")
        backend = "nccl" if device.type == "cuda" else "gloo"
        here = planes.route_address(host)
        self.sender = planes.BroadcastSender.listen(here, 1 + ranks, 1, backend, device, timeout_s)
        join = weights_pb2.WeightTransferJoin(**dataclasses.asdict(self.sender.init))
        # The group forms on a thread of its own (it waits for the replica's workers); the replica's
        # answer decides: a refusal ends this at once, not when the group gives up.
        forming: Future[None] = Future()
        threading.Thread(target=_settle, args=(forming, self.sender.trainer_init), daemon=True).start()
        with ThreadPoolExecutor(1) as pool:
            try:
                pool.submit(stub.JoinWeightTransfer, join, timeout=timeout_s).result()
                forming.result(timeout=timeout_s)
            except BaseException:
                self.sender.shutdown()
                raise

    def send(self, payload: DevicePayload, deadline_s: float) -> weights_pb2.UpdateWeightsResponse:
        """The update: its plan, then (once the replica is receiving) its buckets; the replica's answer
        once it serves them. Raises grpc.RpcError where the replica refused (before a byte was sent)."""
        replies: Any = self.stub.UpdateWeightsOnDevice(payload.request, timeout=deadline_s)  # (a grpc call)
        first = next(replies)
        if first.WhichOneof("stage") != "receiving":
            raise RuntimeError(f"the replica answered {first.WhichOneof('stage')} before receiving")
        try:
            self.sender.send_weights(payload.named, payload.info)
        except BaseException:
            replies.cancel()
            raise
        done = next(replies)
        if done.WhichOneof("stage") != "applied":
            raise RuntimeError(f"the replica answered {done.WhichOneof('stage')} after the broadcast")
        return done.applied

    def close(self) -> None:
        self.sender.shutdown()


def _settle(future: Future[None], work: Callable[[], None]) -> None:
    try:
        work()
        future.set_result(None)
    except BaseException as exc:
        future.set_exception(exc)
