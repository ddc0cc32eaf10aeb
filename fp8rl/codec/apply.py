"""A delta's chunks applied to the bytes of the held set — XORed into them in place, or into a copy, or
decompressed into fresh memory — each on the pool, and every applied chunk XORed back (bit for bit: XOR is
its own inverse) when the update is refused.

Each chunk is parsed and bounded against what is held before anything is decompressed, and nothing
decompresses to more than its chunk, whatever the stream claims.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TypeVar, cast

import numpy as np
import torch
import xxhash
import zstandard

from fp8rl.codec.layout import from_planes, tensor_nbytes, word_of
from fp8rl.codec.weight_set import BLOCK_BYTES, DTYPES, WeightSet, bytes_digest, pool, raw_bytes, spans
from fp8rl.errors import BaseMismatchError, CorruptUpdateError

T = TypeVar("T")
R = TypeVar("R")
CHUNK_ENCODINGS = ("same", "xor-sparse", "xor-zstd", "zstd")


def undo(
    held: WeightSet, outcomes: Sequence[tuple[bytes, Callable[[], None] | None] | BaseException]
) -> None:
    """XOR every rewritten chunk back (XOR is its own inverse): the held set is back, bit for bit. Should
    that itself be cut short, or a chunk have failed to put itself back, the set is consumed: it must not
    pass for a version its bytes no longer are."""
    try:
        for outcome in outcomes:
            if isinstance(outcome, tuple) and outcome[1] is not None:
                outcome[1]()
    except BaseException:
        held.consume()
        raise
    if any(isinstance(outcome, Unrestorable) for outcome in outcomes):
        held.consume()


class Unrestorable(CorruptUpdateError):
    """A chunk that failed part-way could not be put back (e.g. out of memory): its set is consumed."""


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """(first byte, bytes) of the memory ``t`` may read: its whole storage unless it is contiguous."""
    if t.is_contiguous():
        return t.untyped_storage().data_ptr() + int(t.storage_offset()) * t.element_size(), int(t.nbytes)
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


@dataclass(frozen=True)
class Target:
    """Where one tensor of a delta is rebuilt, and from what."""

    name: str
    dtype: torch.dtype
    shape: list[int]
    out: np.ndarray  # the held tensor's bytes (rewritten in place), a copy of them, or fresh memory
    word: np.dtype
    spans: list[tuple[int, int]]  # of ``out``, one per chunk
    chunks: list[tuple[str, int, int, str]]  # (encoding, packed bytes, pairs, packed digest)
    packed: list[np.ndarray]  # each chunk's packed bytes


def target_of(
    name: str, entry: dict[str, object], payload: torch.Tensor, old: torch.Tensor | None, in_place: bool
) -> Target:
    """One tensor of a delta, parsed and bounded against what is held before anything is decompressed."""
    try:
        dtype = DTYPES[str(entry["dtype"])]
        shape = [int(d) for d in entry["shape"]]  # type: ignore[attr-defined]
        nbytes = tensor_nbytes(dtype, shape)
        word = word_of(nbytes)
        if entry["word"] != word.itemsize:
            raise ValueError(f"word {entry['word']} is not the widest that tiles {nbytes} bytes")
        chunk_spans, listed = spans(nbytes), entry["chunks"]
        if not isinstance(listed, list) or len(listed) != len(chunk_spans):
            raise ValueError(f"{nbytes} bytes are {len(chunk_spans)} chunks")
        chunks, packed, offset, whole = [], [], 0, raw_bytes(payload)
        for (begin, end), chunk in zip(chunk_spans, listed, strict=True):
            encoding, size, pairs, digest = chunk
            if encoding not in CHUNK_ENCODINGS or type(size) is not int or type(pairs) is not int:
                raise ValueError(f"bad chunk {chunk}")
            if not 0 <= size <= whole.size - offset or (encoding == "same") != (size == 0):
                raise ValueError(f"chunk of {size} packed bytes at {offset} of {whole.size}")
            if not (0 < pairs <= (end - begin) // word.itemsize if encoding == "xor-sparse" else pairs == 0):
                raise ValueError(f"{pairs} pairs for a {encoding} chunk of {end - begin} bytes")
            chunks.append((encoding, size, pairs, str(digest)))
            packed.append(whole[offset : offset + size])
            offset += size
        if offset != whole.size:
            raise ValueError(f"chunks hold {offset} of the {whole.size} packed bytes")
        fresh = {c[0] for c in chunks} == {"zstd"}  # a new tensor: no base
        if not fresh and any(c[0] == "zstd" for c in chunks):
            raise ValueError("a tensor is either new (zstd chunks) or changed (XOR chunks)")
    except Exception as exc:
        raise CorruptUpdateError(f"bad entry for tensor {name!r}: {exc}") from exc
    if fresh:
        try:
            out = np.empty(nbytes, dtype=np.uint8)
        except MemoryError as exc:
            raise CorruptUpdateError(f"tensor {name!r}: cannot hold {nbytes} bytes") from exc
    else:
        if old is None or old.dtype != dtype or list(old.shape) != shape:
            raise BaseMismatchError(f"delta XORs tensor {name!r} against a base it does not match")
        out = raw_bytes(old)
        if not in_place:
            out = out.copy()
    return Target(name, dtype, shape, out, word, chunk_spans, chunks, packed)


def unpack_chunk(target: Target, i: int) -> tuple[bytes, Callable[[], None] | None]:
    """Check one chunk's packed bytes, rebuild the chunk (XOR the changes into the held bytes, or
    decompress into fresh memory) and hash it; returns the hash and what undoes it. A chunk that fails
    is undone before this raises. Nothing decompresses to more than the chunk, whatever the stream
    claims."""
    encoding, _, pairs, digest = target.chunks[i]
    packed = target.packed[i]
    if bytes_digest(packed) != digest:
        raise CorruptUpdateError(f"digest mismatch for the packed bytes of tensor {target.name!r}")
    begin, end = target.spans[i]
    out = target.out[begin:end]
    undo = None
    try:
        if encoding == "zstd":
            _decompress_exactly(packed, out)
        elif encoding == "xor-sparse":
            undo = _xor_changes(out, packed, target.word, pairs)
        elif encoding == "xor-zstd":
            undo = _xor_stream(out, packed)
    except Unrestorable:
        raise
    except Exception as exc:
        raise CorruptUpdateError(f"cannot decode tensor {target.name!r}: {exc}") from exc
    return xxhash.xxh3_128_digest(out.data), undo


def unshared(tensors: Mapping[str, torch.Tensor]) -> set[str]:
    """Names of the tensors whose bytes no other tensor of the set shares: only those are rewritten in
    place (writing one of two aliases would change a tensor the delta does not touch)."""
    extents = sorted((*_extent(t), name) for name, t in tensors.items() if t.nbytes)
    alone: set[str] = set()
    group: list[str] = []  # overlapping spans, in order of their start
    end = -1
    for begin, nbytes, name in extents:
        if begin >= end:  # a new group: the last one was a single tensor, or aliases
            if len(group) == 1:
                alone.add(group[0])
            group = []
        group.append(name)
        end = max(end, begin + nbytes)
    if len(group) == 1:
        alone.add(group[0])
    return alone


def settled(
    fn: Callable[[T], R], items: Sequence[T], sink: list[R | BaseException]
) -> tuple[list[R | BaseException], BaseException | None]:
    """``fn`` over ``items`` on the pool, each outcome a result or the exception it raised, every call
    run to its end even when this thread is interrupted meanwhile (the interrupt is returned second, and
    calls not yet started then never start): nothing is undone while a chunk may still be writing. The
    calls always run on the pool, where no signal lands; this thread only waits. Each outcome is appended
    to ``sink`` by the pool thread that made it, so that an interrupt landing anywhere on this thread
    loses none."""
    state = threading.Condition()
    running, stopped = [0], [False]

    def attempt(item: T) -> R | BaseException | None:
        with state:
            if stopped[0]:
                return None
            running[0] += 1
        try:
            outcome: R | BaseException = fn(item)
        except BaseException as exc:
            outcome = exc
        sink.append(outcome)
        with state:
            running[0] -= 1
            state.notify_all()
        return outcome

    workers, futures = pool(), list[Future[R | BaseException | None]]()
    interrupted: BaseException | None = None
    try:
        for item in items:
            futures.append(workers.submit(attempt, item))
    except BaseException as exc:  # e.g. KeyboardInterrupt: submit no more
        interrupted = exc
    while True:
        try:
            if interrupted is None:
                wait(futures)
            else:  # start nothing more (a call may have been submitted unrecorded); let the writers finish
                with state:
                    stopped[0] = True
                    while running[0]:
                        state.wait()
            break
        except BaseException as exc:
            interrupted = interrupted or exc
    if interrupted is not None:
        return [], interrupted
    return [cast("R | BaseException", f.result()) for f in futures], None


def _decompress_exactly(packed: np.ndarray, out: np.ndarray) -> None:
    """Decompress ``packed`` into ``out``, which it must fill exactly."""
    with zstandard.ZstdDecompressor().stream_reader(packed.data) as reader:
        filled = 0
        while filled < out.size:
            got = reader.readinto(out[filled:].data)
            if got == 0:
                raise ValueError(f"decodes to {filled} bytes, expected {out.size}")
            filled += got
        if reader.read(1):
            raise ValueError(f"decodes to more than the expected {out.size} bytes")


def _xor_changes(out: np.ndarray, packed: np.ndarray, word: np.dtype, changes: int) -> Callable[[], None]:
    """XOR the (index gap, XOR) pairs into ``out``'s words; returns what undoes it."""
    stream = np.empty(changes * (4 + word.itemsize), dtype=np.uint8)
    _decompress_exactly(packed, stream)
    gaps = from_planes(stream[: 4 * changes], np.dtype("<u4"))
    xors = from_planes(stream[4 * changes :], word)
    index = np.cumsum(gaps, dtype=np.int64)
    words = out.view(word)
    if changes and (index[-1] >= words.size or (changes > 1 and gaps[1:].min() < 1)):
        raise ValueError("word indices out of order or out of range")

    def xor() -> None:
        words[index] ^= xors

    xor()
    return xor


