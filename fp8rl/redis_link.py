"""Redis clients for long-lived processes. Every call and connection has a deadline: a Redis that went
away without a word (a killed container whose address is gone, a partition) fails the call instead of
blocking it for good, and the caller tries again on a fresh connection."""

from __future__ import annotations

import redis

REDIS_TIMEOUT_S = 5.0
"""A Redis call (or connection) that has not answered in this long failed; it is tried again."""
REDIS_RETRIES = 12
"""Tries after the first (waits of 0.25 s doubling up to 4 s, each try up to REDIS_TIMEOUT_S): a Redis
outage of a minute or so (a restart, a partition) is ridden out. A write sent again after a lost reply
applies once (the coordinator's scripts see it done); after an outage longer than its lease, the fence
refuses it."""


def connect(url: str, timeout_s: float | None = None, retries: int | None = None) -> redis.Redis:
    """A client of ``url`` (password included) whose calls fail after ``timeout_s`` and are tried
    ``retries`` more times (defaults: REDIS_TIMEOUT_S and REDIS_RETRIES, read at the call)."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    timeout_s = REDIS_TIMEOUT_S if timeout_s is None else timeout_s
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        socket_keepalive=True,
        retry=Retry(ExponentialBackoff(cap=4.0, base=0.25), REDIS_RETRIES if retries is None else retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )
