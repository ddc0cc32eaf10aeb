"""Data planes between devices: an update's tensors from the trainer's GPU straight into a replica's, as
vLLM's weight-transfer engines move them (vllm/distributed/weight_transfer/: ``nccl``, ``ipc``), while
gRPC stays the control plane (the version, the plan below, refusals, activation).

Two planes, each a sender (the trainer's rank 0) and a receiver (a replica's worker) with the method names
and the update fields of vLLM's engines, so that either side can stand in for vLLM's:

* :class:`BroadcastSender` / :class:`BroadcastReceiver`: a collective broadcast from rank 0 to every
  replica worker (rank ``rank_offset + i``), NCCL between GPUs (one rank per device), Gloo between CPUs
  (the same code; that is how it runs in the suite). The group is its own (a TCPStore rendezvous and
  a process group built on it, never torch's default group, which a sharded trainer or vLLM's workers
  hold already).
* :class:`IpcSender` / :class:`IpcReceiver`: CUDA IPC on one host. The sender names each bucket by
  the fields of its CUDA IPC handle (plain values, never a pickled callable: vLLM's HTTP route needs
  ``VLLM_ALLOW_INSECURE_SERIALIZATION`` for that), and the receiver maps the handle, checks the bucket
  there and loads from it.

Both move *packed buckets*: the update's tensors laid end to end, aligned, in uint8 buffers of at most
``bucket_bytes`` (:func:`plan_buckets`, the same plan on both sides from the update's names, dtypes and
shapes). A receiver *stages* the whole update and checks every bucket's fingerprint
(:func:`fingerprint`, computed where the bytes are, on either device, to the same integers) against the
plan's before one tensor reaches ``load_weights``: an update is loaded whole or not at all, as over
gRPC. A broadcast stages in host memory (pinned), each bucket through one scratch buffer on the device,
so that a GPU whose memory the engine has claimed needs no room for a second copy of the model; a
refusing receiver still takes every bucket, so that the sender never waits on it. CUDA IPC stages
nothing: the receiver checks and loads from the trainer's buffers, which stay unchanged until the
trainer releases them. The fingerprint detects corruption and misrouted buckets, not forgery; a
broadcast group is unauthenticated, as NCCL's always are, so a broadcast's plan also carries each
bucket's BLAKE2b-256 digest, checked over the staged host bytes: the trainer signs the plan
(rollout_service checks it), so a replica loads only bytes the trainer vouched for. CUDA IPC's buckets
are the trainer's own memory, named over the authenticated control plane (docs/weight-sync.md).

Torch alone (the bare GPU host runs it: scripts/gpu_proof.py); nothing here imports CUDA on a CPU.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import math
import os
import socket
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch

# What a plan may carry: the dtypes of a WeightSet (FP8 codes, scales, high-precision tensors).
DTYPES = {name: getattr(torch, name) for name in ("float8_e4m3fn", "float32", "bfloat16", "float16", "uint8")}
ALIGN = 256  # each tensor starts at a multiple of this in its bucket (CUDA's allocation granularity)
DEFAULT_BUCKET_BYTES = 1 << 30  # vLLM's packed default (packed_tensor.py)
MAX_BUCKET_BYTES = 1 << 34
MAX_DIMENSION = 1 << 40
DIGEST_BYTES = 32
_FINGERPRINT_WORDS = 1 << 22  # int32 words a fingerprint reduces at once (16 MiB: ~100 MB of scratch)
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # 2^64 / golden ratio, as a signed int64: spreads word positions

BROADCAST_BACKEND, IPC_BACKEND = "fp8rl-broadcast", "fp8rl-ipc"  # the vLLM engines' names (weight_transfer)
DEVICE_KEYFRAME = "device-keyframe"  # a device-plane update's header encoding: a signing domain of its own

LoadWeights = Callable[[list[tuple[str, torch.Tensor]]], None]


# -- the plan: pure, and the same on both sides -------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """Where tensor ``index`` of the update lies in its bucket."""

    index: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class UpdateInfo:
    """One update on a device plane: vLLM's ``NCCLWeightTransferUpdateInfo`` fields (``names``,
    ``dtype_names``, ``shapes``, ``packed_buffer_size_bytes``; always packed) plus what a receiver checks
    before loading, one per bucket in :func:`plan_buckets` order: ``fingerprints``, a broadcast's
    ``digests``, and for IPC each bucket's handle (``ipc_handles``: :func:`ipc_handle`'s fields, keyed by
    the GPU's UUID)."""

    names: tuple[str, ...]
    dtype_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    fingerprints: tuple[int, ...] = ()
    ipc_handles: tuple[dict[str, dict[str, object]], ...] = ()
    digests: tuple[str, ...] = ()  # BLAKE2b-256 in hex: what the signed plan vouches for

    def tensor_bytes(self) -> list[int]:
        return [
            math.prod(shape) * DTYPES[dtype].itemsize
            for shape, dtype in zip(self.shapes, self.dtype_names, strict=True)
        ]


