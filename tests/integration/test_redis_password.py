"""Any Redis password works, spaces, quotes and backslashes included: in the embedded run's config file
(coordinator.processes.start_redis) and in compose's here-document (docker-compose.yml), each read by a
real redis-server on loopback."""

from __future__ import annotations

import re
import subprocess
from contextlib import ExitStack
from pathlib import Path

import pytest
import redis

from coordinator.processes import start_redis
from tests.support import COMPOSE, child_process, free_port, interpolate, wait_for_line

PASSWORDS = ["plain-token", "with space", 'a"quote', "back\\slash", '\\"both\\', "ends with \\"]


def refused(port: int, password: str) -> bool:
    """Whether ``password`` is refused (asked once: redis-py would retry a refusal for seconds)."""
    client = redis.Redis(host="127.0.0.1", port=port, password=password, retry=None)
    try:
        client.ping()
    except redis.AuthenticationError:
        return True
    return False


@pytest.mark.parametrize("password", PASSWORDS)
def test_an_embedded_redis_takes_the_password_as_given(password: str, tmp_path: Path) -> None:
    with ExitStack() as stack:
        url, _ = start_redis(stack, tmp_path / "data", tmp_path / "redis.log", aof=False, password=password)
        assert redis.Redis.from_url(url).ping()  # (start_redis connects with it too)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert refused(port, password + "x")


@pytest.mark.parametrize("password", PASSWORDS)
def test_the_compose_redis_config_holds_the_password_as_given(password: str, tmp_path: Path) -> None:
    script = interpolate(COMPOSE["services"]["redis"]["command"][2], {"REDIS_PASSWORD": password})
    # The configuration the shell writes, on stdout instead of redis-server's stdin.
    render = re.sub(r"exec redis-server -.*?<<EOF", "exec cat <<EOF", script, flags=re.S)
    assert render != script
    config = subprocess.run(
        ["sh", "-c", render],
        env={"REDIS_PASSWORD": password, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    port = free_port()
    args = ["redis-server", str(tmp_path / "redis.conf"), "--port", str(port), "--bind", "127.0.0.1"]
    args += ["--save", "", "--dir", str(tmp_path)]
    (tmp_path / "redis.conf").write_text(config)
    with child_process(args, tmp_path / "redis.log") as proc:
        wait_for_line(proc, tmp_path / "redis.log", r"Ready to accept connections", timeout=30)
        assert redis.Redis(host="127.0.0.1", port=port, password=password).ping()
        assert refused(port, password + "x")
