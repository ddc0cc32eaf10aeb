"""The data plane across hosts and network namespaces: an update's parts over parallel TCP connections
beside its gRPC stream, which carries everything else (the headers, their signatures, the reply).

A replica listens on a TCP port of its own (its ``GetStatus`` gives it: ``tcp_updates_port``). For each
part the trainer draws a random ticket and names it in the gRPC stream in place of the part's data
chunks, then sends the bytes as frames, ``(ticket, offset, length)`` and that many bytes, each connection
a contiguous range of the part, each answered by the replica once it arrived whole. The replica takes a
frame only under a ticket its own gRPC stream has named: a ticket crosses only the authenticated call
(mutual TLS or the run's tokens), so bytes from anyone else are never read, and nothing is allocated
before the stream names the part (its size is the header's, bounded like any update). Where the replica
has a certificate the connections are TLS under the same certificate and CA as its gRPC server (mutual
where it asks callers for one), unless it sends them in clear. The bytes read are then checked like any
part, signature and digests, before anything is decoded: a tampered part is refused. A connection of the
trainer's that breaks or ends fails the parts still arriving at once (the trainer then sends the update
again over gRPC); any other connection gets ``idle_s`` for its handshake and first frame header.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import secrets
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fp8rl.errors import CorruptUpdateError
from fp8rl.security import SERVER_NAMES, SecurityConfig

log = logging.getLogger(__name__)

TICKET_BYTES = 16
FRAME = struct.Struct("<16sQQ")  # ticket, offset in the part, length of the bytes that follow
_TAKEN = b"+"  # the replica's answer to each frame it received whole
READ_BYTES = 4 << 20  # received per call, so that progress shows while a large frame arrives
MIN_RANGE_BYTES = 1 << 20  # a part smaller than streams x this goes on fewer connections
# A connection that has presented a named ticket is the trainer's: it may wait this long between frames
# and for its next part to be named (the replica applies one part while it reads the next; a second
# update waits its turn), where any other connection gets idle_s for its TLS handshake and first frame.
TRUSTED_WAIT_S = 120.0


def new_ticket() -> bytes:
    return secrets.token_bytes(TICKET_BYTES)


def server_context(security: SecurityConfig) -> ssl.SSLContext | None:
    """TLS for a replica's TCP plane, as its gRPC server has it: its certificate, and callers' certificates
    required under its CA where it requires them there (None: no certificate, plain TCP)."""
    if security.tls_cert is None or security.tls_key is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(security.tls_cert, security.tls_key)
    if security.client_certs and security.tls_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(security.tls_ca)
    return context


def client_context(security: SecurityConfig) -> ssl.SSLContext | None:
    """TLS for the trainer's side where its gRPC channels have it (a CA): the replica's certificate must
    name its role, and the trainer's own certificate goes with it (None: plain TCP)."""
    if security.tls_ca is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(security.tls_ca)
    if security.tls_cert is not None and security.tls_key is not None:
        context.load_cert_chain(security.tls_cert, security.tls_key)
    return context


# -- the replica's side -----------------------------------------------------------------------------------


@dataclass
class _Incoming:
    """One named part being received: its buffer, the bytes claimed by frames and those arrived."""

    buffer: bytearray
    claimed: int = 0
    arrived: int = 0
    failure: str = ""
    last_progress: float = field(default_factory=time.monotonic)