def to_json_dict(info: UpdateInfo) -> dict[str, Any]:
    """The plan as JSON values (vLLM's ``update_info`` dict): fingerprints as decimal strings (128-bit
    integers), an IPC handle's bytes in base64."""
    return {
        "names": list(info.names),
        "dtype_names": list(info.dtype_names),
        "shapes": [list(shape) for shape in info.shapes],
        "packed_buffer_size_bytes": info.packed_buffer_size_bytes,
        "fingerprints": [str(f) for f in info.fingerprints],
        "digests": list(info.digests),
        "ipc_handles": [
            {
                uuid: {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v for k, v in h.items()}
                for uuid, h in handles.items()
            }
            for handles in info.ipc_handles
        ]
        or None,
    }


def from_json_dict(raw: Any) -> UpdateInfo:
    """A plan from JSON values (:func:`to_json_dict`'s, or vLLM's ``update_info`` dict): ValueError naming
    the field that is not of its kind; :func:`check_update_info` bounds the rest."""
    if not isinstance(raw, dict):
        raise ValueError("plan: not a JSON object")

    def listed(field: str, kind: type) -> list[Any]:
        value = raw.get(field) or []
        if not isinstance(value, list | tuple) or not all(isinstance(v, kind) for v in value):
            raise ValueError(f"{field}: not a list of {kind.__name__}")
        return list(value)

    shapes = listed("shapes", list | tuple)  # type: ignore[arg-type]
    fingerprints = listed("fingerprints", str | int)  # type: ignore[arg-type]
    if not all(isinstance(f, int) or f.isdigit() for f in fingerprints):
        raise ValueError("fingerprints: not decimal integers")
    bucket = raw.get("packed_buffer_size_bytes", DEFAULT_BUCKET_BYTES)
    if type(bucket) is not int:
        raise ValueError("packed_buffer_size_bytes: not an integer")
    return UpdateInfo(
        tuple(listed("names", str)),
        tuple(listed("dtype_names", str)),
        tuple(tuple(shape) for shape in shapes),
        bucket,
        tuple(int(f) for f in fingerprints),
        tuple(listed("ipc_handles", dict)),
        tuple(listed("digests", str)),
    )


