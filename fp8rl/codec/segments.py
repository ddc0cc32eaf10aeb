"""The same-host data plane: an update's parts in sealed shared memory, handed to the replica as file
descriptors, while gRPC carries everything else (the headers, their signatures, the reply).

The trainer writes each part once into a memfd (anonymous shared memory: no file anywhere, freed by the
kernel when the last descriptor and mapping go, whoever is killed) and seals it against any change. Each
replica on the host keeps an inbox, a Unix socket in the abstract namespace (so within its network
namespace only, and nothing left on disk), that takes descriptors over SCM_RIGHTS from processes of its
own user (or root), each under a random token; the part's place in the gRPC stream then names the token,
and the replica maps the segment copy-on-write and checks the signature and digests over the mapped
bytes before anything is decoded. Nothing the inbox takes is trusted: unsigned or altered bytes are
refused as they would be over gRPC.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
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
    replica keeps a descriptor per mapped part of the keyframe it holds (Python's mmap holds one), a few
    hundred for an 8B set."""
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


def hand_over(inbox: str, fd: int, timeout: float = 10.0) -> bytes | None:
    """Give ``fd`` to the inbox named ``inbox``; its token, or None where the inbox is not reachable
    from here (another host or network namespace, gone) or refuses (full)."""
    token = secrets.token_bytes(TOKEN_BYTES)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(timeout)
            sock.connect("\0" + inbox)
            sock.sendmsg([token], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])
            answer = sock.recv(1)
    except OSError as exc:
        log.debug("shared-memory inbox %s not usable (%s): the update goes over gRPC", inbox, exc)
        return None
    return token if answer == _ACK else None


class SegmentInbox:
    """A replica's inbox: descriptors received under their tokens, each kept until taken or for
    ``ttl_s`` (the trainer's stream names it within moments), at most ``capacity`` at a time."""

    def __init__(self, capacity: int = 64, ttl_s: float = 60.0) -> None:
        self.name = f"fp8rl-segments-{secrets.token_hex(16)}"  # unguessable: no one else's inbox
        self.capacity, self.ttl_s = capacity, ttl_s
        self._held: dict[bytes, tuple[int, float]] = {}  # token -> (fd, deadline)
        self._lock = threading.Condition()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.bind("\0" + self.name)
        self._sock.listen(16)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="segment-inbox", daemon=True)
        self._thread.start()

    def take(self, token: bytes, size: int, wait_s: float = 2.0) -> mmap.mmap:
        """The segment under ``token``, mapped copy-on-write (writable: decoded in place; the pages stay
        shared until written), once its seals and its size (``size``, the header's) check out."""
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
            return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
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
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(5)
                    self._receive(conn)
                except OSError as exc:
                    log.warning("shared-memory inbox: a hand-over failed (%s)", exc)

    def _receive(self, conn: socket.socket) -> None:
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        fds_size = socket.CMSG_SPACE(struct.calcsize("i"))
        token, ancillary, _, _ = conn.recvmsg(TOKEN_BYTES, fds_size)
        fds = [
            fd
            for level, kind, data in ancillary
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
            for fd in struct.unpack(f"{len(data) // 4}i", data[: len(data) // 4 * 4])
        ]
        if uid not in (0, os.getuid()) or len(token) != TOKEN_BYTES or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            log.warning("shared-memory inbox: refused a hand-over from pid %d (uid %d)", pid, uid)
            conn.send(_FULL)
            return
        with self._lock:
            self._expire()
            if len(self._held) >= self.capacity:
                os.close(fds[0])
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
