"""Run state rules against a real redis-server: config immutability, one leader, fencing, CAS."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from coordinator.driver import coordinator_is_dead
from coordinator.state import ConfigMismatch, LeaseLost, RunState, RunStore
from fp8rl import redis_link
from tests.support import redis_server


def store(redis_client: redis.Redis, run: str) -> RunStore:
    return RunStore(redis_client, run)


def test_config_is_immutable_once_written(redis_client: redis.Redis) -> None:
    a = store(redis_client, "cfg")
    assert a.init_config({"recipe": "fp8", "lr": 1e-5, "loss": {"clip": 0.2}}, "h1")
    assert not a.init_config({"recipe": "fp8", "lr": 1e-5, "loss": {"clip": 0.2}}, "h1")
    with pytest.raises(ConfigMismatch, match=r"differing fields: loss\.clip, lr"):
        a.init_config({"recipe": "fp8", "lr": 1e-4, "loss": {"clip": 0.3}}, "h2")
    assert a.read() == RunState(0, "generate")


def test_one_coordinator_drives_a_run(redis_client: redis.Redis) -> None:
    first, second = store(redis_client, "lease"), store(redis_client, "lease")
    first.init_config({}, "h")
    first.acquire("first", ttl_s=30)
    with pytest.raises(LeaseLost, match="driven by another coordinator"):
        second.acquire("second", ttl_s=30)
    first.transition(RunState(0, "generate"), RunState(0, "train"))
    first.release()
    second.acquire("second", ttl_s=30)  # free again once released
    second.transition(RunState(0, "train"), RunState(0, "publish"))


def test_a_dead_holders_lease_is_taken_over(redis_client: redis.Redis) -> None:
    crashed, resumed = store(redis_client, "dead"), store(redis_client, "dead")
    crashed.init_config({}, "h")
    crashed.acquire("host:1", ttl_s=30)  # then killed: its lease would block the resume for 30 s
    with pytest.raises(LeaseLost, match=r"\(host:1\); its lease expires in 30 s"):
        resumed.acquire("host:2", ttl_s=30, holder_is_dead=lambda holder: holder == "host:3")
    resumed.acquire("host:2", ttl_s=30, holder_is_dead=lambda holder: holder == "host:1")
    assert int(resumed.fence) > int(crashed.fence)
    with pytest.raises(LeaseLost):
        crashed.transition(RunState(0, "generate"), RunState(0, "train"))
    resumed.transition(RunState(0, "generate"), RunState(0, "train"))


def test_coordinator_liveness_from_its_lease_holder_id() -> None:
    here = socket.gethostname()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert coordinator_is_dead(f"{here}:{gone.pid}")
    assert coordinator_is_dead(f"{here}:{os.getpid()}")  # an earlier incarnation of this very process
    assert not coordinator_is_dead(f"{here}:{os.getppid()}")
    assert not coordinator_is_dead(f"elsewhere-{here}:{gone.pid}")  # other hosts: only the TTL tells
    assert not coordinator_is_dead("garbage")


def test_stale_fencing_token_cannot_commit(redis_client: redis.Redis) -> None:
    old, new = store(redis_client, "fence"), store(redis_client, "fence")
    old.init_config({}, "h")
    old.acquire("old", ttl_s=0.2)
    old.transition(RunState(0, "generate"), RunState(0, "commit"))
    time.sleep(0.4)  # the old leader stalls past its lease; another takes over
    new.acquire("new", ttl_s=30)
    assert int(new.fence) > int(old.fence)
    with pytest.raises(LeaseLost):
        old.commit(0, {"step": 1})
    with pytest.raises(LeaseLost):
        old.renew(30)
    with pytest.raises(LeaseLost):
        old.put_batch(1, b"x", 0, {})
    with pytest.raises(LeaseLost):  # events and replica records are fenced too
        old.event("heal", "from the stale coordinator", 0)
    with pytest.raises(LeaseLost):
        old.set_replica_version("r1:50051", 7)
    assert [e["detail"] for e in new.events() if e["kind"] == "heal"] == [] and new.replica_versions() == {}
    new.event("heal", "from the leader", 0)
    new.set_replica_version("r1:50051", 1)
    assert [e["detail"] for e in new.events() if e["kind"] == "heal"] == ["from the leader"]
    assert new.replica_versions() == {"r1:50051": 1}
    assert new.metrics() == []
    new.commit(0, {"step": 1})
    assert new.metrics() == [{"step": 1}] and new.read() == RunState(1, "generate")


def test_transitions_are_compare_and_set(redis_client: redis.Redis) -> None:
    s = store(redis_client, "cas")
    s.init_config({}, "h")
    s.acquire("me", ttl_s=30)
    with pytest.raises(RuntimeError, match="state changed"):
        s.transition(RunState(0, "train"), RunState(0, "publish"))  # the run is in generate
    s.put_batch(0, b"request", 0, {"reward_mean": 0.5})
    assert s.get_batch(0) == (b"request", 0, {"reward_mean": 0.5})
    s.transition(RunState(0, "generate"), RunState(0, "commit"))
    s.commit(0, {"step": 1})
    with pytest.raises(RuntimeError, match="state changed"):
        s.transition(RunState(0, "generate"), RunState(0, "train"))  # step 0 is done
    assert s.metrics() == [{"step": 1}] and s.get_batch(0) is None
    assert s.record_base({"step": 0}) and not s.record_base({"step": 0})
    kinds = [e["kind"] for e in s.events()]
    assert kinds == ["phase", "commit"]


def test_a_write_sent_again_after_a_lost_reply_applies_once(redis_client: redis.Redis) -> None:
    """The coordinator's client (redis_link.connect) sends a call again when its reply did not come (a
    partition, a timeout): the call may have run. Transitions and commits see themselves done."""
    s = store(redis_client, "resent")
    s.init_config({}, "h")
    s.acquire("me", ttl_s=30)
    for _ in range(2):
        s.transition(RunState(0, "generate"), RunState(0, "commit"))
    for _ in range(2):
        s.commit(0, {"step": 1})
    assert s.metrics() == [{"step": 1}] and s.read() == RunState(1, "generate")
    assert [e["kind"] for e in s.events()] == ["phase", "commit"]


def test_the_coordinators_client_rides_out_a_redis_that_stops_answering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the network-fault tests: a coordinator cut off from Redis for a few seconds crashed with
    redis' TimeoutError (a traceback, exit 1). Its client now tries again (redis_link.connect)."""
    monkeypatch.setattr(redis_link, "REDIS_TIMEOUT_S", 0.3)
    with redis_server(tmp_path) as url:
        s = RunStore(redis_link.connect(url), "paused")
        s.init_config({}, "h")
        s.acquire("me", ttl_s=30)
        redis.Redis.from_url(url).client_pause(2000)  # nothing is answered for 2 s
        start = time.monotonic()
        s.transition(RunState(0, "generate"), RunState(0, "train"))
        assert time.monotonic() - start > 1.5 and s.read() == RunState(0, "train")
        assert [e["kind"] for e in s.events()] == ["phase"]


def test_release_never_deletes_another_coordinators_lease(redis_client: redis.Redis) -> None:
    first, second = store(redis_client, "release"), store(redis_client, "release")
    first.acquire("host:1", ttl_s=0.2)
    time.sleep(0.3)  # first's lease expired (it stalled); second takes the run
    second.acquire("host:2", ttl_s=30)
    first.release()  # late: compare-and-delete leaves second's lease alone
    assert redis_client.get(second.key("lease")) == b"host:2"
    second.release()
    assert redis_client.get(second.key("lease")) is None


def test_a_new_run_gets_config_hash_and_state_together(redis_client: redis.Redis) -> None:
    a = store(redis_client, "atomic-init")
    assert a.init_config({"recipe": "fp8"}, "h") and a.read() == RunState(0, "generate")
    assert redis_client.get(a.key("config_hash")) == b"h"
