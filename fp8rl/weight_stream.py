"""Weight updates as gRPC message streams: one ``WeightHeader``, then data chunks of at most 4 MiB.

Proto conversion only; the bytes themselves come from and go to :mod:`fp8rl.weights`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from fp8rl.v1 import weights_pb2
from fp8rl.weights import CHUNK_BYTES, CorruptUpdateError, EncodedUpdate, Reassembler, split_chunks


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
