"""The device planes (fp8rl/codec/device_planes.py) as vLLM weight-transfer engines, registered with
vLLM's ``WeightTransferEngineFactory`` as ``fp8rl-broadcast`` (NCCL between GPUs, Gloo between CPUs) and
``fp8rl-ipc`` (CUDA IPC on one host). An engine built with
``weight_transfer_config={"backend": "fp8rl-broadcast"}`` is then driven as vLLM documents
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``, ``finish_weight_update``,
through ``collective_rpc`` on every worker), and the trainer's side is
:class:`~fp8rl.codec.device_planes.BroadcastSender` / :class:`~fp8rl.codec.device_planes.IpcSender`.

Unlike vLLM's own engines, an update is taken whole into buffers of the worker's and checked (every
bucket's fingerprint) before one weight is loaded, and then refit as a gRPC update is: vLLM's in-place
``reload_weights`` from checkpoint-format tensors (FP8 codes with their block scales), the tied output
layer processed again. A refused update leaves the weights as they were.

Imported by the worker extension (rollout_service/worker_extension.py), so that every worker process
has the engines registered before vLLM builds its engine.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload.inplace import reload_weights

from fp8rl.codec import device_planes as planes
from rollout_service.worker_extension import rederive_tied_head

BROADCAST, IPC = "fp8rl-broadcast", "fp8rl-ipc"


@dataclass
class BroadcastInitInfo(WeightTransferInitInfo):
    """:class:`~fp8rl.codec.device_planes.BroadcastInit`'s fields, as vLLM's init dicts carry them."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "nccl"
    timeout_s: float = 300.0


@dataclass
class IpcInitInfo(WeightTransferInitInfo):
    pass


@dataclass
class UpdateInfo(WeightTransferUpdateInfo):
    """:class:`~fp8rl.codec.device_planes.UpdateInfo`'s fields (lists where JSON gives lists)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed_buffer_size_bytes: int = planes.DEFAULT_BUCKET_BYTES
    fingerprints: list[int | str] | None = None
    ipc_handles: list[dict[str, dict[str, Any]]] | None = None

    def plan(self) -> planes.UpdateInfo:
        return planes.UpdateInfo(
            tuple(self.names),
            tuple(self.dtype_names),
            tuple(tuple(int(d) for d in shape) for shape in self.shapes),
            int(self.packed_buffer_size_bytes),
            tuple(int(f) for f in self.fingerprints or ()),
            tuple(self.ipc_handles or ()),
        )


def update_info_dict(info: planes.UpdateInfo) -> dict[str, Any]:
    """What a trainer passes as ``update_info`` (fingerprints as strings: 128-bit integers)."""
    out: dict[str, Any] = {f.name: getattr(info, f.name) for f in fields(info)}
    out["fingerprints"] = [str(f) for f in info.fingerprints]
    out["ipc_handles"] = list(info.ipc_handles) or None
    return out


class _DevicePlaneEngine(WeightTransferEngine):
    update_info_cls = UpdateInfo
    receiver: Any = None

    def start_weight_update(self) -> None:
        """Nothing: each ``update_weights`` is one whole update, loaded once it has been checked."""

    def finish_weight_update(self) -> None:
        pass

    def max_bytes(self) -> int:
        """The most an update may announce: the model's parameters, counted at four bytes a value."""
        return sum(p.numel() * 4 for p in self.model.parameters()) + (1 << 20)

    def receive_weights(self, update_info: UpdateInfo) -> None:
        if self.receiver is None:
            raise RuntimeError("init_weight_transfer_engine was not called")
        received: list[tuple[str, torch.Tensor]] = []
        self.receiver.receive_weights(update_info.plan(), received.extend)  # (raises before loading)
        reload_weights(self.vllm_config, self.model, received, None, is_checkpoint_format=True)
        rederive_tied_head(self.model)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.shutdown()
        self.receiver = None


class BroadcastEngine(_DevicePlaneEngine):
    init_info_cls = BroadcastInitInfo

    def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:
        init = planes.BroadcastInit(**{f.name: getattr(init_info, f.name) for f in fields(init_info)})
        parallel = self.parallel_config
        local_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank  # (vLLM's order)
        self.receiver = planes.BroadcastReceiver(self.device, self.max_bytes())
        self.receiver.init_transfer_engine(init, local_rank)


class IpcEngine(_DevicePlaneEngine):
    init_info_cls = IpcInitInfo

    def init_transfer_engine(self, init_info: IpcInitInfo) -> None:
        self.receiver = planes.IpcReceiver(self.device, self.max_bytes())


def register() -> None:
    """Register both engines with vLLM (once per process)."""
    for name, engine in ((BROADCAST, BroadcastEngine), (IPC, IpcEngine)):
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, engine)
