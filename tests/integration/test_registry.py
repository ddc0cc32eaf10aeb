"""Replica discovery against a real redis-server: the heartbeat keeps a replica listed, and rides out a
Redis that stops answering and comes back, as a killed container does under compose."""

from __future__ import annotations

import logging
import os
import signal
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from coordinator.processes import start_redis
from fp8rl.redis_link import connect
from fp8rl.registry import Heartbeat, live_replicas

BEAT_S = 0.5


def wait_for(condition, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_the_heartbeat_rides_out_a_redis_that_vanishes_without_a_word(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found under compose: after a kill -9 of Redis' container, the replicas' heartbeat blocked for good
    on a connection that never answered (its client had no deadline), so no replica was listed again. A
    stopped redis-server answers nothing either: each beat must fail within its deadline, and the next
    ones find the new server."""
    with ExitStack() as stack:
        url, pid = start_redis(stack, tmp_path / "first", tmp_path / "first.log", aof=False)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        beat = Heartbeat(connect(url, timeout_s=BEAT_S, retries=0), "replica:1", {"model": "m"}, BEAT_S)
        stack.callback(beat.stop)
        observer = connect(url)
        assert list(live_replicas(observer)) == ["replica:1"]

        caplog.set_level(logging.WARNING, logger="fp8rl.registry")
        os.kill(pid, signal.SIGSTOP)  # the socket stays open; nothing comes back
        try:
            assert wait_for(lambda: "heartbeat to redis failed" in caplog.text, timeout_s=4 * BEAT_S + 2)
        finally:
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
        start_redis(stack, tmp_path / "second", tmp_path / "second.log", port=port, aof=False)
        assert wait_for(lambda: list(live_replicas(observer)) == ["replica:1"])
        beat.stop()
        assert live_replicas(observer) == {}
