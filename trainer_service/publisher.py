"""PublishWeights: quantize the master weights into the rollout's format once per version, then stream
each target a delta against the version it holds (or a keyframe), concurrently, each part as soon as it
is encoded. A target that refuses a delta (FAILED_PRECONDITION: it holds something else) gets a keyframe
at once.

The stream always carries the headers; each part's bytes take a data plane where the target has one:
shared memory for a target on this host (its inbox answers: fp8rl/codec/segments.py; written once for
every such target), else parallel TCP connections to its TCP port (fp8rl/codec/tcp_plane.py), else the
stream itself. Where a plane cannot be reached the part goes by the next one, and an update that fails
on a plane is sent again over gRPC.

With ``weight_transfer``, a target whose status offers a device plane (its ``weight_transfer``) gets the
whole set as a keyframe over it instead, from this process's device (trainer_service/device_plane.py);
where that fails, the update goes as above."""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fp8rl.codec.device_planes import BROADCAST_BACKEND
from fp8rl.codec.encode import PART_BYTES, EncodedUpdate, changed_fraction, delta_parts, keyframe_parts
from fp8rl.codec.schema import build_weight_set
from fp8rl.codec.segments import hand_over, sealed_segment
from fp8rl.codec.stream import header_of, update_to_chunks
from fp8rl.codec.tcp_plane import TcpSender, client_context, new_ticket
from fp8rl.codec.weight_set import WeightSet
from fp8rl.recipes import WeightFormat
from fp8rl.security import SecurityConfig
from fp8rl.transport import channel
from fp8rl.v1 import common_pb2, rollout_pb2_grpc, weights_pb2
from trainer_service.device_plane import DevicePayload, DevicePlane

log = logging.getLogger(__name__)
SHARED_MEMORY, TCP, GRPC, MIXED, DEVICE = "shared-memory", "tcp", "grpc", "mixed", "device"
UPDATE_DEADLINE_S = 600.0
TCP_PAUSE_S = 60.0  # a TCP plane that could not be reached, or broke, is left alone this long
# A refused delta is followed by a keyframe, except where the target is busy, away or refuses the caller:
# a bigger update would fare no better.
_NOT_HEALED = (
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
)


@dataclass(frozen=True)
class Target:
    address: str
    held_version: int  # -1: unknown


@dataclass(frozen=True)
class Delivery:
    address: str
    ok: bool
    encoding: str
    wire_bytes: int
    density: float
    seconds: float
    error: str = ""
    plane: str = GRPC  # what carried the data: one plane for every part, or MIXED
    apply_s: float = 0.0  # the replica's refit: its engine loading the update (``seconds`` includes it)


@dataclass
class Reach:
    """A target's data planes, as its status names them: its segment inbox ("": none usable from here)
    and its TCP port (0: none, or not reachable from here)."""

    inbox: str = ""
    tcp_port: int = 0
    tcp_tls: bool = False  # the port speaks TLS (else its bytes go in clear, checked by signature)
    weight_transfer: str = ""  # its device plane ("fp8rl-broadcast"), and the workers that join it
    transfer_ranks: int = 0
    device: str = ""  # its engine's ("cpu", "cuda"): a broadcast joins like devices