def _xor_stream(out: np.ndarray, packed: np.ndarray) -> Callable[[], None]:
    """XOR the decompressed stream into ``out`` a cache-sized block at a time; returns what undoes it. A
    stream that fails part-way is undone as far as it got before the error propagates."""
    first_scratch = np.empty(min(BLOCK_BYTES, out.size), dtype=np.uint8)  # the undo allocates its own

    def xor(upto: int, done: list[int], whole: bool, scratch: np.ndarray | None = None) -> None:
        if scratch is None:
            scratch = np.empty(min(BLOCK_BYTES, out.size), dtype=np.uint8)
        with zstandard.ZstdDecompressor().stream_reader(packed.data) as reader:
            while done[0] < upto:
                got = reader.readinto(scratch[: min(BLOCK_BYTES, upto - done[0])].data)
                if got == 0:
                    raise ValueError(f"decodes to {done[0]} bytes, expected {out.size}")
                target = out[done[0] : done[0] + got]
                np.bitwise_xor(target, scratch[:got], out=target)
                done[0] += got
            if whole and reader.read(1):
                raise ValueError(f"decodes to more than the expected {out.size} bytes")

    progress = [0]
    try:
        xor(out.size, progress, True, first_scratch)
    except BaseException as failure:
        try:
            xor(progress[0], [0], False, first_scratch)  # the same bytes again: undone as far as it got
        except BaseException as exc:
            raise Unrestorable(f"a chunk could not be put back ({exc!r}) after: {failure!r}") from exc
        raise
    return lambda: xor(out.size, [0], whole=False)
