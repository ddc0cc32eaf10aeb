"""A slow link carrying updates is not a dead one. Weight updates cross a capped link between two network
namespaces (tests/netns.py; `tc tbf` with a 1 s queue), sent and received by tests/bulk_link.py with the
services' own channels, servers, keepalive and message size, under mutual TLS.

Found by hand (docs/reliability.md): with a 10 s ping timeout on every connection, two updates at once
over 1 Mbit/s lost one of them to "ping timeout" while the other's data held the link, and one update over
200 kbit/s was dropped every time: a ping goes out behind the data its sender has written, and waits for
it to drain. A silent connection still fails fast: tests/integration/test_keepalive.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fp8rl.run_secrets import write_run_secrets
from tests.netns import network, sh
from tests.support import wait_for_line

PORT = 50051


@pytest.mark.parametrize(
    ("rate", "updates", "mib"),
    [("1mbit", 2, 1.5), ("200kbit", 1, 1.0)],
    ids=["two-updates-over-1mbit", "one-update-over-200kbit"],
)
def test_updates_over_a_slow_link_arrive_whole(tmp_path: Path, rate: str, updates: int, mib: float) -> None:
    secrets = tmp_path / "secrets"
    write_run_secrets(secrets, tls=True)
    with network(["trainer", "replica"], tmp_path) as net:
        sh("ip", "netns", "exec", net.hub, "sysctl", "-qw", "net.ipv4.ip_forward=1")  # (node to node)
        replica = net.nodes["replica"].own_address
        serve = [sys.executable, "-m", "tests.bulk_link", "serve", str(secrets), replica, str(PORT)]
        log = tmp_path / "receiver.log"
        with net.process("replica", serve, log) as receiver, net.rate_limited("trainer", rate):
            wait_for_line(receiver, log, "serving", timeout=60)
            send = [sys.executable, "-m", "tests.bulk_link", "send", str(secrets), f"{replica}:{PORT}"]
            sent = subprocess.run(
                [*net.exec_prefix("trainer"), *send, str(updates), str(mib)],
                capture_output=True,
                text=True,
                timeout=300,
            )
    assert sent.returncode == 0, sent.stderr[-2000:]
    outcomes = [json.loads(line) for line in sent.stdout.splitlines()]
    assert len(outcomes) == updates, sent.stdout
    for outcome in outcomes:
        assert outcome.get("bytes") == int(mib * 2**20), outcomes


def test_the_trainer_sends_its_updates_on_bulk_channels(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the test above gives its sender: the trainer's channels to its replicas are bulk ones."""
    import torch

    from fp8rl import transport
    from trainer_service import publisher

    bulk: list[bool] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:  # (the real channel, its kind noted)
        bulk.append(kwargs.get("bulk", False))
        return transport.channel(*args, **kwargs)

    monkeypatch.setattr(publisher, "channel", recorded)
    sender = publisher.Publisher("fp8-block128", torch.float32, "fp8")
    sender._channel("127.0.0.1:1")
    sender.close()
    assert bulk == [True]