def update_info(
    named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> UpdateInfo:
    """The plan of sending ``named`` (fingerprints and handles not yet filled in)."""
    return UpdateInfo(
        tuple(name for name, _ in named),
        tuple(str(t.dtype).removeprefix("torch.") for _, t in named),
        tuple(tuple(t.shape) for _, t in named),
        bucket_bytes,
    )


def check_update_info(info: UpdateInfo, max_bytes: int, ipc: bool = False, max_tensors: int = 1 << 20) -> int:
    """Refuse a plan before anything is allocated for it: the fields agree in length, every dtype is
    one a weight set holds, every shape is of non-negative integers, the buckets are bounded, the whole
    fits in ``max_bytes``, and there is a fingerprint (and, for ``ipc``, a handle) for every bucket;
    returns the plan's bytes. Raises ValueError naming the field."""
    n = len(info.names)
    if not 0 < n <= max_tensors:
        raise ValueError(f"names: {n} tensors, outside [1, {max_tensors}]")
    if len(info.dtype_names) != n or len(info.shapes) != n:
        raise ValueError(f"dtype_names, shapes: {len(info.dtype_names)} and {len(info.shapes)} for {n} names")
    if len(set(info.names)) != n:
        raise ValueError("names: a tensor is named twice")
    unknown = sorted(set(info.dtype_names) - set(DTYPES))
    if unknown:
        raise ValueError(f"dtype_names: {unknown[:3]} not among {sorted(DTYPES)}")
    for shape in info.shapes:
        whole = all(type(d) is int and 0 <= d <= MAX_DIMENSION for d in shape)
        if not whole or len(shape) > 8:
            raise ValueError(f"shapes: {shape} is not up to 8 integer dimensions in [0, {MAX_DIMENSION}]")
    if not ALIGN <= info.packed_buffer_size_bytes <= MAX_BUCKET_BYTES:
        raise ValueError(
            f"packed_buffer_size_bytes: {info.packed_buffer_size_bytes} outside [{ALIGN}, {MAX_BUCKET_BYTES}]"
        )
    total = sum(info.tensor_bytes())
    if total > max_bytes:
        raise ValueError(f"shapes: {total} bytes in all, more than the model's {max_bytes}")
    buckets = len(plan_buckets(info))
    if len(info.fingerprints) != buckets or not all(type(f) is int for f in info.fingerprints):
        raise ValueError(f"fingerprints: {len(info.fingerprints)} for {buckets} buckets")
    if ipc and len(info.ipc_handles) != buckets:
        raise ValueError(f"ipc_handles: {len(info.ipc_handles)} for {buckets} buckets")
    hexes = all(len(d) == 2 * DIGEST_BYTES and all(c in "0123456789abcdef" for c in d) for d in info.digests)
    if not ipc and (len(info.digests) != buckets or not hexes):
        raise ValueError(f"digests: {len(info.digests)} for {buckets} buckets, or not BLAKE2b-256 in hex")
    return total


def plan_buckets(info: UpdateInfo) -> list[list[Slot]]:
    """The tensors in order, each at an aligned offset of the bucket it starts, a new bucket whenever the
    next would not fit (a tensor larger than a bucket has one of its own)."""
    buckets: list[list[Slot]] = []
    used = 0
    for index, nbytes in enumerate(info.tensor_bytes()):
        offset = -(-used // ALIGN) * ALIGN
        # (an empty tensor never opens a bucket: every bucket holds bytes)
        if not buckets or (used > 0 and nbytes > 0 and offset + nbytes > info.packed_buffer_size_bytes):
            buckets.append([])
            offset = 0
        buckets[-1].append(Slot(index, offset, nbytes))
        used = offset + nbytes
    return buckets


def bucket_size(bucket: Sequence[Slot]) -> int:
    return bucket[-1].offset + bucket[-1].nbytes if bucket else 0


def pack(bucket: Sequence[Slot], tensors: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """The bucket's bytes: its tensors (``tensors[slot.index]``) copied end to end into one uint8 buffer
    on ``device`` (the gaps zeroed: they are fingerprinted too)."""
    buffer = torch.zeros(bucket_size(bucket), dtype=torch.uint8, device=device)
    for slot in bucket:
        t = tensors[slot.index].detach().contiguous()
        buffer[slot.offset : slot.offset + slot.nbytes].copy_(t.view(-1).view(torch.uint8))
    return buffer


def unpack(buffer: torch.Tensor, bucket: Sequence[Slot], info: UpdateInfo) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors, as views of ``buffer`` (no copy)."""
    return [
        (
            info.names[slot.index],
            buffer[slot.offset : slot.offset + slot.nbytes]
            .view(DTYPES[info.dtype_names[slot.index]])
            .view(info.shapes[slot.index]),
        )
        for slot in bucket
    ]


def fingerprint(buffer: torch.Tensor) -> int:
    """Two sums of the buffer's int32 words (the last 1-3 bytes, if any, as one more word), plain and
    weighted by position, mod 2^64 (so any order of adding gives the same integers on any device),
    folded into one int: a changed, lost or moved word changes it. Computed where the buffer is, in
    slices (bounded scratch)."""
    flat = buffer.reshape(-1).view(torch.uint8)
    whole = flat.numel() // 4 * 4
    body = flat[:whole] if flat.storage_offset() % 4 == 0 else flat[:whole].clone()  # (int32-aligned)
    words = body.view(torch.int32)
    plain = weighted = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _FINGERPRINT_WORDS):
        piece = words[start : start + _FINGERPRINT_WORDS].to(torch.int64)
        where = torch.arange(start + 1, start + 1 + piece.numel(), dtype=torch.int64, device=flat.device)
        plain = plain + piece.sum()
        weighted = weighted + (piece * (where * _MIX)).sum()
    low, high = int(plain), int(weighted)
    if whole < flat.numel():
        last = int.from_bytes(bytes(flat[whole:].cpu().tolist()), "little")
        low, high = low + last, high + last * (words.numel() + 1) * _MIX
    mask = 2**64 - 1
    return (low & mask) ^ ((high & mask) << 64)


def with_fingerprints(info: UpdateInfo, buffers: Sequence[torch.Tensor]) -> UpdateInfo:
    return replace(info, fingerprints=tuple(fingerprint(b) for b in buffers))


def plan_update(
    named: Sequence[tuple[str, torch.Tensor]], device: torch.device, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> UpdateInfo:
    """The plan of broadcasting ``named`` from ``device``, with every bucket's fingerprint and digest
    (packs each bucket once for them, one at a time; the digests on a thread pool while the next bucket
    is packed: hashlib lets go of the GIL)."""
    info = update_info(named, bucket_bytes)
    tensors = [t for _, t in named]
    fingerprints, digests = [], []
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for bucket in plan_buckets(info):
            packed = pack(bucket, tensors, device)
            fingerprints.append(fingerprint(packed))
            digests.append(pool.submit(bucket_digest, packed))
        return replace(info, fingerprints=tuple(fingerprints), digests=tuple(d.result() for d in digests))


def bucket_digest(buffer: torch.Tensor) -> str:
    """BLAKE2b-256 of a bucket's bytes, read on the host: collision-resistant, so that the trainer's
    signature over the plan vouches for every byte (the fingerprint only catches accidents)."""
    data = buffer.detach().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.blake2b(data.data, digest_size=DIGEST_BYTES).hexdigest()


@dataclass
class Staged:
    """A received update whose every bucket matched its fingerprint, held until it is loaded (or
    dropped): host buffers (a broadcast) or views of the trainer's (CUDA IPC)."""

    info: UpdateInfo
    buffers: list[torch.Tensor]

    def load(self, load_weights: LoadWeights) -> None:
        for buffer, bucket in zip(self.buffers, plan_buckets(self.info), strict=True):
            load_weights(unpack(buffer, bucket, self.info))


def check_named(info: UpdateInfo, named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """The sender's tensors are the plan's, in its order (before a byte is sent: a receiver that gets
    other bytes than the plan's refuses them, but only after the whole broadcast)."""
    planned = list(zip(info.names, info.dtype_names, info.shapes, strict=True))
    actual = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named]
    if actual != planned:
        raise ValueError("named: the tensors are not the plan's (names, dtypes and shapes, in order)")


# -- broadcast: NCCL between GPUs, Gloo between CPUs -----------------------------------------------------


@dataclass(frozen=True)
class BroadcastInit:
    """vLLM's ``NCCLWeightTransferInitInfo`` rendezvous fields: the trainer's store at ``master_address``
    and ``master_port``, rank 0 the trainer, replica workers from ``rank_offset``, ``world_size`` in all;
    ``backend``: "nccl" (CUDA tensors) or "gloo" (CPU tensors)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "nccl"
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend: {self.backend!r} is neither 'nccl' nor 'gloo'")
        if not 1 <= self.rank_offset < self.world_size:
            raise ValueError(f"rank_offset: {self.rank_offset} outside [1, world_size {self.world_size})")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port: {self.master_port}")


def _group(init: BroadcastInit, rank: int, store: Any, device: torch.device) -> Any:
    """The process group on ``store``; formed when this returns (NCCL connects lazily unless told to)."""
    import torch.distributed as dist

    if (init.backend == "nccl") != (device.type == "cuda"):
        raise ValueError(f"backend: {init.backend} does not move tensors on {device.type}")
    timeout = datetime.timedelta(seconds=init.timeout_s)
    if init.backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [
            dist.ProcessGroupGloo.create_device(hostname=route_address(init.master_address, init.master_port))
        ]
        options._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, init.world_size, options)
    options = dist.ProcessGroupNCCL.Options()  # (CUDA builds of torch only)
    options._timeout = timeout
    group = dist.ProcessGroupNCCL(store, rank, init.world_size, options)
    group.eager_connect_single_device(device)
    return group


def _shutdown(group: Any) -> None:
    if group is not None and hasattr(group, "shutdown"):
        group.shutdown()


def route_address(host: str, port: int = 9) -> str:
    """This host's address on the route to ``host`` (where a group's peer reaches it; Gloo binds there,
    not wherever the host name resolves)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # (UDP: nothing is sent)
        return str(probe.getsockname()[0])


def _broadcast(group: object, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    if group is None:
        raise RuntimeError("the broadcast group is not formed, or was shut down")
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()  # type: ignore[attr-defined]


@dataclass
class BroadcastSender:
    """The trainer's side (rank 0): vLLM's ``trainer_init`` then ``send_weights`` per update."""

    init: BroadcastInit
    device: torch.device
    _store: object = field(default=None, repr=False)
    _group: object = field(default=None, repr=False)

    @classmethod
    def listen(
        cls,
        address: str,
        world_size: int,
        rank_offset: int = 1,
        backend: str = "nccl",
        device: torch.device | str = "cuda",
        timeout_s: float = 300.0,
    ) -> BroadcastSender:
        """Open the rendezvous store on a free port of ``address``; its :attr:`init` is what each replica
        is told (over the control plane) before :meth:`trainer_init` is called."""
        import torch.distributed as dist

        store = dist.TCPStore(
            address,
            0,
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        init = BroadcastInit(address, store.port, rank_offset, world_size, backend, timeout_s)
        return cls(init, torch.device(device), store)

    def trainer_init(self) -> None:
        """Form the group (blocks until every replica worker has joined)."""
        self._group = _group(self.init, 0, self._store, self.device)

    def send_weights(
        self, named: Sequence[tuple[str, torch.Tensor]], info: UpdateInfo | None = None
    ) -> UpdateInfo:
        """Broadcast ``named`` as packed buckets; returns the plan (with fingerprints), which the control
        plane must have given every receiver first: call :meth:`plan` for it, send it, then this."""
        info = info or self.plan(named)
        check_named(info, named)
        tensors = [t for _, t in named]
        for bucket in plan_buckets(info):
            _broadcast(self._group, pack(bucket, tensors, self.device))
        return info

    def plan(
        self, named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> UpdateInfo:
        """The update's plan (:func:`plan_update`)."""
        return plan_update(named, self.device, bucket_bytes)

    def shutdown(self) -> None:
        _shutdown(self._group)
        self._group = self._store = None


@dataclass
class BroadcastReceiver:
    """A replica worker's side: vLLM's ``init_transfer_engine`` then ``receive_weights`` per update."""

    device: torch.device
    max_bytes: int
    _group: object = field(default=None, repr=False)

    def init_transfer_engine(self, init: BroadcastInit, local_rank: int = 0) -> None:
        import torch.distributed as dist

        store = dist.TCPStore(
            init.master_address,
            init.master_port,
            init.world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=init.timeout_s),
        )
        self._group = _group(init, init.rank_offset + local_rank, store, self.device)

    def stage(self, info: UpdateInfo) -> Staged:
        """Every bucket received and checked, into host memory (see the module's docstring). A bucket
        that does not match its fingerprint fails the update, after the rest of the broadcast."""
        check_update_info(info, self.max_bytes)
        buckets = plan_buckets(info)
        on_cpu = self.device.type == "cpu"
        scratch = (
            None
            if on_cpu
            else torch.empty(max(map(bucket_size, buckets)), dtype=torch.uint8, device=self.device)
        )
        staged, refused = [], None
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # (digests beside receiving)
            digests = []
            for i, bucket in enumerate(buckets):
                size = bucket_size(bucket)
                buffer = torch.empty(size, dtype=torch.uint8) if scratch is None else scratch[:size]
                _broadcast(self._group, buffer)
                if refused is None and fingerprint(buffer) != info.fingerprints[i]:
                    refused = f"fingerprints: bucket {i} did not arrive as sent"
                if refused is None:
                    host = buffer if on_cpu else torch.empty(size, dtype=torch.uint8, pin_memory=True)
                    if not on_cpu:
                        host.copy_(buffer)
                    staged.append(host)
                    digests.append(pool.submit(bucket_digest, host))
            wrong = next((i for i, d in enumerate(digests) if d.result() != info.digests[i]), None)
        if refused is None and wrong is not None:
            refused = f"digests: bucket {wrong} is not the bytes the plan vouches for"
        if refused is not None:
            raise ValueError(refused)
        return Staged(info, staged)

    def receive_weights(self, info: UpdateInfo, load_weights: LoadWeights) -> None:
        """vLLM's engine method: stage, then load (all or nothing)."""
        self.stage(info).load(load_weights)

    def shutdown(self) -> None:
        _shutdown(self._group)
        self._group = None


# -- CUDA IPC on one host ------------------------------------------------------------------------------

# rebuild_cuda_tensor's arguments (torch/multiprocessing/reductions.py), in its order: what an IPC
# handle is, as plain values.
IPC_FIELDS = (
    "tensor_cls",
    "tensor_size",
    "tensor_stride",
    "tensor_offset",
    "storage_cls",
    "tensor_dtype",
    "storage_device",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def ipc_handle(buffer: torch.Tensor) -> dict[str, object]:
    """The CUDA IPC handle of a uint8 CUDA buffer as plain values (its storage handle, size, offset and
    the reference counter the producer keeps); the tensor and storage classes are implied."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8:
        raise ValueError("ipc_handle: a uint8 CUDA buffer is needed")
    rebuild, args = reduce_tensor(buffer)
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError(f"ipc_handle: torch reduces this buffer with {rebuild.__name__}")
    fields = dict(zip(IPC_FIELDS, args, strict=True))
    for cls in ("tensor_cls", "storage_cls", "tensor_dtype"):
        fields.pop(cls)
    return fields


def ipc_fields(raw: dict[str, object], nbytes: int) -> dict[str, object]:
    """A handle's fields as :func:`ipc_handle` made them, from what crossed the control plane (msgpack
    and JSON turn tuples into lists; JSON carries bytes as base64), once each is of its kind and the
    handle is a buffer of the plan's ``nbytes``. Raises ValueError naming the field."""
    fields = dict(raw)
    for name in ("tensor_size", "tensor_stride"):
        if isinstance(fields.get(name), list):
            fields[name] = tuple(fields[name])  # type: ignore[arg-type]
    for name in ("storage_handle", "ref_counter_handle", "event_handle"):
        value = fields.get(name)
        if isinstance(value, str):
            try:
                fields[name] = base64.b64decode(value, validate=True)
            except ValueError as exc:
                raise ValueError(f"ipc_handles: {name} is not base64") from exc
    kinds = {
        "tensor_size": tuple,
        "tensor_stride": tuple,
        "tensor_offset": int,
        "storage_handle": bytes,
        "storage_size_bytes": int,
        "storage_offset_bytes": int,
        "requires_grad": bool,
        "ref_counter_handle": bytes,
        "ref_counter_offset": int,
        "event_sync_required": bool,
    }
    for name, kind in kinds.items():
        if not isinstance(fields.get(name), kind):
            raise ValueError(f"ipc_handles: {name} is not a {kind.__name__}")
    if fields["tensor_size"] != (nbytes,) or fields["tensor_stride"] != (1,) or fields["requires_grad"]:
        raise ValueError(f"ipc_handles: the handle is not a buffer of the plan's {nbytes} bytes")
    return fields


def open_ipc_handle(raw: dict[str, object], nbytes: int, device: torch.device) -> torch.Tensor:
    """The producer's buffer (:func:`ipc_fields`), mapped on ``device``: this process's index of the
    same GPU (the producer's index may differ)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = device.index if device.index is not None else torch.cuda.current_device()
    args = dict(
        ipc_fields(raw, nbytes),
        tensor_cls=torch.Tensor,
        storage_cls=torch.storage.TypedStorage,
        tensor_dtype=torch.uint8,
        storage_device=index,
    )
    return rebuild_cuda_tensor(*(args[name] for name in IPC_FIELDS))


@dataclass
class IpcSender:
    """The trainer's side on the replica's host: its packed buckets stay alive (and unchanged) until
    :meth:`release`, which the control plane calls once the replica has answered."""

    device: torch.device
    _held: list[torch.Tensor] = field(default_factory=list, repr=False)

    def send_weights(
        self, named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> UpdateInfo:
        info = update_info(named, bucket_bytes)
        tensors = [t for _, t in named]
        self._held = [pack(b, tensors, self.device) for b in plan_buckets(info)]
        uuid = gpu_uuid(self.device)
        info = with_fingerprints(info, self._held)
        return replace(info, ipc_handles=tuple({uuid: ipc_handle(b)} for b in self._held))

    def release(self) -> None:
        """Let the buckets go (once every receiver has answered: it loaded from them, or refused)."""
        self._held = []
        torch.cuda.ipc_collect()  # (frees those whose receivers have closed their mappings)


@dataclass
class IpcReceiver:
    """A replica worker's side: each bucket mapped by its handle for this worker's GPU, checked and loaded
    from there (the trainer keeps it unchanged until the update is answered)."""

    device: torch.device
    max_bytes: int

    def init_transfer_engine(self, init: object = None) -> None:
        """Nothing to set up (as vLLM's IPC engine)."""

    def stage(self, info: UpdateInfo) -> Staged:
        """Every bucket mapped from the trainer's memory and checked there; nothing copied. A handle not
        opened (a refusal before it) has its reference released, so that the trainer can free it."""
        check_update_info(info, self.max_bytes, ipc=True)
        uuid = gpu_uuid(self.device)
        buckets = plan_buckets(info)
        mapped: list[torch.Tensor] = []
        try:
            for i, (bucket, handles) in enumerate(zip(buckets, info.ipc_handles, strict=True)):
                if uuid not in handles:
                    raise ValueError(f"ipc_handles: none for this GPU ({uuid}); the trainer is on another")
                mapped.append(open_ipc_handle(handles[uuid], bucket_size(bucket), self.device))
                if fingerprint(mapped[-1]) != info.fingerprints[i]:
                    raise ValueError(f"fingerprints: bucket {i} did not arrive as sent")
        except BaseException:
            for handles in info.ipc_handles[len(mapped) :]:
                _release_unopened(handles.get(uuid))
            raise
        return Staged(info, mapped)

    def receive_weights(self, info: UpdateInfo, load_weights: LoadWeights) -> None:
        self.stage(info).load(load_weights)

    def shutdown(self) -> None:
        pass


def _release_unopened(fields: dict[str, object] | None) -> None:
    """Give back the producer's reference counter of a handle this process never opened."""
    handle, offset = (fields or {}).get("ref_counter_handle"), (fields or {}).get("ref_counter_offset")
    if isinstance(handle, str):
        handle = base64.b64decode(handle)
    if isinstance(handle, bytes) and isinstance(offset, int):
        with contextlib.suppress(RuntimeError):
            torch.UntypedStorage._release_ipc_counter_cuda(handle, offset)


def named_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """A weight set's tensors in name order: the order both sides plan by."""
    return sorted(weights, key=lambda nt: nt[0])
