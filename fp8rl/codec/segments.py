"""The same-host data plane: an update's parts in sealed shared memory, handed to the replica as file
descriptors, while gRPC carries everything else (the headers, their signatures, the reply).

The trainer writes each part once into a memfd (anonymous shared memory: no file anywhere, freed by the
kernel with its last descriptor, whoever is killed) and seals it against any change. Each replica on
the host keeps an inbox, a Unix socket in the abstract namespace (within its network namespace only,
and nothing left on disk), that takes descriptors over SCM_RIGHTS, each under a random token; the
part's place in the gRPC stream then names the token. Both ends check the other's user (SO_PEERCRED:
their own, or root), since an abstract name is visible to every user in the namespace. The replica
reads the sealed segment into its own memory (one copy at memory speed; a copy-on-write mapping would
keep the trainer's pages alive beside every page a delta rewrites) and checks the signature and digests
over those bytes before anything is decoded: unsigned or altered bytes are refused as over gRPC.
"""

from __future__ import annotations

import fcntl
import logging
import os
import resource
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterable

from fp8rl.errors import CorruptUpdateError

log = logging.getLogger(__name__)

TOKEN_BYTES = 16
# The seals a segment must carry: nobody, the trainer included, can change its bytes once they are read.
REQUIRED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_ACK, _FULL = b"+", b"-"


def raise_open_file_limit(target: int = 65536) -> None:
    """Raise this process's soft limit on open files towards ``target`` (within its hard limit): a
    trainer holds a segment per part of the update it publishes (a few hundred for an 8B set)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def sealed_segment(pieces: Iterable[bytes | bytearray | memoryview], size: int) -> int:
    """A memfd holding ``pieces`` back to back (``size`` bytes in all), sealed; the caller closes it."""
    fd = os.memfd_create("fp8rl-update-part", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        written = 0
        for piece in pieces:
            view = memoryview(piece).cast("B")
            while view:
                n = os.pwrite(fd, view, written)
                written += n
                view = view[n:]
        if written != size:
            raise ValueError(f"segment of {size} bytes got {written}")
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
        return fd
    except BaseException:
        os.close(fd)
        raise


def hand_over(inbox: str, fd: int, timeout: float = 5.0) -> bytes | None:
    """Give ``fd`` to the inbox named ``inbox``; its token, or None where the inbox is not reachable
    from here (another host or network namespace, gone), is another user's, or refuses (full)."""
    token = secrets.token_bytes(TOKEN_BYTES)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(timeout)
            sock.connect("\0" + inbox)
            if not _trusted(sock):  # (someone else bound a name that a replica left)
                log.warning("shared-memory inbox %s belongs to another user: not used", inbox)
                return None
            sock.sendmsg([token], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])
            answer = sock.recv(1)
    except OSError as exc:
        log.debug("shared-memory inbox %s not usable (%s): the update goes over gRPC", inbox, exc)
        return None
    return token if answer == _ACK else None


def _trusted(sock: socket.socket) -> bool:
    """The peer runs as this process's user, or as root."""
    _, uid, _ = struct.unpack("iII", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid in (0, os.getuid())


class SegmentInbox:
    """A replica's inbox: descriptors received under their tokens, each kept until taken or for
    ``ttl_s`` (the trainer's stream names it within moments), at most ``capacity`` at a time (their
    memory is the trainer's until taken)."""

    def __init__(self, capacity: int = 1024, ttl_s: float = 30.0) -> None:
        self.name = f"fp8rl-segments-{secrets.token_hex(16)}"
        self.capacity, self.ttl_s = capacity, ttl_s
        self._held: dict[bytes, tuple[int, float]] = {}  # token -> (fd, deadline)
        self._lock = threading.Condition()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.bind("\0" + self.name)
        self._sock.listen(64)
        self._sock.settimeout(1.0)  # (the serving loop lets stale descriptors go each second)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="segment-inbox", daemon=True)
        self._thread.start()

    def take(self, token: bytes, size: int, wait_s: float = 2.0) -> bytearray:
        """The bytes of the segment under ``token``, read into this process's memory (writable: decoded
        in place), once its seals and its size (``size``, the header's) check out."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while token not in self._held:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise CorruptUpdateError("shared.token: no segment was handed over under it")
                self._lock.wait(left)
            fd, _ = self._held.pop(token)
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if seals & REQUIRED_SEALS != REQUIRED_SEALS:
                raise CorruptUpdateError("shared.token: the segment is not sealed against writes")
            if size <= 0 or os.fstat(fd).st_size != size:
                raise CorruptUpdateError(f"shared.token: the segment is not the header's {size} bytes")
            blob = bytearray(size)
            view, done = memoryview(blob), 0
            while done < size:  # (one read moves at most ~2 GiB)
                n = os.preadv(fd, [view[done:]], done)
                if n <= 0:
                    raise CorruptUpdateError(f"shared.token: the segment ended at {done} of {size} bytes")
                done += n
            return blob
        except OSError as exc:  # (F_GET_SEALS on a descriptor that is no memfd)
            raise CorruptUpdateError(f"shared.token: not a shared-memory segment ({exc})") from exc
        finally:
            os.close(fd)

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for fd, _ in self._held.values():
                os.close(fd)
            self._held.clear()
            self._lock.notify_all()
        self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                with self._lock:
                    self._expire()
                continue
            except OSError:
                return  # closed
            with conn:
                try:
                    if not _trusted(conn):  # at once: another user cannot hold the inbox up
                        continue
                    conn.settimeout(1.0)
                    self._receive(conn)
                except Exception as exc:  # one hand-over's failure never ends the inbox
                    log.warning("shared-memory inbox: a hand-over failed (%s)", exc)

    def _receive(self, conn: socket.socket) -> None:
        flags_wanted = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
        token, ancillary, flags, _ = conn.recvmsg(
            TOKEN_BYTES + 1, socket.CMSG_SPACE(struct.calcsize("i")), flags_wanted
        )
        fds = [
            fd
            for level, kind, data in ancillary
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
            for fd in struct.unpack(f"{len(data) // 4}i", data[: len(data) // 4 * 4])
        ]
        with self._lock:
            self._expire()
            intact = (
                len(token) == TOKEN_BYTES
                and len(fds) == 1
                and not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC)
            )
            if not intact or self._closed or token in self._held or len(self._held) >= self.capacity:
                for fd in fds:
                    os.close(fd)
                conn.send(_FULL)
                return
            self._held[token] = (fds[0], time.monotonic() + self.ttl_s)
            self._lock.notify_all()
        conn.send(_ACK)

    def _expire(self) -> None:
        now = time.monotonic()
        for token, (fd, deadline) in list(self._held.items()):
            if deadline < now:
                os.close(fd)
                del self._held[token]
