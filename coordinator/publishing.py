"""Weights on the replicas: the trainer publishes each new version to every replica it reaches (a delta
on the version the replica holds, a keyframe for a fresh or diverged one), and the run records which
replica holds what, so a replica that restarted or fell behind is noticed and healed."""

from __future__ import annotations

import logging
import time

from coordinator.clients import ReplicaFailed, RolloutPool, TrainerClient
from coordinator.metrics import MetricsSink
from coordinator.state import RunStore
from fp8rl.v1 import trainer_pb2

log = logging.getLogger(__name__)


class Publishing:
    """The publishing phase of a step: the new version to every replica, and the run's record of who holds
    what."""

    def __init__(self, store: RunStore, trainer: TrainerClient, pool: RolloutPool, sink: MetricsSink) -> None:
        self.store, self.trainer, self.pool, self.sink = store, trainer, pool, sink

    def ensure_version(self, version: int) -> list[str]:
        """Replicas holding ``version`` after publishing it to those that do not (fresh replicas get a
        keyframe). Raises if none can be brought there."""
        held = self.pool.held_versions()
        stale = {a: v for a, v in held.items() if v != version}
        if stale:
            self.deliver(version, stale)
        ready = [a for a, v in self.pool.held_versions().items() if v == version]
        if not ready:
            raise ReplicaFailed(f"no replica could be brought to version {version}")
        return ready

    def publish(self, version: int) -> dict[str, float]:
        """Publish ``version`` to every reachable replica; the step record's sync figures."""
        start = time.perf_counter()
        results = self.deliver(version, self.pool.held_versions())
        ok = [r for r in results if r.ok]
        return {
            "publish_s": time.perf_counter() - start,
            "sync_bytes": sum(r.wire_bytes for r in ok) / max(len(ok), 1),
            "sync_density": sum(r.density for r in ok) / max(len(ok), 1),
            "sync_keyframes": sum(r.encoding == "keyframe" for r in ok),
        }

    def deliver(self, version: int, held: dict[str, int]) -> list[trainer_pb2.PublishResult]:
        recorded = self.store.replica_versions()
        reply = self.trainer.publish(version, held, self.pool.proofs)
        for r in reply.results:
            if not r.ok:
                self.store.event("publish-failed", f"{r.address}: {r.error}", version)
                log.warning("publishing version %d to %s failed: %s", version, r.address, r.error)
                continue
            self.store.set_replica_version(r.address, version)
            was = recorded.get(r.address)
            if was is not None and was != held.get(r.address):  # restarted, or diverged some other way
                reported = held.get(r.address)
                detail = (
                    f"{r.address} reported version {reported}, the run had it at {was}: sent {r.encoding}"
                )
                self.store.event("heal", detail, version)
                self.sink.say(f"recovery: {detail}")
        return list(reply.results)
