"""The device planes (fp8rl/codec/device_planes.py) as vLLM weight-transfer engines, registered with
vLLM's ``WeightTransferEngineFactory`` as ``fp8rl-broadcast`` (NCCL between GPUs, Gloo between CPUs) and
``fp8rl-ipc`` (CUDA IPC on one host). An engine built with
``weight_transfer_config={"backend": "fp8rl-broadcast"}`` is then driven as vLLM documents
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``, ``finish_weight_update``,
through ``collective_rpc`` on every worker), and the trainer's side is
:class:`~fp8rl.codec.device_planes.BroadcastSender` / :class:`~fp8rl.codec.device_planes.IpcSender`.

Unlike vLLM's own engines, ``update_weights`` only stages the update (every bucket received and checked
against its fingerprint: fp8rl/codec/device_planes.py), and ``finish_weight_update`` loads it, once every
worker has staged its copy: the caller (``VllmEngine.load_from_device_plane``) finishes only where every
worker staged, and otherwise drops what was staged on each (``fp8rl_abort_weight_update``), so that a
refused update leaves every worker's weights as they were. The load is a refit as a gRPC update's: vLLM's
in-place ``reload_weights`` from checkpoint-format tensors (FP8 codes with their block scales), then the
tied output layer processed again.

Registered by vLLM's general plugin (pyproject.toml) in every engine process, and by the engine wrapper
before it builds an engine with ``weight_transfer``.
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


class BroadcastInitInfo(planes.BroadcastInit, WeightTransferInitInfo):
    """:class:`~fp8rl.codec.device_planes.BroadcastInit` as vLLM's init info (its dict's keys)."""


@dataclass
class IpcInitInfo(WeightTransferInitInfo):
    pass


@dataclass
class UpdateInfo(WeightTransferUpdateInfo):
    """:class:`~fp8rl.codec.device_planes.UpdateInfo`'s fields (lists where JSON gives lists): what a
    trainer passes as ``update_info`` is :func:`~fp8rl.codec.device_planes.to_json_dict`'s."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed_buffer_size_bytes: int = planes.DEFAULT_BUCKET_BYTES
    fingerprints: list[int | str] | None = None
    ipc_handles: list[dict[str, dict[str, Any]]] | None = None
    digests: list[str] | None = None

    def plan(self) -> planes.UpdateInfo:
        return planes.from_json_dict({f.name: getattr(self, f.name) for f in fields(self)})


class _DevicePlaneEngine(WeightTransferEngine):
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False  # (the refit reloads the main model, under its config)
    receiver: Any = None
    staged: planes.Staged | None = None

    def start_weight_update(self) -> None:
        self.staged = None

    def receive_weights(self, update_info: UpdateInfo) -> None:
        """Stage the update (received and checked); nothing is loaded yet."""
        if self.receiver is None:
            raise RuntimeError("init_weight_transfer_engine was not called")
        self.staged = self.receiver.stage(update_info.plan())

    def finish_weight_update(self) -> None:
        """Load what was staged: vLLM's in-place reload, then the tied output layer processed again."""
        staged, self.staged = self.staged, None
        if staged is None:
            raise RuntimeError("finish_weight_update without a staged update")
        received: list[tuple[str, torch.Tensor]] = []
        staged.load(received.extend)
        reload_weights(self.vllm_config, self.model, received, None, is_checkpoint_format=True)
        rederive_tied_head(self.model)

    def abort_weight_update(self) -> None:
        self.staged = None

    def max_bytes(self) -> int:
        """The most an update may announce: the model's parameters, counted at four bytes a value."""
        return sum(p.numel() * 4 for p in self.model.parameters()) + (1 << 20)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.shutdown()
        self.receiver = self.staged = None


class BroadcastEngine(_DevicePlaneEngine):
    init_info_cls = BroadcastInitInfo

    def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:
        parallel = self.parallel_config
        local_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank  # (vLLM's order)
        self.receiver = planes.BroadcastReceiver(self.device, self.max_bytes())
        self.receiver.init_transfer_engine(init_info, local_rank)


class IpcEngine(_DevicePlaneEngine):
    init_info_cls = IpcInitInfo

    def init_transfer_engine(self, init_info: IpcInitInfo) -> None:
        self.receiver = planes.IpcReceiver(self.device, self.max_bytes())


def register() -> None:
    """Register both engines with vLLM (once per process)."""
    for name, engine in ((planes.BROADCAST_BACKEND, BroadcastEngine), (planes.IPC_BACKEND, IpcEngine)):
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, engine)
