"""Weight updates as gRPC message streams: for each part of an update, one ``WeightHeader``, then data
chunks of at most 512 KiB (MESSAGE_BYTES), cut from the part's segments as they are sent.

Proto conversion and stream checks only; the bytes themselves come from :mod:`fp8rl.codec.encode` and go
to :mod:`fp8rl.codec.decode`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fp8rl.codec.decode import Admit, DecodedUpdate, UpdateDecoder
from fp8rl.codec.encode import EncodedUpdate
from fp8rl.codec.layout import MAX_PARTS
from fp8rl.codec.segments import SegmentInbox
from fp8rl.codec.tcp_plane import TcpInbox
from fp8rl.codec.weight_set import WeightSet, bytes_digest
from fp8rl.errors import CorruptUpdateError
from fp8rl.security import PartHash, sign_update, verify_update
from fp8rl.v1 import weights_pb2

# Data bytes per WeightChunk message. A replica drops an update stream that sends nothing for stream_idle_s
# (30 s), and a message crosses a slow link whole before the next is seen: 512 KiB take 16 s at 256 kbit/s
# (4 MiB took 33 s at 1 Mbit/s). Not slower on a fast link: measured over TLS on loopback, 512 MiB went at
# 495-563 MiB/s as 4 MiB messages, 634-812 MiB/s as 512 KiB ones (620-813 MiB/s as 1 MiB ones).
MESSAGE_BYTES = 512 * 1024


def header_of(
    update: EncodedUpdate, epoch: int = 0, signer: Ed25519PrivateKey | None = None
) -> weights_pb2.WeightHeader:
    """The header of one part; with the trainer's ``signer`` key, signed (one pass over the part: sign
    once, send to every target)."""
    header = weights_pb2.WeightHeader(
        version=update.version,
        base_version=update.base_version,
        encoding=update.encoding,
        total_bytes=update.wire_bytes,
        digest=update.digest,
        format=update.format,
        recipe=update.recipe,
        epoch=epoch,
        part=update.part,
        parts=update.parts,
    )
    if signer is not None:
        header.signature = sign_update(signer, header, update.segments)  # the pieces' bytes, uncopied
    return header


def update_to_chunks(
    update: EncodedUpdate, chunk_bytes: int = MESSAGE_BYTES, header: weights_pb2.WeightHeader | None = None
) -> Iterator[weights_pb2.WeightChunk]:
    """One part's messages (a whole stream when the update is one part)."""
    yield weights_pb2.WeightChunk(header=header if header is not None else header_of(update))
    for piece in update.pieces(chunk_bytes):
        yield weights_pb2.WeightChunk(data=piece)


def parts_to_chunks(
    parts: Iterable[EncodedUpdate],
    epoch: int = 0,
    signer: Ed25519PrivateKey | None = None,
    chunk_bytes: int = MESSAGE_BYTES,
) -> Iterator[weights_pb2.WeightChunk]:
    """An update's messages, each part signed (with ``signer``) and sent as it comes."""
    for part in parts:
        yield from update_to_chunks(part, chunk_bytes, header_of(part, epoch, signer))


_SAME_IN_EVERY_PART = ("version", "base_version", "encoding", "format", "recipe", "epoch", "parts")


