"""The gRPC transport every client and server shares: channels that carry this process's identity
(TLS, its certificate, its bearer token: fp8rl/security.py says who may call what) and the keepalive
that turns a silent connection into a fast UNAVAILABLE."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import grpc

from fp8rl.security import SERVER_NAMES, TOKEN_METADATA, SecurityConfig, is_loopback


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self.header = (TOKEN_METADATA, f"Bearer {token}")

    def _with_token(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self.header]
        return (
            details._replace(metadata=metadata)
            if hasattr(details, "_replace")
            else _Details(details, metadata)
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)


class _Details(grpc.ClientCallDetails):
    def __init__(self, details: Any, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.wait_for_ready, self.compression = details.wait_for_ready, details.compression
        self.metadata = metadata


KEEPALIVE_S = 10
"""A connection that has read nothing this long is pinged; one whose ping is not answered within
PING_TIMEOUT_S is dropped. Without it, a call on a connection the network stopped carrying (a partition, a
peer's host gone) waits for its whole deadline (minutes: a Generate, an update) and the next calls queue
behind it; with it, they fail UNAVAILABLE within KEEPALIVE_S + PING_TIMEOUT_S and are retried on a new
connection or move elsewhere."""
PING_TIMEOUT_S = 10

BULK_PING_TIMEOUT_S = 60
"""The ping timeout of connections that send weight updates, and of servers, which receive them. A ping
goes out behind the data its sender has already written, so on a slow or shared link it waits for that
data to drain. Measured (two network namespaces, a tbf-capped veth with a 1 s queue): two updates sent at
once over 1 Mbit/s, one connection's ping unanswered after 10 s while the other's data held the link; one
update alone over 200 kbit/s, every ping unanswered after 10 s. With 60 s both arrive whole
(tests/integration/test_slow_link.py). A sending connection silent that long is still dropped, within
KEEPALIVE_S + BULK_PING_TIMEOUT_S."""

USER_TIMEOUT_S = 60
"""How long sent data may stay unacknowledged before the kernel drops the connection (this gRPC sets
TCP_USER_TIMEOUT to its keepalive timeout; the ping's own wait is PING_TIMEOUT_S). At 10 s, congestion
alone (a queue that drops, retransmissions backing off) closed connections that were still moving data."""


def keepalive(ping_timeout_s: float) -> list[tuple[str, Any]]:
    """A client's keepalive options, with pings answered within ``ping_timeout_s``."""
    return [
        ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
        ("grpc.keepalive_timeout_ms", USER_TIMEOUT_S * 1000),  # (TCP_USER_TIMEOUT only, in this gRPC)
        ("grpc.http2.ping_timeout_ms", int(ping_timeout_s * 1000)),  # (what a keepalive ping waits)
        ("grpc.keepalive_permit_without_calls", 1),
        # A long call (a Generate) sends nothing for a while: ping through it, as often as the keepalive says.
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_sent_ping_interval_without_data_ms", KEEPALIVE_S * 1000),
        ("grpc.http2.min_time_between_pings_ms", KEEPALIVE_S * 1000),
    ]


# (gRPC also arms a keepalive watchdog at keepalive_timeout_ms: it must not be shorter than a ping's wait)
assert USER_TIMEOUT_S >= BULK_PING_TIMEOUT_S >= PING_TIMEOUT_S
CLIENT_KEEPALIVE = keepalive(PING_TIMEOUT_S)
BULK_CLIENT_KEEPALIVE = keepalive(BULK_PING_TIMEOUT_S)
SERVER_KEEPALIVE = [
    # Accept the clients' pings (by default a server answers pings this frequent with GOAWAY), and ping
    # them in turn: a connection whose client vanished is closed, not kept open. A server receives the
    # updates, so its pings are answered from behind their data: the bulk timeout.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_S * 1000 // 2),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
    ("grpc.keepalive_timeout_ms", USER_TIMEOUT_S * 1000),
    ("grpc.http2.ping_timeout_ms", BULK_PING_TIMEOUT_S * 1000),
]


def channel(
    address: str,
    security: SecurityConfig | None,
    server: Literal["trainer", "rollout"],
    options: Sequence[tuple[str, Any]] = (),
    bulk: bool = False,
) -> grpc.Channel:
    """A channel to a ``server`` ("trainer" or "rollout") at ``address``, with this process's identity:
    TLS when a CA is configured (the server's certificate must name its role), its own certificate under
    mutual TLS, its bearer token on every call. A token never crosses a network in plaintext. ``bulk``: a
    channel that sends weight updates, whose pings wait behind them (BULK_PING_TIMEOUT_S)."""
    security = security or SecurityConfig()
    opts = [*(BULK_CLIENT_KEEPALIVE if bulk else CLIENT_KEEPALIVE), *options]
    if security.tls_ca is not None:
        cert = security.tls_cert.read_bytes() if security.tls_cert else None
        key = security.tls_key.read_bytes() if security.tls_key else None
        credentials = grpc.ssl_channel_credentials(security.tls_ca.read_bytes(), key, cert)
        opts.append(("grpc.ssl_target_name_override", SERVER_NAMES[server]))
        chan = grpc.secure_channel(address, credentials, options=opts)
    else:
        host = address.rsplit(":", 1)[0]
        if security.token_file and not is_loopback(host) and not security.allow_plaintext:
            raise ValueError(
                f"{address}: a bearer token would cross the network in plaintext; set security.tls_ca "
                "(TLS), or security.allow_plaintext=true on a trusted network"
            )
        chan = grpc.insecure_channel(address, options=opts)
    if security.token_file is not None:
        chan = grpc.intercept_channel(chan, _BearerToken(security.token_file.read_text().strip()))
    return chan
