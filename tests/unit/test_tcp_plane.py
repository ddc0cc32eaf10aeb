"""The TCP data plane (fp8rl/codec/tcp_plane.py) over real sockets: a signed update's parts sent on
parallel connections decode to the set, in plaintext and under mutual TLS; a tampered part is refused by
its signature; bytes under a ticket the stream never named are not read; a sender killed with -9
mid-part fails that part at once; a frame outside its part, and a caller without the run's certificate,
are refused."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fp8rl.codec import tcp_plane
from fp8rl.codec.encode import EncodedUpdate
from fp8rl.codec.stream import decode_parts, receive_parts
from fp8rl.codec.tcp_plane import FRAME, TcpInbox, TcpSender, client_context, new_ticket, server_context
from fp8rl.errors import CorruptUpdateError, Unauthenticated
from fp8rl.run_secrets import security_for
from fp8rl.v1 import weights_pb2
from tests.unit.test_segments import _data_chunks, signed_parts


@pytest.fixture(autouse=True)
def small_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of these tests' size cut into ranges on every connection (as an 8B set's parts are)."""
    monkeypatch.setattr(tcp_plane, "MIN_RANGE_BYTES", 4096)


@pytest.fixture
def inbox() -> Iterator[TcpInbox]:
    box = TcpInbox("127.0.0.1", 0, idle_s=5.0)
    yield box
    box.close()


