"""gRPC edge of the rollout service: messages in, messages out, errors mapped by fp8rl.serving."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator

import grpc

from fp8rl.codec.stream import receive_parts
from fp8rl.errors import Cancelled, NotReady
from fp8rl.security import is_run_caller
from fp8rl.serving import Capacity, idle_limited, map_errors, read_ahead
from fp8rl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, weights_pb2
from rollout_service.service import RolloutService, UpdateResult

SERVICE_NAME = "fp8rl.v1.Rollout"


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    """Serves as soon as it is bound; every call answers UNAVAILABLE until the engine is attached."""

    def __init__(
        self,
        service: RolloutService | None = None,
        generate_slots: int = 10,
        run_slots: int = 0,
        wait_s: float = 0.0,
    ) -> None:
        self._service = service
        # (as many outside calls may wait for a slot as outside callers have slots; rollout_service/cli.py
        # gives the server that many more threads)
        self.generating = Capacity(
            "Generate", generate_slots, reserved=run_slots, waiting=generate_slots - run_slots, wait_s=wait_s
        )
        self.updating = Capacity("UpdateWeights", 2)  # one applying, the next one arriving

    def attach(self, service: RolloutService) -> None:
        self._service = service

    @property
    def service(self) -> RolloutService:
        if self._service is None:
            raise NotReady("the engine is still loading")
        return self._service

    @map_errors
    def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        run = is_run_caller()
        with self.generating.slot(run):
            if not context.is_active():  # (gone while it waited for the slot)
                raise Cancelled("the caller went away while waiting for a Generate slot")
            generation = self.service.generate(request, run=run)
            context.add_callback(generation.cancel)  # runs at the end of every RPC; no-op once all finished
            order = {p.id or str(i): i for i, p in enumerate(request.prompts)}
            completions = sorted(generation, key=lambda c: (order[c.prompt_id], c.sample_index))
        version = completions[0].weight_version if completions else self.service.version
        usage = rollout_pb2.Usage(
            prompt_tokens=sum(len(c.prompt_token_ids) for c in completions if c.sample_index == 0),
            completion_tokens=sum(len(c.token_ids) for c in completions),
        )
        return rollout_pb2.GenerateResponse(completions=completions, weight_version=version, usage=usage)

    @map_errors
    def GenerateStream(
        self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[rollout_pb2.Completion]:
        run = is_run_caller()
        with self.generating.slot(run):
            if not context.is_active():  # (gone while it waited for the slot)
                raise Cancelled("the caller went away while waiting for a Generate slot")
            generation = self.service.generate(request, run=run)
            context.add_callback(generation.cancel)  # the client went away: abort what is left
            yield from generation

    @map_errors
    def UpdateWeights(
        self, request_iterator: Iterable[weights_pb2.WeightChunk], context: grpc.ServicerContext
    ) -> weights_pb2.UpdateWeightsResponse:
        with self.updating.slot():
            chunks = idle_limited(request_iterator, context, self.service.config.stream_idle_s)
            # Each part is received (and its signature checked) while the one before it is applied; the
            # reading thread stops when this call ends, however it ends.
            service = self.service
            parts = receive_parts(
                chunks,
                service.max_update_bytes,
                service.update_public_key,
                service.segments,
                service.tcp_inbox,
                context.is_active,
            )
            with contextlib.closing(read_ahead(parts)) as ahead:
                result = self.service.update_weights(ahead)
        return _response(result)

    @map_errors
    def JoinWeightTransfer(
        self, request: weights_pb2.WeightTransferJoin, context: grpc.ServicerContext
    ) -> weights_pb2.WeightTransferJoined:
        with self.updating.slot():
            ranks = self.service.join_weight_transfer(request, peer_host(context.peer()))
            return weights_pb2.WeightTransferJoined(ranks=ranks)

    @map_errors
    def UpdateWeightsOnDevice(
        self, request: weights_pb2.DeviceUpdate, context: grpc.ServicerContext
    ) -> Iterator[weights_pb2.DeviceUpdateReply]:
        """``receiving`` once the plan passed every check (the trainer broadcasts only then), ``applied``
        once the engine serves it: the update runs on a thread of its own while this call answers."""
        with self.updating.slot():
            events: queue.Queue[object] = queue.Queue()
            work = threading.Thread(
                target=_run_into,
                args=(events, lambda: self.service.update_on_device(request, lambda: events.put(_RECEIVING))),
                name="device-update",
                daemon=True,
            )
            work.start()
            while True:
                event = events.get()
                if event is _RECEIVING:
                    yield weights_pb2.DeviceUpdateReply(receiving=True)
                elif isinstance(event, BaseException):
                    raise event
                else:
                    assert isinstance(event, UpdateResult)
                    yield weights_pb2.DeviceUpdateReply(applied=_response(event))
                    return

    @map_errors
    def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.RolloutStatus:
        return self.service.status()


_RECEIVING = object()


def _response(result: UpdateResult) -> weights_pb2.UpdateWeightsResponse:
    return weights_pb2.UpdateWeightsResponse(
        version=result.version,
        encoding=result.encoding,
        bytes_received=result.bytes_received,
        tensors_updated=result.tensors_updated,
        apply_s=result.apply_s,
    )


def _run_into(events: queue.Queue[object], work: Callable[[], object]) -> None:
    """``work``'s result, or what it raised, into ``events``."""
    try:
        events.put(work())
    except BaseException as exc:
        events.put(exc)


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string ("ipv4:10.0.0.1:5000", "ipv6:[::1]:5000"): "" for another kind."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    return rest.rsplit(":", 1)[0].strip("[]")