class Publisher:
    def __init__(
        self,
        weight_format: WeightFormat,
        hp_dtype: torch.dtype,
        recipe: str,
        security: SecurityConfig | None = None,
        part_bytes: int = PART_BYTES,
        high_precision: Collection[str] = frozenset(),
        shared_memory: bool = True,
        tcp_streams: int = 4,
        weight_transfer: bool = False,
        device: torch.device | str = "cpu",
        transfer_timeout_s: float = 120.0,
    ) -> None:
        """``part_bytes``: tensor bytes per part of a streamed update (fp8rl.codec.encode);
        ``high_precision``: the block linears (module names) an FP8 format ships in ``hp_dtype``
        (fp8rl.architectures); ``shared_memory``: hand parts to same-host targets as shared memory;
        ``tcp_streams``: connections per target on its TCP plane (0: the plane is not used);
        ``weight_transfer``: send to a target's device plane where it offers one, from ``device`` (NCCL
        from a GPU, Gloo from a CPU), each collective waiting at most ``transfer_timeout_s``."""
        self.weight_format, self.hp_dtype, self.recipe = weight_format, hp_dtype, recipe
        self.high_precision = frozenset(high_precision)
        self.part_bytes = part_bytes
        self.security = security or SecurityConfig()
        self.signer = self.security.update_signing_key()  # every update is signed with it (fp8rl.security)
        self.last: tuple[int, WeightSet] | None = None  # the one base any delta is computed against
        self.shared_memory, self.tcp_streams = shared_memory, tcp_streams
        self._tcp_tls = client_context(self.security) if tcp_streams else None
        self._channels: dict[str, grpc.Channel] = {}
        self._reach: dict[str, Reach] = {}  # address -> its data planes, asked once
        self._tcp_paused: dict[str, float] = {}  # address -> when its TCP plane may be tried again
        self.weight_transfer, self.transfer_timeout_s = weight_transfer, transfer_timeout_s
        self.device = torch.device(device)
        self._device_planes: dict[str, DevicePlane] = {}  # address -> its broadcast group, once formed
        self._device_paused: dict[str, float] = {}
        self._channels_lock = threading.Lock()
        self._publish_lock = threading.Lock()

    def publish(
        self,
        version: int,
        master: Callable[[], Mapping[str, torch.Tensor]],
        targets: Sequence[Target],
        epoch: int = 0,
        built: WeightSet | None = None,
    ) -> list[Delivery]:
        """Bring every target to ``version``; ``master`` gives the weights (called once, if at all), unless
        ``built`` is their set already. ``epoch``: the fencing token of the coordinator asking (signed
        into each update)."""
        with self._publish_lock:
            base = self.last
            if base is not None and base[0] == version:
                weights = base[1]
            else:
                weights = built or self._weight_set(master())
            updates = _Updates(weights, version, base, self.recipe, epoch, self.signer, self.part_bytes)
            try:
                with ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
                    deliveries = list(pool.map(lambda t: self._deliver(t, updates), targets))
            finally:
                updates.close()
            self.last = (version, weights)
            return deliveries

    def build(self, master: Mapping[str, torch.Tensor], keep: bool = True) -> WeightSet | None:
        """The rollout's set of ``master`` (read one tensor at a time: a sharded learner gathers each
        whole as it is read); ``keep=False`` reads them and keeps nothing (the ranks that only help to
        gather)."""
        if not keep:
            for _ in master.values():
                pass
            return None
        return self._weight_set(master)

    def _weight_set(self, master: Mapping[str, torch.Tensor]) -> WeightSet:
        return build_weight_set(master, self.weight_format, self.hp_dtype, self.high_precision)

    def _deliver(self, target: Target, updates: _Updates) -> Delivery:
        start = time.perf_counter()
        if self.weight_transfer:
            delivered = self._deliver_on_device(target, updates, start)
            if delivered is not None:
                return delivered
        update = updates.for_held(target.held_version)
        plane, reply = GRPC, weights_pb2.UpdateWeightsResponse()
        try:
            try:
                plane, reply = self._send(target.address, update, fresh=target.held_version < 0)
            except grpc.RpcError as exc:
                if update.encoding == "keyframe" or update.error is not None or exc.code() in _NOT_HEALED:
                    raise
                # FAILED_PRECONDITION: the target holds another version. Anything else (but _NOT_HEALED):
                # the delta did not apply. Either way nothing changed there, and a keyframe heals it.
                log.warning(
                    "delta to %s refused (%s: %s); sending a keyframe",
                    target.address,
                    exc.code().name,
                    exc.details(),
                )
                update = updates.keyframe()
                plane, reply = self._send(target.address, update)
        except grpc.RpcError as exc:
            if update.error is not None:  # our encoder failed, not the target: the publish fails
                raise RuntimeError(f"encoding the {update.encoding} failed") from update.error
            return Delivery(
                target.address,
                False,
                update.encoding,
                0,
                0.0,
                time.perf_counter() - start,
                f"{exc.code().name}: {exc.details()}",
                plane,
            )
        wire_bytes, density = update.totals()
        seconds = time.perf_counter() - start
        return Delivery(
            target.address, True, update.encoding, wire_bytes, density, seconds, "", plane, reply.apply_s
        )

    def _send(
        self, address: str, update: _Streamed, fresh: bool = False
    ) -> tuple[str, weights_pb2.UpdateWeightsResponse]:
        """Stream ``update`` to ``address``; returns the plane that carried its data, and the reply."""
        stub = rollout_pb2_grpc.RolloutStub(self._channel(address))
        reach = self._reach_of(address, stub, fresh)
        tcp_streams = self.tcp_streams if time.monotonic() >= self._tcp_paused.get(address, 0.0) else 0
        if reach.inbox or (reach.tcp_port and tcp_streams):
            planes = _Planes(reach, address, tcp_streams, self._tcp_tls if reach.tcp_tls else None)
            try:
                reply = stub.UpdateWeights(update.chunks(planes), timeout=UPDATE_DEADLINE_S)
            except grpc.RpcError as exc:
                planes.close(abort=True)
                self._reach.pop(address, None)  # asked again next time
                # The plane itself failed (a segment the replica could not take, a connection that broke):
                # nothing changed there (an update lands whole or not at all), and the same bytes go over
                # gRPC.
                details = exc.details() or ""
                named = "shared" in details or "tcp" in details
                plane_failed = planes.broken or (exc.code() == grpc.StatusCode.INVALID_ARGUMENT and named)
                if not plane_failed or update.error is not None:
                    raise
                log.warning("update to %s over %s failed (%s); over gRPC", address, planes.plane, details)
            else:
                return planes.plane, reply
            finally:
                planes.close()
                if planes.tcp_failed or planes.broken:  # (not tried again for a while: a link in trouble)
                    self._tcp_paused[address] = time.monotonic() + TCP_PAUSE_S
        return GRPC, stub.UpdateWeights(update.chunks(), timeout=UPDATE_DEADLINE_S)

    def _deliver_on_device(self, target: Target, updates: _Updates, start: float) -> Delivery | None:
        """The set as a keyframe over the target's device plane; None where it has none (or one of
        another device), or it failed (then the plane is left alone for a while, and the update goes
        over gRPC)."""
        address = target.address
        stub = rollout_pb2_grpc.RolloutStub(self._channel(address))
        fresh = target.held_version < 0  # (a restarted replica: its group went with its engine)
        reach = self._reach_of(address, stub, fresh)
        usable = reach.weight_transfer == BROADCAST_BACKEND and reach.device == self.device.type
        if not usable or time.monotonic() < self._device_paused.get(address, 0.0):
            return None
        try:
            if fresh and (stale := self._device_planes.pop(address, None)) is not None:
                stale.close()
            plane = self._device_planes.get(address)
            if plane is None:
                plane = DevicePlane(address, stub, reach.transfer_ranks, self.device, self.transfer_timeout_s)
                self._device_planes[address] = plane
            reply = plane.send(updates.device_payload(self.device), UPDATE_DEADLINE_S)
        except (grpc.RpcError, OSError, RuntimeError, ValueError) as exc:
            details = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            log.warning("update to %s over its device plane failed (%s); over gRPC", address, details)
            failed = self._device_planes.pop(address, None)
            if failed is not None:
                failed.close()
            self._device_paused[address] = time.monotonic() + TCP_PAUSE_S
            self._reach.pop(address, None)
            return None
        seconds = time.perf_counter() - start
        nbytes = updates.weights.nbytes
        return Delivery(address, True, "keyframe", nbytes, 1.0, seconds, "", DEVICE, reply.apply_s)

    def _channel(self, address: str) -> grpc.Channel:
        with self._channels_lock:
            if address not in self._channels:
                # (bulk: its pings wait behind the updates it sends; fp8rl/transport.py)
                self._channels[address] = channel(address, self.security, "rollout", bulk=True)
            return self._channels[address]

    def _reach_of(self, address: str, stub: rollout_pb2_grpc.RolloutStub, fresh: bool) -> Reach:
        """The target's data planes, asked once per address, and again when the target holds nothing
        (``fresh``: a replica that restarted names a new inbox and port) or an update to it failed."""
        if not self.shared_memory and not self.tcp_streams and not self.weight_transfer:
            return Reach()
        if fresh or address not in self._reach:
            try:
                status = stub.GetStatus(common_pb2.GetStatusRequest(), timeout=10)
            except grpc.RpcError:
                return Reach()  # (the update itself says what is wrong)
            # TLS where the replica's port speaks it; a trainer without the CA cannot check that port's
            # certificate, and sends those bytes over gRPC.
            tcp = self.tcp_streams and (self._tcp_tls is not None or not status.tcp_updates_tls)
            self._reach[address] = Reach(
                status.segment_inbox if self.shared_memory else "",
                status.tcp_updates_port if tcp else 0,
                status.tcp_updates_tls,
                status.weight_transfer if self.weight_transfer else "",
                status.weight_transfer_ranks,
                status.device,
            )
        return self._reach[address]

    def close(self) -> None:
        for plane in self._device_planes.values():
            plane.close()
        self._device_planes.clear()
        with self._channels_lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


