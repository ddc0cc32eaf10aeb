"""Embedded mode's child processes: a private redis-server, the trainer and one rollout replica, all on
loopback. Children die with the coordinator (PR_SET_PDEATHSIG), even when it is killed with SIGKILL,
and are otherwise stopped by PID — never by name."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Literal

from fp8rl.credentials import PASSWORD_ENV, redis_config_string, redis_url_with_password, write_private
from fp8rl.healthcheck import serving
from fp8rl.security import SecurityConfig
from fp8rl.serving import BOUND_LINE

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def free_port(preferred: int | None = None) -> int:
    """A port free on loopback: ``preferred`` if it is (as a server binds it, reusing TIME_WAIT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", preferred or 0))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Child:
    def __init__(self, name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.log_path = name, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            self._log_start = out.tell()  # a resumed run appends to the log of the last one
            # Own session: a terminal's Ctrl-C reaches the coordinator only, which stops children in order.
            self.proc = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_bytes(self) -> bytes:
        """What the child has written to its log (not what earlier runs appended before it)."""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_start)
            return f.read()

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(
                f"{self.name} exited with status {self.proc.returncode}; log {self.log_path}:\n{tail}"
            )

    def bound_address(self, timeout: float = 300) -> str:
        """The ``host:port`` the child reports it bound (:data:`fp8rl.serving.BOUND_LINE`)."""
        deadline = time.monotonic() + timeout
        while True:  # (looked for once at least, with a timeout of 0)
            self.check_alive()
            found = re.search(BOUND_LINE, self.log_bytes().decode(errors="replace"))
            if found:
                return found.group(1)
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.name} did not report its port within {timeout:.0f}s ({self.log_path})"
                )
            time.sleep(0.1)

    def stop(self, timeout: float = 20) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def is_serving(
    address: str, server: Literal["trainer", "rollout"], security: SecurityConfig | None, timeout: float = 2
) -> bool:
    """Whether the gRPC health service at ``address`` says SERVING now."""
    service = {"trainer": "fp8rl.v1.Trainer", "rollout": "fp8rl.v1.Rollout"}[server]
    return serving(address, service, timeout, security, server)


def wait_healthy_address(
    address: str,
    server: Literal["trainer", "rollout"],
    security: SecurityConfig | None,
    timeout: float,
    check_alive: Callable[[], None] = lambda: None,
) -> None:
    """Until the service at ``address`` says SERVING, or ``check_alive`` raises (its process died), or
    ``timeout`` passes (TimeoutError)."""
    deadline = time.monotonic() + timeout
    while True:
        check_alive()
        if is_serving(address, server, security):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{server} at {address} not healthy after {timeout:.0f}s")
        time.sleep(0.5)


def wait_healthy(
    child: Child,
    address: str,
    server: Literal["trainer", "rollout"],
    security: SecurityConfig | None = None,
    timeout: float = 600,
) -> None:
    """Until the child's gRPC health service says SERVING (or the child dies, or time runs out)."""
    wait_healthy_address(address, server, security, timeout, child.check_alive)


PORT_TRIES = 3


def start_redis(
    stack: ExitStack,
    data_dir: Path,
    log: Path,
    port: int | None = None,
    aof: bool = True,
    watch: list[Child] | None = None,
    password: str | None = None,
    preferred: int | None = None,
) -> tuple[str, int]:
    """A private redis-server on loopback keeping its files in ``data_dir``; with ``aof`` every write is
    fsynced to an append-only file, so a restart on the same ``data_dir`` resumes. Returns its URL and
    PID, once it has loaded its data; ``stack`` stops it. On ``port`` (taken: RuntimeError), else on a
    free one, ``preferred`` where it is free. redis-server cannot bind port 0, and a port picked free can
    be taken before it binds: then it exits ("Address already in use") and another port is picked, up to
    PORT_TRIES times. Only a server that reports the child's PID is taken for it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    args = ["redis-server"]
    if password:  # in a 0600 config file, not in argv (which `ps` shows to every user)
        conf = data_dir / "redis.conf"
        write_private(conf, f"requirepass {redis_config_string(password)}\n")
        args.append(str(conf))
    args += ["--bind", "127.0.0.1", "--dir", str(data_dir), "--save", "", "--protected-mode", "yes"]
    if aof:
        args += ["--appendonly", "yes", "--appendfsync", "always"]
    for attempt in range(PORT_TRIES):
        chosen = port or free_port(preferred if attempt == 0 else None)
        url = redis_url_with_password(f"redis://127.0.0.1:{chosen}/0", {PASSWORD_ENV: password or ""})
        child = Child("redis-server", [*args, "--port", str(chosen)], log)
        try:
            if _answers_as(child, url):
                break
        except BaseException:
            child.stop()
            raise
        child.stop()
        if port:
            raise RuntimeError(f"redis-server: port {port} is taken by another process")
    else:
        raise RuntimeError(
            f"redis-server: the free port picked was taken before it bound, {PORT_TRIES} times"
        )
    stack.callback(child.stop)
    if watch is not None:
        watch.append(child)
    return url, child.pid


def _answers_as(child: Child, url: str, timeout: float = 30) -> bool:
    """Whether the redis-server ``child`` comes to answer at ``url``, its data loaded; False when its port
    was taken (it exits saying so, and until then whatever answers there is another process: one that
    accepts and never replies is cut off by the socket timeout)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    deadline = time.monotonic() + timeout
    while True:
        if child.proc.poll() is not None:
            if b"Address already in use" in child.log_bytes():
                return False
            child.check_alive()  # (raises, with its log)
        try:  # (INFO answers while the AOF replays; PING waits until it is done)
            if client.info("server")["process_id"] == child.pid and client.ping():
                return True
        except redis.RedisError:
            pass  # still starting, replaying its AOF, or another server (another password, not redis)
        if time.monotonic() > deadline:
            raise TimeoutError("redis-server did not start")
        time.sleep(0.1)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
