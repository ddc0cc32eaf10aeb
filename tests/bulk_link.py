"""Both ends of a weight-update transfer, each run in a network namespace of its own
(tests/integration/test_slow_link.py): the channels, servers, keepalive and message size the services
use, with a receiver that only counts what arrives.

    python -m tests.bulk_link serve SECRETS HOST PORT      # prints "serving", then serves until SIGTERM
    python -m tests.bulk_link send SECRETS ADDRESS STREAMS MIB
        # STREAMS updates of MIB MiB at once, each on a connection of its own; one JSON line per update
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from fp8rl.codec.stream import MESSAGE_BYTES
from fp8rl.run_secrets import security_for
from fp8rl.serving import idle_limited, start_server
from fp8rl.transport import channel
from fp8rl.v1 import rollout_pb2_grpc, weights_pb2
from rollout_service.config import RolloutConfig


class Receiver(rollout_pb2_grpc.RolloutServicer):
    """A replica's UpdateWeights as far as the wire goes: the same idle limit, every byte counted."""

    def UpdateWeights(self, request_iterator, context):  # type: ignore[no-untyped-def]
        received = 0
        for chunk in idle_limited(request_iterator, context, RolloutConfig().stream_idle_s):
            received += len(chunk.data)
        return weights_pb2.UpdateWeightsResponse(bytes_received=received)


def serve(secrets: Path, host: str, port: int) -> None:
    running = start_server(
        lambda server: rollout_pb2_grpc.add_RolloutServicer_to_server(Receiver(), server),
        ["fp8rl.v1.Rollout"],
        host=host,
        port=port,
        security=security_for(secrets, "replica", tls=True),
    )
    print("serving", flush=True)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    stopped.wait()
    running.stop(0)


def send(secrets: Path, address: str, streams: int, mib: float) -> None:
    security = security_for(secrets, "trainer", tls=True)
    size = int(mib * 2**20)
    data = os.urandom(min(size, MESSAGE_BYTES))
    started = time.monotonic()

    def chunks() -> Iterator[weights_pb2.WeightChunk]:
        for offset in range(0, size, MESSAGE_BYTES):
            yield weights_pb2.WeightChunk(data=data[: min(MESSAGE_BYTES, size - offset)])

    def one(index: int) -> None:
        # A connection each, as the trainer has one per replica: the updates compete for the link.
        with channel(address, security, "rollout", options=[("grpc.channel_id", index)], bulk=True) as chan:
            try:
                reply = rollout_pb2_grpc.RolloutStub(chan).UpdateWeights(chunks(), timeout=600)
                outcome = {"bytes": reply.bytes_received}
            except grpc.RpcError as exc:
                outcome = {"code": exc.code().name, "details": exc.details()}
        print(json.dumps({"update": index, "s": round(time.monotonic() - started, 1), **outcome}), flush=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    command, secrets_dir, *rest = sys.argv[1:]
    if command == "serve":
        serve(Path(secrets_dir), rest[0], int(rest[1]))
    else:
        send(Path(secrets_dir), rest[0], int(rest[1]), float(rest[2]))
