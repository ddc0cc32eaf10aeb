"""The trainer's side of a replica's device plane (fp8rl/codec/device_planes.py): a broadcast group with
that replica's workers, formed on first use through the replica's ``JoinWeightTransfer``, and each
update sent whole over it as a keyframe: the plan goes, signed, in ``UpdateWeightsOnDevice`` while its
buckets are broadcast, and the replica answers once its engine serves the new version. gRPC stays the
control plane (versions, signatures, refusals); the publisher falls back to it where this fails."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fp8rl.codec import device_planes as planes
from fp8rl.codec.weight_set import WeightSet
from fp8rl.security import sign_update
from fp8rl.v1 import rollout_pb2_grpc, weights_pb2

BROADCAST = "fp8rl-broadcast"  # the replica's weight_transfer this side speaks


class DevicePlane:
    """One replica's broadcast group: rank 0 here, its ``ranks`` workers after it."""

    def __init__(
        self,
        address: str,
        stub: rollout_pb2_grpc.RolloutStub,
        ranks: int,
        device: torch.device,
        timeout_s: float,
        bucket_bytes: int = planes.DEFAULT_BUCKET_BYTES,
    ) -> None:
        """Form the group (blocks until the replica's workers have joined; raises where they do not)."""
        self.stub, self.device, self.timeout_s, self.bucket_bytes = stub, device, timeout_s, bucket_bytes
        host = address.rsplit(":", 1)[0].strip("[]")
        backend = "nccl" if device.type == "cuda" else "gloo"
        here = planes.route_address(host)
        self.sender = planes.BroadcastSender.listen(here, 1 + ranks, 1, backend, device, timeout_s)
        init = self.sender.init
        join = weights_pb2.WeightTransferJoin(
            master_address=init.master_address,
            master_port=init.master_port,
            rank_offset=init.rank_offset,
            world_size=init.world_size,
            backend=init.backend,
            timeout_s=init.timeout_s,
        )
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(stub.JoinWeightTransfer, join, timeout=timeout_s)
            try:
                self.sender.trainer_init()
            except BaseException:
                joined.cancel()
                raise
            joined.result()

    def send(
        self,
        weights: WeightSet,
        version: int,
        epoch: int,
        recipe: str,
        signer: Ed25519PrivateKey | None,
        deadline_s: float,
    ) -> weights_pb2.UpdateWeightsResponse:
        """``weights`` as a keyframe of ``version``: the replica's reply, once it serves them. Raises
        grpc.RpcError where the replica refused (the broadcast is then abandoned with the group)."""
        named = [(n, t.to(self.device)) for n, t in planes.named_tensors(weights.tensors.items())]
        info = self.sender.plan(named, self.bucket_bytes)
        plan = json.dumps(planes.to_json_dict(info), sort_keys=True).encode()
        header = weights_pb2.WeightHeader(
            version=version,
            base_version=-1,
            encoding="keyframe",
            total_bytes=len(plan),
            format=weights.format,
            recipe=recipe,
            epoch=epoch,
            part=0,
            parts=1,
        )
        if signer is not None:
            header.signature = sign_update(signer, header, [plan])
        failure: list[BaseException] = []

        def broadcast() -> None:
            try:
                self.sender.send_weights(named, info)
            except BaseException as exc:  # (the reply says what happened; this only explains it)
                failure.append(exc)

        # The buckets go on a thread of their own: a replica that refuses before it receives answers at
        # once, and the group (left waiting until its timeout) is dropped with this plane.
        sending = threading.Thread(target=broadcast, name="device-plane-broadcast", daemon=True)
        sending.start()
        request = weights_pb2.DeviceUpdate(header=header, plan=plan)
        reply: weights_pb2.UpdateWeightsResponse = self.stub.UpdateWeightsOnDevice(
            request, timeout=deadline_s
        )
        sending.join(timeout=self.timeout_s)
        if failure or sending.is_alive():
            raise RuntimeError(f"the broadcast did not finish: {failure[0] if failure else 'still sending'}")
        return reply

    def close(self) -> None:
        self.sender.shutdown()
