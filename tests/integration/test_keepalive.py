"""A call on a connection the network stopped carrying fails within a few keepalive periods
(fp8rl/transport.py, KEEPALIVE_S), instead of waiting out its deadline: found by the network-fault tests
(tests/e2e/test_network_faults.py), where a replica partitioned during a Generate held the coordinator's
step for the Generate deadline (15 min), and a trainer partitioned during an update held the publish for
the update deadline (10 min). The silent network here is a TCP proxy stopped with SIGSTOP: the kernel
still accepts the bytes, nothing comes back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from fp8rl import transport
from fp8rl.serving import start_server
from fp8rl.v1 import rollout_pb2, rollout_pb2_grpc
from tests.support import child_process, free_port, wait_for_line


class Replies(rollout_pb2_grpc.RolloutServicer):
    def Generate(self, request, context):  # type: ignore[no-untyped-def]
        return rollout_pb2.GenerateResponse()


@pytest.fixture
def proxied(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """A stand-in replica behind tests/faultproxy.py: the proxy's address and process."""
    running = start_server(
        lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(Replies(), s), ["fp8rl.v1.Rollout"]
    )
    port, log = free_port(), tmp_path / "proxy.log"
    route = f"127.0.0.1:{port}={running.address}"
    try:
        with child_process([sys.executable, "-m", "tests.faultproxy", route], log) as proc:
            wait_for_line(proc, log, "proxying", timeout=60)
            yield f"127.0.0.1:{port}", proc
            os.kill(proc.pid, signal.SIGCONT)
    finally:
        running.stop(0)


def generate_through_silence(
    address: str, proxy: subprocess.Popen, deadline_s: float, bulk: bool = False
) -> tuple[str, float]:
    """One call that works, then one after the network went silent: its status and seconds."""
    with transport.channel(address, None, "rollout", bulk=bulk) as chan:
        stub = rollout_pb2_grpc.RolloutStub(chan)
        stub.Generate(rollout_pb2.GenerateRequest(), timeout=30)
        os.kill(proxy.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            stub.Generate(rollout_pb2.GenerateRequest(), timeout=deadline_s)
        return failed.value.code().name, time.monotonic() - start


def test_a_silent_connection_fails_unavailable_within_the_keepalive(
    proxied: tuple[str, subprocess.Popen], monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = [(k, 1000 if k.endswith("_ms") else v) for k, v in transport.CLIENT_KEEPALIVE]
    monkeypatch.setattr(transport, "CLIENT_KEEPALIVE", fast)  # (1 s: the shipped 10 s, 10 times faster)
    code, seconds = generate_through_silence(*proxied, deadline_s=20)
    assert code == "UNAVAILABLE" and seconds < 10, (code, seconds)


def test_a_bulk_channel_drops_a_silent_connection_after_its_longer_wait(
    proxied: tuple[str, subprocess.Popen], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A channel that sends updates waits longer for a ping's answer (transport.BULK_PING_TIMEOUT_S), but
    not for ever: here 10 times faster, 1 s pings answered within 6 s."""
    fast = [(k, v // 10 if k.endswith("_ms") else v) for k, v in transport.BULK_CLIENT_KEEPALIVE]
    monkeypatch.setattr(transport, "BULK_CLIENT_KEEPALIVE", fast)
    code, seconds = generate_through_silence(*proxied, deadline_s=30, bulk=True)
    assert code == "UNAVAILABLE" and 5 < seconds < 15, (code, seconds)


def test_without_keepalive_the_call_waits_out_its_deadline(
    proxied: tuple[str, subprocess.Popen], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transport, "CLIENT_KEEPALIVE", [])  # what the channels had before
    code, seconds = generate_through_silence(*proxied, deadline_s=4)
    assert code == "DEADLINE_EXCEEDED" and seconds >= 4