def tcp_stream(
    sender: TcpSender, parts: list[tuple[EncodedUpdate, weights_pb2.WeightHeader]], alter: int = -1
) -> Iterator[weights_pb2.WeightChunk]:
    """The parts as headers and tickets, each part's bytes sent as the trainer sends them; ``alter``: that
    part goes with one byte changed (as a man in the middle would)."""
    for part, header in parts:
        ticket = new_ticket()
        segments = list(part.segments)
        if header.part == alter:
            changed = bytearray(segments[-1])
            changed[len(changed) // 2] ^= 1
            segments[-1] = memoryview(changed)
        sender.send(ticket, segments)
        yield weights_pb2.WeightChunk(header=header)
        yield weights_pb2.WeightChunk(tcp=weights_pb2.TcpPart(ticket=ticket))


def received_over(inbox: TcpInbox, sender: TcpSender, gen: torch.Generator, alter: int = -1) -> None:
    key = Ed25519PrivateKey.generate()
    parts = signed_parts(gen, key)
    over_grpc, _ = decode_parts(receive_parts(p for part, h in parts for p in _data_chunks(part, h)))
    try:
        stream = receive_parts(tcp_stream(sender, parts, alter), verifier=key.public_key(), tcp=inbox)
        decoded, received = decode_parts(stream)
    except BaseException:
        sender.abort()  # (as the publisher does when the call fails: the rest is never named)
        raise
    sender.close()
    assert sender.error is None
    assert received == sum(p.wire_bytes for p, _ in parts)
    for name, tensor in decoded.weights.tensors.items():
        assert torch.equal(tensor.view(torch.uint8), over_grpc.weights.tensors[name].view(torch.uint8)), name


def test_signed_parts_over_parallel_connections_decode_to_the_set(
    inbox: TcpInbox, gen: torch.Generator
) -> None:
    sender = TcpSender("127.0.0.1", inbox.port, streams=3)
    received_over(inbox, sender, gen)


def test_mutual_tls_carries_parts_and_refuses_a_caller_without_the_runs_certificate(
    tmp_path: Path, gen: torch.Generator
) -> None:
    replica = security_for(tmp_path / "secrets", "replica", tls=True)
    trainer = security_for(tmp_path / "secrets", "trainer", tls=True)
    server = server_context(replica)
    assert server is not None and server.verify_mode == ssl.CERT_REQUIRED
    inbox = TcpInbox("127.0.0.1", 0, server, idle_s=5.0)
    try:
        received_over(inbox, TcpSender("127.0.0.1", inbox.port, 2, client_context(trainer)), gen)
        # The run's CA, but no certificate of its own: the replica ends the handshake.
        anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        anonymous.load_verify_locations(trainer.tls_ca)
        assert refused(inbox.port, anonymous)
    finally:
        inbox.close()


def refused(port: int, context: ssl.SSLContext) -> bool:
    """The inbox at ``port`` refuses the TLS handshake of a connection made with ``context``, at once:
    under TLS 1.3 the client learns of it at its first read, as the server's alert naming the
    certificate, or (where the server's close overtakes its alert) as a reset or an end of stream. A
    connection the inbox accepted would be held for its idle_s (5 s) instead."""
    started = time.monotonic()
    try:
        with context.wrap_socket(
            socket.create_connection(("127.0.0.1", port), timeout=10), server_hostname="replica"
        ) as conn:
            conn.sendall(FRAME.pack(new_ticket(), 0, 8) + b"12345678")
            ended = conn.recv(1) == b""
    except (ssl.SSLEOFError, ConnectionResetError, BrokenPipeError):
        ended = True
    except ssl.SSLError as exc:
        ended = "certificate" in str(exc)
    return ended and time.monotonic() - started < 3


def test_a_tampered_part_is_refused(inbox: TcpInbox, gen: torch.Generator) -> None:
    with pytest.raises(Unauthenticated):
        received_over(inbox, TcpSender("127.0.0.1", inbox.port, streams=2), gen, alter=1)


def test_bytes_under_a_ticket_never_named_are_not_read() -> None:
    """A caller that does not hold a ticket the stream named (anyone but the trainer) gets its connection
    closed after idle_s: the inbox reads the frame's header, and nothing after it."""
    inbox = TcpInbox("127.0.0.1", 0, idle_s=1.0)
    try:
        with socket.create_connection(("127.0.0.1", inbox.port), timeout=10) as intruder:
            intruder.sendall(FRAME.pack(new_ticket(), 0, 1 << 30) + bytes(1 << 16))
            started = time.monotonic()
            intruder.settimeout(5)
            # Closed by the inbox with the bytes after the header still unread (the kernel then resets).
            with pytest.raises(ConnectionResetError):
                intruder.recv(1)
            assert time.monotonic() - started < 4
    finally:
        inbox.close()


def test_a_frame_outside_its_part_fails_the_part(inbox: TcpInbox) -> None:
    ticket = new_ticket()
    with socket.create_connection(("127.0.0.1", inbox.port), timeout=10) as liar:
        liar.sendall(FRAME.pack(ticket, 60, 8) + b"12345678")
        started = time.monotonic()
        with pytest.raises(CorruptUpdateError, match=r"tcp\.ticket: a frame at 60\+8 falls outside the part"):
            inbox.take(ticket, 64)
        assert time.monotonic() - started < 3


def test_a_sender_killed_mid_part_fails_the_part_at_once_and_the_inbox_goes_on(inbox: TcpInbox) -> None:
    """kill -9 of the trainer with half a part sent: the replica's take fails when the connection drops,
    not after idle_s; the next update's part arrives whole on a fresh connection."""
    ticket = new_ticket()
    code = (
        "import socket, sys, time\n"
        "from fp8rl.codec.tcp_plane import FRAME\n"
        f"c = socket.create_connection(('127.0.0.1', {inbox.port}))\n"
        f"c.sendall(FRAME.pack({ticket!r}, 0, 1 << 20) + bytes(1 << 19))\n"
        "print('half', flush=True)\n"
        "time.sleep(600)\n"
    )
    sender = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert sender.stdout is not None and sender.stdout.readline().strip() == "half"
        killed_at = time.monotonic() + 0.5

        def kill_soon() -> None:
            time.sleep(0.5)
            os.kill(sender.pid, signal.SIGKILL)

        threading.Thread(target=kill_soon, daemon=True).start()
        with pytest.raises(CorruptUpdateError, match=r"tcp\.ticket: the connection closed mid-part"):
            inbox.take(ticket, 1 << 20)
        assert time.monotonic() - killed_at < 3  # (idle_s is 5)
    finally:
        sender.kill()
        sender.wait()
    fresh = TcpSender("127.0.0.1", inbox.port, streams=2)
    data = os.urandom(3 << 20)
    again = new_ticket()
    fresh.send(again, [memoryview(data)])
    assert bytes(inbox.take(again, len(data))) == data
    fresh.close()
    assert fresh.error is None


def test_a_trainer_connection_that_ends_fails_only_the_parts_it_carried(inbox: TcpInbox) -> None:
    """A connection that carried part A ends while part B (named meanwhile, as the next update's first
    part is while the last one's connections close) waits for bytes on a connection of its own: B is not
    failed for it, and arrives whole."""
    a, b = new_ticket(), new_ticket()
    first = socket.create_connection(("127.0.0.1", inbox.port), timeout=10)
    first.sendall(FRAME.pack(a, 0, 8) + b"aaaaaaaa")
    assert bytes(inbox.take(a, 8)) == b"aaaaaaaa" and first.recv(1) == b"+"
    got: dict[str, bytes | Exception] = {}

    def take_b() -> None:
        try:
            got["b"] = bytes(inbox.take(b, 16))
        except Exception as exc:
            got["b"] = exc

    taker = threading.Thread(target=take_b)
    taker.start()
    deadline = time.monotonic() + 5
    while b not in inbox._named and time.monotonic() < deadline:  # (named: waiting for its bytes)
        time.sleep(0.01)
    assert b in inbox._named
    first.close()  # the connection that carried A ends
    time.sleep(0.5)
    with socket.create_connection(("127.0.0.1", inbox.port), timeout=10) as second:
        second.sendall(FRAME.pack(b, 0, 16) + b"b" * 16)
        taker.join(timeout=10)
        assert got["b"] == b"b" * 16
