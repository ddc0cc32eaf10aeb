"""The coordinator's replica pool against a real replica (vLLM behind gRPC) and a dead one (its port held
by this test, bound but never listening, so nothing answers there): a replica that fails is dropped for
the step and its prompts move to a healthy one; with none left the step fails loudly."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc
import pytest

from coordinator.clients import ReplicaFailed, RolloutPool
from fp8rl.v1 import common_pb2, rollout_pb2
from tests.conftest import InProcessRollout

GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=3)


@pytest.fixture
def dead_address() -> Iterator[str]:
    """A loopback address that refuses connections for the whole test: its port is bound (so nothing else
    takes it) and never listened on."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{held.getsockname()[1]}"


def test_failed_replicas_prompts_move_to_a_healthy_one(
    rollout_fp8: InProcessRollout, dead_address: str
) -> None:
    live, dead = rollout_fp8.server.address, dead_address
    pool = RolloutPool(lambda: [dead, live])
    try:
        held = pool.held_versions()
        assert list(held) == [live]  # the dead replica is dropped for the step
        prompts = [rollout_pb2.Prompt(id=f"p{i}", text=f"{i}+{i}=") for i in range(6)]
        failures: list[tuple[str, grpc.StatusCode]] = []
        completions = pool.generate(
            prompts, 2, GREEDY, held[live], [dead, live], lambda a, exc: failures.append((a, exc.code()))
        )
        assert failures == [(dead, grpc.StatusCode.UNAVAILABLE)]
        # Every prompt answered exactly n times, the dead replica's half by the live one.
        assert sorted((c.prompt_id, c.sample_index) for c in completions) == sorted(
            (p.id, s) for p in prompts for s in range(2)
        )
        with pytest.raises(ReplicaFailed, match="every replica failed"):
            pool.generate(prompts, 1, GREEDY, -1, [dead], lambda a, exc: None)
    finally:
        pool.close()
    only_dead = RolloutPool(lambda: [dead])
    with pytest.raises(ReplicaFailed, match="no rollout replica is reachable"):
        only_dead.held_versions()
    only_dead.close()