class _Planes:
    """Where one stream to one target sends each part's bytes: its inbox while hand-overs succeed, else
    its TCP plane while its connections hold (made when a part first needs them), else the stream. An
    inbox that turns out to be out of reach from here is marked in the target's ``reach``, so that later
    updates do not try it again; a TCP plane that cannot be reached says so in ``tcp_failed``."""

    def __init__(self, reach: Reach, address: str, streams: int, tls: ssl.SSLContext | None) -> None:
        self.reach, self.streams, self.tls = reach, streams, tls
        self.host = address.rsplit(":", 1)[0].strip("[]")
        self.inbox = reach.inbox  # "" once a hand-over fails: the rest of this stream goes another way
        self.carried: list[str] = []
        self.sender: TcpSender | None = None
        self.tcp_failed = False  # its connections could not be made
        self.broken = False  # a TCP connection failed during the update
        self._closed = False
        self._lock = threading.Lock()  # (gRPC's request thread may still ask while the call ends)

    def tcp_sender(self) -> TcpSender | None:
        """The connections to the target's TCP plane (None: it has none, cannot be reached, failed, or
        the call is over)."""
        with self._lock:
            if self._closed or self.tcp_failed or not (self.reach.tcp_port and self.streams):
                return None
            if self.sender is None:
                try:
                    self.sender = TcpSender(self.host, self.reach.tcp_port, self.streams, self.tls)
                except OSError as exc:
                    log.info("no TCP plane to %s:%d (%s)", self.host, self.reach.tcp_port, exc)
                    self.tcp_failed = True
                    return None
            if self.sender.failed:
                self.broken = True
                return None
            return self.sender

    def check_tcp(self) -> None:
        """Raise where a TCP connection broke: the parts it carried will not arrive, and the call must
        end (the replica then drops the update, and the publisher sends it again over gRPC)."""
        if self.sender is not None and self.sender.failed:
            self.broken = True
            raise ConnectionError(f"the TCP plane to {self.host} broke: {self.sender.error}")

    @property
    def plane(self) -> str:
        used = set(self.carried)
        return used.pop() if len(used) == 1 else MIXED if used else GRPC

    def close(self, abort: bool = False) -> None:
        """Close the TCP connections (``abort``: at once, whatever is queued); later calls do nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.reach.inbox and SHARED_MEMORY not in self.carried:
            self.reach.inbox = ""  # out of reach from here (another host or network namespace)
        if self.sender is not None:
            self.broken = self.broken or self.sender.failed
            self.sender.abort() if abort else self.sender.close()


class _Streamed:
    """One update, encoded part by part on a thread of its own and each part signed as it is done; every
    target's stream sends the parts as they come (the next part is encoded while this one travels and is
    applied), and each distinct update is encoded once, however many targets need it."""

    def __init__(
        self, encoding: str, parts: Iterator[EncodedUpdate], epoch: int, signer: Ed25519PrivateKey | None
    ) -> None:
        self.encoding = encoding
        self._parts: list[tuple[EncodedUpdate, weights_pb2.WeightHeader]] = []
        self._segments: dict[int, int] = {}  # part -> its sealed memfd, written once for every target
        self._segments_lock = threading.Lock()
        self._segments_closed = False
        self._done = False
        self.error: BaseException | None = None
        self._ready = threading.Condition()
        self._cancelled = threading.Event()
        self._encoder = threading.Thread(
            target=self._encode, args=(parts, epoch, signer), name=f"encode-{encoding}", daemon=True
        )
        self._encoder.start()

    def cancel(self) -> None:
        """Stop encoding (after the part under way) and wait for the encoder: nobody needs the rest;
        close the segments (a replica that mapped one keeps its pages)."""
        self._cancelled.set()
        self._encoder.join()
        with self._segments_lock:
            self._segments_closed = True  # (a stream still asking gets none)
            for fd in self._segments.values():
                os.close(fd)
            self._segments.clear()

    def _encode(self, parts: Iterator[EncodedUpdate], epoch: int, signer: Ed25519PrivateKey | None) -> None:
        try:
            for part in parts:
                if self._cancelled.is_set():  # (a stream still reading ends short: refused whole)
                    return
                signed = (part, header_of(part, epoch, signer))
                with self._ready:
                    self._parts.append(signed)
                    self._ready.notify_all()
        except BaseException as exc:
            log.exception("encoding a %s failed", self.encoding)
            self.error = exc
        finally:
            with self._ready:
                self._done = True
                self._ready.notify_all()

    def chunks(self, planes: _Planes | None = None) -> Iterator[weights_pb2.WeightChunk]:
        """The stream's messages, each part's as soon as it is encoded; with the target's ``planes``, each
        part's data by the first of them that takes it (``planes.carried`` gets each part's plane). A
        failed encode ends the stream with an error (gRPC cancels the call, and the target puts back what
        it applied)."""
        for part, header in self._signed():
            if planes is None:
                yield from update_to_chunks(part, header=header)
                continue
            planes.check_tcp()
            token = self._hand_over(planes.inbox, header.part, part) if planes.inbox else None
            if token is None:
                planes.inbox = ""  # (the rest of this stream goes another way)
            sender = planes.tcp_sender() if token is None else None
            if token is not None:
                planes.carried.append(SHARED_MEMORY)
                yield weights_pb2.WeightChunk(header=header)
                yield weights_pb2.WeightChunk(shared=weights_pb2.SharedSegment(token=token))
            elif sender is not None:
                ticket = new_ticket()
                sender.send(ticket, part.segments)  # (its frames wait at the replica until it is named)
                planes.carried.append(TCP)
                yield weights_pb2.WeightChunk(header=header)
                yield weights_pb2.WeightChunk(tcp=weights_pb2.TcpPart(ticket=ticket))
            else:
                planes.carried.append(GRPC)
                yield from update_to_chunks(part, header=header)
        if planes is not None and planes.sender is not None:
            planes.sender.flush()  # (the call ends now where a connection broke: the replica waits no more)
            planes.check_tcp()

    def _hand_over(self, inbox: str, index: int, part: EncodedUpdate) -> bytes | None:
        """The token under which ``inbox`` took part ``index``; None where it did not (its segment could
        not be made either: out of memory or descriptors)."""
        with self._segments_lock:
            known = index in self._segments
        if not known:
            try:
                made = sealed_segment(part.segments, part.wire_bytes)  # (written outside the lock)
            except OSError as exc:
                log.warning("no shared-memory segment for part %d (%s): over gRPC", index, exc)
                return None
            with self._segments_lock:
                if self._segments_closed or index in self._segments:  # (another target's stream won)
                    os.close(made)
                else:
                    self._segments[index] = made
        with self._segments_lock:  # our own descriptor: cancel() may close the shared one meanwhile
            if self._segments_closed:
                return None
            fd = os.dup(self._segments[index])
        try:
            return hand_over(inbox, fd)
        finally:
            os.close(fd)

    def _signed(self) -> Iterator[tuple[EncodedUpdate, weights_pb2.WeightHeader]]:
        sent = 0
        while True:
            with self._ready:
                while len(self._parts) == sent and not self._done:
                    self._ready.wait()
                if sent == len(self._parts):
                    if self.error is not None:
                        raise RuntimeError(f"encoding the {self.encoding} failed") from self.error
                    return
                signed = self._parts[sent]
            yield signed
            sent += 1

    def totals(self) -> tuple[int, float]:
        """(wire bytes, density) of the whole update, once it is encoded."""
        parts = [part for part, _ in self._signed()]
        changed, covered = sum(p.changed_bytes for p in parts), sum(p.tensor_bytes for p in parts)
        return sum(p.wire_bytes for p in parts), changed_fraction(parts[0].encoding, changed, covered)


class _Updates:
    """Encodes (and signs) each distinct update once, however many targets need it."""

    def __init__(
        self,
        weights: WeightSet,
        version: int,
        base: tuple[int, WeightSet] | None,
        recipe: str,
        epoch: int,
        signer: Ed25519PrivateKey | None,
        part_bytes: int,
    ) -> None:
        self.weights, self.version, self.base, self.recipe = weights, version, base, recipe
        self.epoch, self.signer, self.part_bytes = epoch, signer, part_bytes
        self._cache: dict[str, _Streamed] = {}
        self._lock = threading.Lock()
        self._payload: DevicePayload | None = None  # the device planes' update, built once if needed
        self._payload_lock = threading.Lock()

    def device_payload(self, device: torch.device) -> DevicePayload:
        """The update as every device plane sends it (tensors on ``device``, their signed plan)."""
        with self._payload_lock:
            if self._payload is None:
                self._payload = DevicePayload.build(
                    self.weights, self.version, self.epoch, self.recipe, self.signer, device
                )
            return self._payload

    def for_held(self, held_version: int) -> _Streamed:
        """A delta for a target holding the last published version (a tiny one if that is ``version``
        itself, which still proves it holds those exact bytes); a keyframe otherwise."""
        base = self.base
        if base is None or held_version != base[0]:
            return self.keyframe()
        return self._get(
            "delta",
            lambda: delta_parts(self.weights, base[1], self.version, base[0], self.recipe, self.part_bytes),
        )

    def keyframe(self) -> _Streamed:
        return self._get(
            "keyframe", lambda: keyframe_parts(self.weights, self.version, self.recipe, self.part_bytes)
        )

    def close(self) -> None:
        """Stop encoders no target reads any more (every target's stream failed early)."""
        with self._lock:
            for streamed in self._cache.values():
                streamed.cancel()

    def _get(self, kind: str, parts: Callable[[], Iterator[EncodedUpdate]]) -> _Streamed:
        with self._lock:
            if kind not in self._cache:
                self._cache[kind] = _Streamed(kind, parts(), self.epoch, self.signer)
            return self._cache[kind]