class TcpInbox:
    """A replica's TCP plane: a listener on ``host:port`` (0: any free port), each connection served on a
    thread of its own (at most ``max_connections`` at once), frames taken only under tickets that
    :meth:`take` has named."""

    def __init__(
        self,
        host: str,
        port: int = 0,
        tls: ssl.SSLContext | None = None,
        idle_s: float = 30.0,
        max_connections: int = 64,
    ) -> None:
        self.tls, self.idle_s = tls, idle_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=64)
        self._listener.settimeout(1.0)
        self.port: int = self._listener.getsockname()[1]
        self._named: dict[bytes, _Incoming] = {}
        self._lock = threading.Condition()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._connections: set[socket.socket] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="tcp-inbox", daemon=True)
        self._thread.start()

    def take(self, ticket: bytes, size: int, alive: Callable[[], bool] | None = None) -> bytearray:
        """The ``size`` bytes sent under ``ticket`` (writable: decoded in place), once every one has
        arrived; raises :class:`CorruptUpdateError` naming ``tcp`` where a connection of the trainer's
        broke or ended first, a frame fell outside the part, nothing arrived for ``idle_s``, or
        ``alive()`` turned false (the update's call ended)."""
        if len(ticket) != TICKET_BYTES:
            raise CorruptUpdateError(f"tcp.ticket: {len(ticket)} bytes, not {TICKET_BYTES}")
        if size <= 0:
            raise CorruptUpdateError(f"tcp.ticket: a part of {size} bytes")
        incoming = _Incoming(bytearray(size))
        with self._lock:
            if self._closed or ticket in self._named:
                raise CorruptUpdateError("tcp.ticket: already named, or the inbox is closed")
            self._named[ticket] = incoming
            self._lock.notify_all()
            try:
                while incoming.arrived < size and not incoming.failure:
                    if self._closed:
                        incoming.failure = "the replica is stopping"
                    elif time.monotonic() - incoming.last_progress > self.idle_s:
                        incoming.failure = f"nothing arrived for {self.idle_s:.0f} s"
                    elif alive is not None and not alive():
                        incoming.failure = "the update's call ended"
                    else:
                        self._lock.wait(1.0)
            finally:
                del self._named[ticket]
        if incoming.failure:
            raise CorruptUpdateError(f"tcp.ticket: {incoming.failure} ({incoming.arrived} of {size} bytes)")
        return incoming.buffer

    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            for conn in self._connections:
                _shut(conn)
        _shut(self._listener)  # (wakes the accepting thread at once)
        self._listener.close()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                conn.close()  # (as many connections as it serves are open already)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="tcp-inbox-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        served: set[bytes] = set()  # the tickets this connection carried frames of (trusted once any)
        try:
            deadline = time.monotonic() + self.idle_s  # handshake and first frame, however slow the bytes
            conn.settimeout(self.idle_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)  # (a failed handshake ends it here)
            with self._lock:
                if self._closed:
                    return
                self._connections.add(conn)
            while True:
                head = _receive_exactly(conn, FRAME.size, None if served else deadline)
                if head is None or not self._frame(conn, head, served):
                    return
        except (OSError, ValueError) as exc:
            log.debug("tcp inbox: a connection ended (%s)", exc)
        finally:
            with self._lock:
                self._connections.discard(conn)
                # A connection of the trainer's ended: the parts it was carrying never arrive whole. (Only
                # those: a part another update named meanwhile comes on connections of its own; parts of
                # this update it had not begun fail as its call ends, which the trainer ends at once.)
                for ticket in served:
                    incoming = self._named.get(ticket)
                    if (
                        incoming is not None
                        and incoming.arrived < len(incoming.buffer)
                        and not incoming.failure
                    ):
                        incoming.failure = "a connection of the trainer's ended"
                self._lock.notify_all()
            conn.close()
            self._slots.release()

    def _frame(self, conn: socket.socket, head: bytes, served: set[bytes]) -> bool:
        """Receive the rest of the frame ``head`` starts (its ticket joins ``served``); False where the
        connection must be closed."""
        ticket, offset, length = FRAME.unpack(head)
        incoming = self._named_part(ticket, TRUSTED_WAIT_S if served else self.idle_s)
        if incoming is None:
            return False  # never named (not the trainer's), or long gone: nothing of it is read
        conn.settimeout(TRUSTED_WAIT_S)  # the trainer's: no longer held to the first header's deadline
        with self._lock:
            served.add(ticket)
            if offset + length > len(incoming.buffer) or incoming.claimed + length > len(incoming.buffer):
                incoming.failure = f"a frame at {offset}+{length} falls outside the part"
                self._lock.notify_all()
                return False
            incoming.claimed += length
        view = memoryview(incoming.buffer)[offset : offset + length]
        while view:
            try:
                n = conn.recv_into(view, min(len(view), READ_BYTES))
            except OSError as exc:
                n, reason = 0, str(exc)
            else:
                reason = "the connection closed"
            with self._lock:
                if n <= 0:
                    incoming.failure = incoming.failure or f"{reason} mid-part"
                    self._lock.notify_all()
                    return False
                incoming.arrived += n
                incoming.last_progress = time.monotonic()
                if incoming.arrived == len(incoming.buffer):
                    self._lock.notify_all()
            view = view[n:]
        conn.sendall(_TAKEN)  # (the trainer learns that the range arrived, not only that it was sent)
        return True

    def _named_part(self, ticket: bytes, wait_s: float) -> _Incoming | None:
        """The part named under ``ticket``, waiting up to ``wait_s`` for the gRPC stream to name it (the
        trainer sends a part's frames as soon as it names the part)."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while ticket not in self._named:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self._lock.wait(min(left, 1.0))
            return self._named[ticket]


def _receive_exactly(conn: socket.socket, size: int, deadline: float | None = None) -> bytes | None:
    """``size`` bytes, or None where the connection ends before the first; raises where it ends within,
    or where ``deadline`` (monotonic) passes first: a peer cannot hold a connection by trickling bytes."""
    data = bytearray()
    while len(data) < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no whole frame header in time")
            conn.settimeout(left)
        chunk = conn.recv(size - len(data))
        if not chunk:
            if data:
                raise ConnectionError(f"a frame header ended after {len(data)} bytes")
            return None
        data += chunk
    return bytes(data)


def _shut(conn: socket.socket) -> None:
    """Shut the connection's socket (under TLS the socket itself: SSLSocket.shutdown drops its TLS state
    first, and a thread still sending would then write in clear)."""
    with contextlib.suppress(OSError):  # (not connected any more)
        socket.socket.shutdown(conn, socket.SHUT_RDWR)


# -- the trainer's side -----------------------------------------------------------------------------------


class TcpSender:
    """The trainer's connections to one replica's TCP plane, for one update: each part is cut into
    contiguous ranges, one per connection, sent by that connection's thread while the gRPC stream goes
    on. The first error closes every connection (so the replica fails the part at once) and is kept in
    :attr:`error`; later parts are then not sent (the caller sends them over gRPC)."""

    def __init__(
        self,
        host: str,
        port: int,
        streams: int = 4,
        tls: ssl.SSLContext | None = None,
        timeout_s: float = TRUSTED_WAIT_S,
    ) -> None:
        """``timeout_s``: the longest stall of a send (the replica reads a part once its stream names
        it, and names the next once it has the one before)."""
        self.error: BaseException | None = None
        self._connections: list[socket.socket] = []
        try:
            for _ in range(max(1, streams)):
                conn = socket.create_connection((host, port), timeout=min(timeout_s, 10.0))
                conn.settimeout(timeout_s)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if tls is not None:
                    conn = tls.wrap_socket(conn, server_hostname=SERVER_NAMES["rollout"])
                self._connections.append(conn)
        except BaseException:
            self._shut_all()
            self._close_all()
            raise
        self._pending = 0  # ranges queued and not yet sent (or dropped)
        self._flushed = threading.Condition()
        self._jobs: list[queue.SimpleQueue[tuple[bytes, int, int, Sequence[memoryview]] | None]] = [
            queue.SimpleQueue() for _ in self._connections
        ]
        self._threads = [
            threading.Thread(target=self._send, args=(i,), name=f"tcp-send-{i}", daemon=True)
            for i in range(len(self._connections))
        ]
        for thread in self._threads:
            thread.start()

    @property
    def failed(self) -> bool:
        return self.error is not None

    def send(self, ticket: bytes, segments: Sequence[memoryview]) -> None:
        """Queue a part (its segments back to back) under ``ticket``; returns at once."""
        size = sum(len(s) for s in segments)
        ranges = max(1, min(len(self._connections), size // MIN_RANGE_BYTES))
        step = -(-size // ranges)
        with self._flushed:
            self._pending += ranges
        for i in range(ranges):
            start = i * step
            self._jobs[i].put((ticket, start, min(step, size - start), segments))

    def flush(self) -> None:
        """Wait until every queued range is sent (or dropped after an error: see :attr:`error`)."""
        with self._flushed:
            while self._pending:
                self._flushed.wait()

    def close(self) -> None:
        """Send what is queued, then close (the first error is in :attr:`error`)."""
        for jobs in self._jobs:
            jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._close_all()

    def abort(self) -> None:
        """Close every connection now, whatever is queued."""
        if self.error is None:
            self.error = ConnectionAbortedError("aborted")
        self._shut_all()
        self.close()

    def _send(self, index: int) -> None:
        conn = self._connections[index]
        while (job := self._jobs[index].get()) is not None:
            try:
                if self.error is None:  # (else dropped: the replica fails the part, the caller falls back)
                    self._send_range(conn, *job)
            except BaseException as exc:
                if self.error is None:
                    self.error = exc
                    log.warning("tcp plane: a connection failed (%s)", exc)
                self._shut_all()  # (the others' sends end too; closed once every thread is done)
            finally:
                with self._flushed:
                    self._pending -= 1
                    self._flushed.notify_all()

    @staticmethod
    def _send_range(
        conn: socket.socket, ticket: bytes, offset: int, length: int, segments: Sequence[memoryview]
    ) -> None:
        conn.sendall(FRAME.pack(ticket, offset, length))
        for piece in _slices(segments, offset, length):
            for start in range(0, len(piece), READ_BYTES):  # (a timeout then measures a stall)
                conn.sendall(piece[start : start + READ_BYTES])
        if conn.recv(1) != _TAKEN:
            raise ConnectionError("the replica did not take a range (not its part, or it closed)")

    def _shut_all(self) -> None:
        for conn in self._connections:
            _shut(conn)

    def _close_all(self) -> None:
        for conn in self._connections:
            conn.close()


def _slices(segments: Sequence[memoryview], offset: int, length: int) -> list[memoryview]:
    """The views of ``segments`` (back to back) covering ``offset`` to ``offset + length``."""
    out, start = [], 0
    for segment in segments:
        end = start + len(segment)
        if end > offset and start < offset + length:
            out.append(segment[max(0, offset - start) : min(len(segment), offset + length - start)])
        start = end
    return out
