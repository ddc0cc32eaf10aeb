"""Replica discovery against a real redis-server: the heartbeat keeps a replica listed, and rides out a
Redis that stops answering and comes back, as a killed container does under compose."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlsplit

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


def test_a_redis_started_where_another_server_took_its_port_is_never_that_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port picked free can be taken before redis-server binds it (another test's server, a connection's
    ephemeral port): what answers there is then another server, which must not pass for the run's own.
    A fixed port found taken is refused; a picked one gives way to the next free port."""
    import redis

    from coordinator import processes

    with ExitStack() as stack:
        other_url, other_pid = start_redis(stack, tmp_path / "other", tmp_path / "other.log", aof=False)
        taken = urlsplit(other_url).port
        with pytest.raises(RuntimeError, match=f"port {taken} is taken"):
            start_redis(stack, tmp_path / "fixed", tmp_path / "fixed.log", port=taken, aof=False)
        picks, real = iter([taken]), processes.free_port  # the race, made certain: the first pick is taken
        monkeypatch.setattr(processes, "free_port", lambda preferred=None: next(picks, 0) or real(preferred))
        url, pid = start_redis(stack, tmp_path / "mine", tmp_path / "mine.log", aof=False)
        assert pid != other_pid and urlsplit(url).port != taken
        assert redis.Redis.from_url(url).info("server")["process_id"] == pid
        assert b"Address already in use" in (tmp_path / "mine.log").read_bytes()  # (the first try's)


def test_an_embedded_runs_kept_redis_port_never_stops_it_from_starting(tmp_path: Path) -> None:
    """Found in review: the port file, torn by a full disk (empty) or damaged, made every later start of
    the run fail on int(''). A port that does not read as one is no port; a taken one gives way to a new
    one (free_port)."""
    from coordinator.embedded import kept_port
    from coordinator.processes import free_port

    port_file = tmp_path / "port"
    assert kept_port(port_file) is None
    for damaged in ("", "x", "-1", "70000"):
        port_file.write_text(damaged)
        assert kept_port(port_file) is None
    port_file.write_text("41234")
    assert kept_port(port_file) == 41234
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        assert free_port(busy) != busy


def test_a_replica_registers_once_redis_answers_though_it_did_not_at_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found in review: the first beat was sent in line and its error ended the replica's start, so a
    Redis restarting just as a replica finished loading (minutes of vLLM) cost the replica."""
    from coordinator.processes import free_port

    caplog.set_level(logging.WARNING, logger="fp8rl.registry")
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    beat = Heartbeat(connect(url, timeout_s=BEAT_S, retries=0), "replica:2", {}, BEAT_S)
    try:
        assert "heartbeat to redis failed" in caplog.text
        with ExitStack() as stack:
            start_redis(stack, tmp_path / "redis", tmp_path / "redis.log", port=port, aof=False)
            assert wait_for(lambda: list(live_replicas(connect(url))) == ["replica:2"])
            beat.stop()
    finally:
        beat.stop()
