"""Replica discovery through Redis: each rollout replica keeps an expiring key alive; a coordinator
lists the live ones. Key: ``fp8rl:replicas:<host:port>`` -> JSON {address, model, recipe, started}."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from typing import Any

import redis

log = logging.getLogger(__name__)
KEY_PREFIX = "fp8rl:replicas:"


def replica_key(address: str) -> str:
    return KEY_PREFIX + address


def live_replicas(client: redis.Redis) -> dict[str, dict[str, Any]]:
    """Address -> registration of every replica whose heartbeat has not expired."""
    found = {}
    for key in client.scan_iter(match=KEY_PREFIX + "*"):
        raw = client.get(key)
        if raw is not None:
            info = json.loads(raw)
            found[info["address"]] = info
    return found


class Heartbeat:
    """Registers ``address`` and refreshes it every ``interval_s``; the key expires after three missed
    beats, so a dead replica disappears on its own. ``stop`` removes it at once. A Redis that does not
    answer (at the first beat too: a restart just as the replica finished loading) is tried again at the
    next beat, each failure logged."""

    def __init__(self, client: redis.Redis, address: str, info: dict[str, Any], interval_s: float) -> None:
        self.client, self.key, self.interval_s = client, replica_key(address), interval_s
        self.value = json.dumps({"address": address, "started": time.time(), **info})
        self._stop = threading.Event()
        self._beat_or_log()
        self._thread = threading.Thread(target=self._run, name="replica-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self.client.set(self.key, self.value, px=int(self.interval_s * 3000))

    def _beat_or_log(self) -> None:
        try:
            self._beat()
        except redis.RedisError as exc:  # Redis restarting: keep trying, the key comes back
            log.warning("heartbeat to redis failed: %s", exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat_or_log()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(redis.RedisError):  # Redis gone: the key expires on its own
            self.client.delete(self.key)