def receive_parts(
    chunks: Iterable[weights_pb2.WeightChunk],
    max_bytes: int | None = None,
    verifier: Ed25519PublicKey | None = None,
    inbox: SegmentInbox | None = None,
    tcp: TcpInbox | None = None,
    alive: Callable[[], bool] | None = None,
) -> Iterator[tuple[weights_pb2.WeightHeader, bytearray]]:
    """Reassemble a chunk stream part by part, yielding each part's header and blob (writable: it is
    decoded in place) as soon as the part is whole. Raises :class:`CorruptUpdateError` unless every part is
    one header followed by data whose total size and header digest match it, the headers number the
    parts 0, 1, ... up to their count and agree on everything else, and all parts together stay within
    ``max_bytes``; with the trainer's public key (``verifier``), :class:`~fp8rl.errors.Unauthenticated`
    unless every part's signature verifies (each before a byte of it is yielded). A part may come on a
    data plane instead of data chunks, as one shared segment read from ``inbox`` or one TCP ticket
    whose bytes ``tcp`` receives (either missing: refused; ``alive``: whether the call still stands, as
    the TCP plane waits for them), and is checked the same way over the bytes read."""
    stream = iter(chunks)
    chunk = next(stream, None)
    if chunk is None or chunk.WhichOneof("part") != "header":
        raise CorruptUpdateError("a weight stream must start with its header")
    first = chunk.header
    if not 0 < first.parts <= MAX_PARTS:
        raise CorruptUpdateError(f"header.parts: {first.parts} outside [1, {MAX_PARTS}]")
    budget = max_bytes
    for index in range(first.parts):
        if chunk is None:
            raise CorruptUpdateError(f"truncated update: {index} of {first.parts} parts arrived")
        if chunk.WhichOneof("part") != "header":
            raise CorruptUpdateError(f"part {index} must start with its header")
        header = chunk.header
        if header.part != index:
            raise CorruptUpdateError(f"header.part: {header.part} arrived where part {index} was due")
        differs = [f for f in _SAME_IN_EVERY_PART if getattr(header, f) != getattr(first, f)]
        if differs:
            raise CorruptUpdateError(f"header.{differs[0]}: part {index} belongs to another update")
        check = (verifier, PartHash(header)) if verifier is not None else None
        if check is not None and not header.signature:
            verify_update(*check, "")  # refused before a byte of data is read
        assembler = Reassembler(header.total_bytes, header.digest, budget)  # (bounds total_bytes)
        chunk = next(stream, None)
        plane = chunk.WhichOneof("part") if chunk is not None else None
        if chunk is not None and plane in ("shared", "tcp"):
            if plane == "shared":
                if inbox is None:
                    raise CorruptUpdateError("shared: this replica takes no shared-memory segments")
                blob = inbox.take(chunk.shared.token, header.total_bytes)
            else:
                if tcp is None:
                    raise CorruptUpdateError("tcp: this replica takes no updates over TCP")
                blob = tcp.take(chunk.tcp.ticket, header.total_bytes, alive)
            if check is not None:
                check[1].update(memoryview(blob))
            check_part(blob, header.digest)
            chunk = next(stream, None)
        else:
            while chunk is not None and chunk.WhichOneof("part") == "data":
                assembler.add(chunk.data)
                if check is not None:
                    check[1].update(chunk.data)
                chunk = next(stream, None)
            blob = assembler.finish()
        if check is not None:
            verify_update(*check, header.signature)
        if budget is not None:
            budget -= len(blob)
        yield header, blob
    if chunk is not None:
        raise CorruptUpdateError(f"a weight stream of {first.parts} parts goes on after its last part")


def decode_parts(
    parts: Iterable[tuple[weights_pb2.WeightHeader, bytearray]],
    held: WeightSet | None = None,
    held_version: int | None = None,
    admit: Admit | None = None,
    accept: Callable[[DecodedUpdate], None] | None = None,
) -> tuple[DecodedUpdate, int]:
    """Apply received parts as they come (:class:`~fp8rl.codec.decode.UpdateDecoder`: all or nothing, even
    when the stream breaks after some parts were applied); returns the update and the bytes received."""
    received = 0
    with UpdateDecoder(held, held_version, admit) as decoder:
        for _, blob in parts:
            decoder.add(blob)
            received += len(blob)
        return decoder.finish(accept), received


class Reassembler:
    """Collects data chunks and releases the update only if its total size matches the header and its
    own header (which seals every tensor's digest, checked when it is decoded) matches the digest. The
    buffer grows with the data that arrives: an announced size allocates nothing."""

    def __init__(self, total_bytes: int, digest: str, max_bytes: int | None = None) -> None:
        if total_bytes < 0 or (max_bytes is not None and total_bytes > max_bytes):
            raise CorruptUpdateError(f"total_bytes {total_bytes} outside [0, {max_bytes}]")
        self.total_bytes = total_bytes
        self.digest = digest
        self._buffer = bytearray()
        self._filled = 0

    def add(self, data: bytes) -> None:
        end = self._filled + len(data)
        if end > self.total_bytes:
            raise CorruptUpdateError(f"received more than the announced {self.total_bytes} bytes")
        self._buffer += data
        self._filled = end

    def finish(self) -> bytearray:
        """The received update, writable, so that it is decoded in place."""
        if self._filled != self.total_bytes:
            raise CorruptUpdateError(f"truncated update: {self._filled} of {self.total_bytes} bytes")
        check_part(self._buffer, self.digest)
        return self._buffer


def check_part(blob: bytearray, digest: str) -> None:
    """The part's own header (which seals every tensor's digest, checked when it is decoded) matches
    ``digest``."""
    header_end = 8 + int.from_bytes(blob[:8], "little") if len(blob) >= 8 else 0
    if not 8 < header_end <= len(blob) or bytes_digest(memoryview(blob)[:header_end]) != digest:
        raise CorruptUpdateError("update digest mismatch (corrupted or reordered chunks)")
