"""Weight updates as gRPC message streams: one ``WeightHeader``, then data chunks of at most 4 MiB, cut
from the update's segments as they are sent.

Proto conversion only; the bytes themselves come from and go to :mod:`fp8rl.weights`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from fp8rl.errors import CorruptUpdateError
from fp8rl.security import UpdateMac, sign_update, verify_update
from fp8rl.v1 import weights_pb2
from fp8rl.weights import EncodedUpdate, bytes_digest

# gRPC's default receive limit is 4 MiB per message; leave room for the message framing.
CHUNK_BYTES = 4 * 1024 * 1024 - 4096


def header_of(update: EncodedUpdate, epoch: int = 0, key: bytes | None = None) -> weights_pb2.WeightHeader:
    """The update's header; with the run's ``key``, signed (one pass over the blob: sign once, send to
    every target)."""
    header = weights_pb2.WeightHeader(
        version=update.version,
        base_version=update.base_version,
        encoding=update.encoding,
        total_bytes=update.wire_bytes,
        digest=update.digest,
        format=update.format,
        recipe=update.recipe,
        epoch=epoch,
    )
    if key is not None:
        header.mac = sign_update(key, header, update.segments)  # the same bytes as the pieces, uncopied
    return header


def update_to_chunks(
    update: EncodedUpdate, chunk_bytes: int = CHUNK_BYTES, header: weights_pb2.WeightHeader | None = None
) -> Iterator[weights_pb2.WeightChunk]:
    yield weights_pb2.WeightChunk(header=header if header is not None else header_of(update))
    for piece in update.pieces(chunk_bytes):
        yield weights_pb2.WeightChunk(data=piece)


def receive_update(
    chunks: Iterable[weights_pb2.WeightChunk], max_bytes: int | None = None, key: bytes | None = None
) -> tuple[weights_pb2.WeightHeader, bytearray]:
    """Reassemble a chunk stream; raises :class:`CorruptUpdateError` unless it is one header followed
    by data whose total size and header digest match the header, and with the run's ``key``
    :class:`~fp8rl.errors.Unauthenticated` unless its MAC verifies."""
    stream = iter(chunks)
    first = next(stream, None)
    if first is None or first.WhichOneof("part") != "header":
        raise CorruptUpdateError("a weight stream must start with its header")
    header = first.header
    mac = UpdateMac(key, header) if key is not None else None
    if mac is not None and not header.mac:
        verify_update(mac, "")  # refused before a byte of data is read
    assembler = Reassembler(header.total_bytes, header.digest, max_bytes)
    for chunk in stream:
        if chunk.WhichOneof("part") != "data":
            raise CorruptUpdateError("a weight stream has exactly one header, at the start")
        assembler.add(chunk.data)
        if mac is not None:
            mac.update(chunk.data)
    blob = assembler.finish()
    if mac is not None:
        verify_update(mac, header.mac)
    return header, blob


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
        header_end = 8 + int.from_bytes(self._buffer[:8], "little") if self._filled >= 8 else 0
        if (
            not 8 < header_end <= self._filled
            or bytes_digest(memoryview(self._buffer)[:header_end]) != self.digest
        ):
            raise CorruptUpdateError("update digest mismatch (corrupted or reordered chunks)")
        return self._buffer
