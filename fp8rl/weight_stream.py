"""Weight updates as gRPC message streams: one ``WeightHeader``, then data chunks of at most 4 MiB.

Proto conversion only; the bytes themselves come from and go to :mod:`fp8rl.weights`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from fp8rl.errors import CorruptUpdateError
from fp8rl.v1 import weights_pb2
from fp8rl.weights import EncodedUpdate, bytes_digest

# gRPC's default receive limit is 4 MiB per message; leave room for the message framing.
CHUNK_BYTES = 4 * 1024 * 1024 - 4096


def header_of(update: EncodedUpdate) -> weights_pb2.WeightHeader:
    return weights_pb2.WeightHeader(
        version=update.version,
        base_version=update.base_version,
        encoding=update.encoding,
        total_bytes=update.wire_bytes,
        digest=update.digest,
        format=update.format,
        recipe=update.recipe,
    )


def update_to_chunks(
    update: EncodedUpdate, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[weights_pb2.WeightChunk]:
    yield weights_pb2.WeightChunk(header=header_of(update))
    for piece in split_chunks(update.blob, chunk_bytes):
        yield weights_pb2.WeightChunk(data=piece)


def receive_update(
    chunks: Iterable[weights_pb2.WeightChunk], max_bytes: int | None = None
) -> tuple[weights_pb2.WeightHeader, bytes]:
    """Reassemble a chunk stream; raises :class:`CorruptUpdateError` unless it is one header followed
    by data whose total size and digest match the header."""
    stream = iter(chunks)
    first = next(stream, None)
    if first is None or first.WhichOneof("part") != "header":
        raise CorruptUpdateError("a weight stream must start with its header")
    header = first.header
    assembler = Reassembler(header.total_bytes, header.digest, max_bytes)
    for chunk in stream:
        if chunk.WhichOneof("part") != "data":
            raise CorruptUpdateError("a weight stream has exactly one header, at the start")
        assembler.add(chunk.data)
    return header, assembler.finish()


def split_chunks(blob: bytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Cut a blob into pieces of at most ``chunk_bytes`` (each fits one gRPC message)."""
    view = memoryview(blob)
    for start in range(0, len(blob), chunk_bytes):
        yield bytes(view[start : start + chunk_bytes])


class Reassembler:
    """Collects data chunks and releases the blob only if its total size and digest match the header."""

    def __init__(self, total_bytes: int, digest: str, max_bytes: int | None = None) -> None:
        if total_bytes < 0 or (max_bytes is not None and total_bytes > max_bytes):
            raise CorruptUpdateError(f"total_bytes {total_bytes} outside [0, {max_bytes}]")
        self.total_bytes = total_bytes
        self.digest = digest
        self._buffer = bytearray()

    def add(self, data: bytes) -> None:
        if len(self._buffer) + len(data) > self.total_bytes:
            raise CorruptUpdateError(f"received more than the announced {self.total_bytes} bytes")
        self._buffer += data

    def finish(self) -> bytes:
        if len(self._buffer) != self.total_bytes:
            raise CorruptUpdateError(f"truncated update: {len(self._buffer)} of {self.total_bytes} bytes")
        blob = bytes(self._buffer)
        if bytes_digest(blob) != self.digest:
            raise CorruptUpdateError("update digest mismatch (corrupted or reordered chunks)")
        return blob
