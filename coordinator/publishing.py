"""Weights on the replicas: the trainer publishes each new version to every replica it reaches (a delta
on the version the replica holds, a keyframe for a fresh or diverged one), and the run records which
replica holds what, so a replica that restarted or fell behind is noticed and healed."""

from __future__ import annotations

import itertools
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
        keyframe). While none can be reached or brought there (a partition, a restart), it tries again
        with a growing pause for the pool's ``wait_s``, then raises ReplicaFailed."""
        first_failure: float | None = None
        for attempt in itertools.count():
            try:
                held = self.pool.held_versions()
                stale = {a: v for a, v in held.items() if v != version}
                if stale:
                    self.deliver(version, stale)
                ready = [a for a, v in self.pool.held_versions().items() if v == version]
                if ready:
                    return ready
                problem = f"no replica could be brought to version {version}"
            except ReplicaFailed as exc:
                problem = str(exc)
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            waited, wait_s = now - first_failure, self.pool.wait_s
            if waited >= wait_s:
                raise ReplicaFailed(f"{problem}, after trying for {waited:.0f} s")
            if attempt == 0:
                self.store.event(
                    "replicas-unavailable", f"{problem}: trying for up to {wait_s:.0f} s", version
                )
            log.warning("%s: trying again (%.0f s of %.0f)", problem, waited, wait_s)
            time.sleep(min(0.5 * 2**attempt, 8.0, max(0.0, wait_s - waited)))
        raise AssertionError("unreachable")

    def publish(self, version: int) -> dict[str, float]:
        """Publish ``version`` to every reachable replica; the step record's sync figures."""
        start = time.perf_counter()
        results = self.deliver(version, self.pool.held_versions())
        ok = [r for r in results if r.ok]
        return {
            "publish_s": time.perf_counter() - start,
            "sync_bytes": sum(r.wire_bytes for r in ok) / max(len(ok), 1),
            "sync_density": sum(r.density for r in ok) / max(len(ok), 1),
            "sync_replicas": len(ok),
            "sync_keyframes": sum(r.encoding == "keyframe" for r in ok),
            "sync_shared_memory": sum(r.plane == "shared-memory" for r in ok),
            "sync_tcp": sum(r.plane == "tcp" for r in ok),
            "sync_device": sum(r.plane == "device" for r in ok),
            "sync_refit_s": max((r.apply_s for r in ok), default=0.0),
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
