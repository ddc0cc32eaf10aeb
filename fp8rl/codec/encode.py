"""A set as the parts of an update: a keyframe (every tensor) or a delta (each changed tensor as packed
chunks against the base the receiver holds), each part encoded as it is asked for, its chunks on the pool.

A delta's chunk (16 MiB of a tensor) packs one of four ways: ``same`` (unchanged: nothing), ``xor-sparse``
(its changed words as (index gap, XOR) pairs, their bytes grouped by significance, zstd), ``xor-zstd`` (a
zstd stream of its XOR with the base, when changes are dense) or ``zstd`` (a new tensor's bytes).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import xxhash
import zstandard

from fp8rl.codec.layout import FORMAT_VERSION, Encoding, header_segment, planes, sealed, word_of
from fp8rl.codec.weight_set import (
    BLOCK_BYTES,
    CHUNK_BYTES,
    DTYPE_NAMES,
    WeightSet,
    bytes_digest,
    digest_tensors,
    joined,
    map_chunks,
    raw_bytes,
)
from fp8rl.recipes import WeightFormat

PART_BYTES = 4 * CHUNK_BYTES  # tensor bytes per part of a streamed update (a bigger tensor is a part alone)
_ZSTD_LEVEL = 1  # XOR streams are mostly zero bytes: level 1 already finds the runs, and is fast


@dataclass(frozen=True)
class EncodedUpdate:
    """One part of an encoded update (often the only one) as segments to stream (its header, then tensor
    bytes, not concatenated), and what the stream's header and reports need."""

    segments: tuple[memoryview, ...]
    encoding: Encoding
    version: int
    base_version: int  # -1 for a keyframe
    format: WeightFormat
    recipe: str
    tensors_changed: int
    changed_bytes: int  # of the tensor bytes this part covers, those that changed (all, for a keyframe)
    tensor_bytes: int  # bytes of the set's tensors this part covers
    part: int = 0
    parts: int = 1

    @property
    def density(self) -> float:
        """Fraction of the covered tensor bytes that changed (1.0 for a keyframe)."""
        return changed_fraction(self.encoding, self.changed_bytes, self.tensor_bytes)

    @functools.cached_property
    def digest(self) -> str:
        """Digest of the part's header segment, which seals the rest of the part: it holds its tensors'
        digests (and in the last part the set digest, which covers every name, dtype and shape)."""
        return bytes_digest(self.segments[0])

    @property
    def wire_bytes(self) -> int:
        return sum(len(s) for s in self.segments)

    def pieces(self, size: int) -> Iterator[bytes]:
        """The update cut into pieces of ``size`` bytes (the last one shorter), read from the segments."""
        pending: list[memoryview] = []
        filled = 0
        for segment in self.segments:
            while len(segment):
                take = segment[: size - filled]
                pending.append(take)
                filled += len(take)
                segment = segment[len(take) :]
                if filled == size:
                    yield b"".join(pending)
                    pending, filled = [], 0
        if filled:
            yield b"".join(pending)


def changed_fraction(encoding: Encoding, changed_bytes: int, tensor_bytes: int) -> float:
    """Fraction of ``tensor_bytes`` that changed (an update's density); an empty keyframe counts as all."""
    return changed_bytes / tensor_bytes if tensor_bytes else float(encoding == "keyframe")


# -- keyframes --------------------------------------------------------------------------------------------


def keyframe_parts(
    weights: WeightSet, version: int, recipe: str = "", part_bytes: int = PART_BYTES
) -> Iterator[EncodedUpdate]:
    """The set as a keyframe in parts of about ``part_bytes`` tensor bytes, each hashed as it is asked
    for: a stream sends one part while the next is hashed, and its receiver checks one part while the
    next arrives. The last part seals the set."""
    weights.check_not_consumed()
    tensors = {n: t.contiguous() for n, t in weights.tensors.items()}
    groups = _grouped({n: t.numel() * t.element_size() for n, t in tensors.items()}, part_bytes)
    known = weights.known_tensor_digests  # hashed already (e.g. as the last delta's new set)
    digests: dict[str, str] = {}
    for i, names in enumerate(groups):
        part = {n: tensors[n] for n in names}
        part_digests = {n: known[n] for n in names} if known is not None else digest_tensors(part)
        digests.update(part_digests)
        metadata = {
            "format_version": FORMAT_VERSION,
            "kind": "full",
            "version": str(version),
            "recipe": recipe,
            "format": weights.format,
            "part": str(i),
            "parts": str(len(groups)),
            "digests": json.dumps(part_digests, sort_keys=True),
        }
        if i == len(groups) - 1:
            metadata["set_digest"] = _set_digest(weights, digests)
        nbytes = sum(t.numel() * t.element_size() for t in part.values())
        yield EncodedUpdate(
            _keyframe_segments(part, metadata),
            "keyframe",
            version,
            -1,
            weights.format,
            recipe,
            tensors_changed=len(part),
            changed_bytes=nbytes,
            tensor_bytes=nbytes,
            part=i,
            parts=len(groups),
        )


def _keyframe_segments(part: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> tuple[memoryview, ...]:
    """A keyframe part's segments: its header, then each tensor's bytes (views, not copies)."""
    layout = {n: (t.dtype, t.shape, t.numel() * t.element_size()) for n, t in part.items()}
    return (memoryview(header_segment(layout, sealed(metadata))), *(raw_bytes(t).data for t in part.values()))


def _set_digest(weights: WeightSet, digests: Mapping[str, str]) -> str:
    """The set's digest; ``digests`` (every tensor's, just computed from its bytes) are kept on the set
    unless it had them already, so that nothing is hashed twice."""
    weights.keep_tensor_digests(digests)
    return weights.digest


def _grouped(sizes: Mapping[str, int], part_bytes: int) -> list[list[str]]:
    """The names in order, cut into parts of at most ``part_bytes`` (a bigger tensor alone); at least one
    part, which may be empty."""
    groups: list[list[str]] = [[]]
    filled = 0
    for name, nbytes in sizes.items():
        if groups[-1] and filled + nbytes > part_bytes:
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += nbytes
    return groups


# -- deltas -----------------------------------------------------------------------------------------------


def delta_parts(
    new: WeightSet,
    base: WeightSet,
    version: int,
    base_version: int,
    recipe: str = "",
    part_bytes: int = PART_BYTES,
) -> Iterator[EncodedUpdate]:
    """``new`` as changes against ``base`` (which the receiver holds as ``base_version``), in parts of
    about ``part_bytes`` tensor bytes, each encoded as it is asked for (its chunks on the thread pool). The
    new set's tensor digests are computed on the way (and kept on ``new``, the next delta's base); the
    last part seals the set."""
    if new.format != base.format:
        raise ValueError(f"cannot delta-encode format {new.format!r} against {base.format!r}")
    new.check_not_consumed()
    base_digest = base.digest
    sources = {name: _Source.of(t, base.tensors.get(name)) for name, t in new.tensors.items()}
    groups = _grouped({name: s.new.size for name, s in sources.items()}, part_bytes)
    removed = sorted(set(base.tensors) - set(new.tensors))
    digests: dict[str, str] = {}  # every new tensor's, part by part: the last part seals them
    for i, names in enumerate(groups):
        packed = map_chunks({name: sources[name].new.size for name in names}, lambda n, s: sources[n].pack(s))
        digests.update({name: joined([c.digest for c in cs]) for name, cs in packed.items()})
        changed = {name: cs for name, cs in packed.items() if any(c.encoding != "same" for c in cs)}
        metadata = {
            "format_version": FORMAT_VERSION,
            "kind": "delta",
            "version": str(version),
            "base_version": str(base_version),
            "base_digest": base_digest,
            "recipe": recipe,
            "format": new.format,
            "part": str(i),
            "parts": str(len(groups)),
            "tensors": json.dumps(_delta_entries(sources, changed, digests), sort_keys=True),
        }
        last = i == len(groups) - 1
        if last:
            metadata |= {"removed": json.dumps(removed), "set_digest": _set_digest(new, digests)}
        yield EncodedUpdate(
            _delta_segments(changed, metadata),
            "delta",
            version,
            base_version,
            new.format,
            recipe,
            tensors_changed=len(changed) + (len(removed) if last else 0),
            changed_bytes=sum(c.changed_bytes for cs in packed.values() for c in cs),
            tensor_bytes=sum(sources[name].new.size for name in names),
            part=i,
            parts=len(groups),
        )


@dataclass(frozen=True)
class _PackedChunk:
    digest: bytes  # XXH3-128 of the chunk's new bytes
    encoding: str  # same | xor-sparse | xor-zstd | zstd
    packed: bytes
    pairs: int  # xor-sparse: (index gap, XOR) pairs
    changed_bytes: int

    @property
    def spec(self) -> list[object]:
        # Some flipped bits in a zstd stream decode to the same bytes: checking the packed bytes too
        # means no altered update is ever applied, even one that would come out right.
        return [self.encoding, len(self.packed), self.pairs, bytes_digest(self.packed)]


@dataclass(frozen=True)
class _Source:
    """One tensor of a delta's new set, and the base tensor's bytes it is packed against."""

    tensor: torch.Tensor
    new: np.ndarray  # the tensor's bytes
    base: np.ndarray | None  # None for a tensor the base lacks, or holds in another dtype or shape
    word: np.dtype

    @classmethod
    def of(cls, t: torch.Tensor, old: torch.Tensor | None) -> _Source:
        new = raw_bytes(t)
        same_kind = old is not None and old.dtype == t.dtype and old.shape == t.shape
        base = raw_bytes(old) if old is not None and same_kind else None
        return cls(t, new, base, word_of(new.size))

    def pack(self, span: tuple[int, int]) -> _PackedChunk:
        begin, end = span
        base = None if self.base is None else self.base[begin:end]
        return _pack_chunk(self.new[begin:end], base, self.word)


def _delta_entries(
    sources: Mapping[str, _Source], changed: Mapping[str, list[_PackedChunk]], digests: Mapping[str, str]
) -> dict[str, dict[str, object]]:
    """A part's ``tensors`` metadata: for each changed tensor, what it becomes and how its chunks pack."""
    return {
        name: {
            "dtype": DTYPE_NAMES[sources[name].tensor.dtype],
            "shape": list(sources[name].tensor.shape),
            "digest": digests[name],
            "word": sources[name].word.itemsize,
            "chunks": [c.spec for c in cs],
        }
        for name, cs in changed.items()
    }


def _delta_segments(
    changed: Mapping[str, list[_PackedChunk]], metadata: dict[str, str]
) -> tuple[memoryview, ...]:
    """A delta part's segments: its header (each changed tensor a uint8 tensor of its packed chunks),
    then the packed bytes."""
    sizes = {name: sum(len(c.packed) for c in cs) for name, cs in changed.items()}
    layout = {name: (torch.uint8, [size], size) for name, size in sizes.items()}
    header = memoryview(header_segment(layout, sealed(metadata)))
    return (header, *(memoryview(c.packed) for cs in changed.values() for c in cs if c.packed))


def _pack_chunk(new: np.ndarray, old: np.ndarray | None, word: np.dtype) -> _PackedChunk:
    """One chunk of a tensor: hash its new bytes and find the words that differ from the base's, a
    cache-sized block at a time; ship them as (index gap, XOR) pairs, their bytes grouped by significance.
    Dense changes (or no base) ship as a zstd stream of the XOR (or of the bytes) instead."""
    if old is None:
        return _pack_dense(new, None)
    new_words, base_words = new.view(word), old.view(word)
    dense_from = new.size // 4 // (4 + word.itemsize)  # more pairs than this: a stream of the XOR is smaller
    step = BLOCK_BYTES // word.itemsize
    differs = np.empty(min(step, new_words.size), dtype=bool)
    h = xxhash.xxh3_128()
    where, what, pairs = [], [], 0
    for begin in range(0, new_words.size, step):
        block, base_block = new_words[begin : begin + step], base_words[begin : begin + step]
        h.update(block.data)
        at = np.flatnonzero(np.not_equal(block, base_block, out=differs[: block.size]))
        if at.size:
            where.append(at + begin)
            what.append(block[at] ^ base_block[at])
            pairs += at.size
            if pairs > dense_from:
                return _pack_dense(new, old)
    if pairs == 0:
        return _PackedChunk(h.digest(), "same", b"", 0, 0)
    index, xors = np.concatenate(where), np.concatenate(what)
    gaps = np.diff(index, prepend=0).astype("<u4")  # a chunk has fewer than 2**32 words
    stream = np.concatenate([planes(gaps), planes(xors)])
    packed = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(stream.data)
    return _PackedChunk(h.digest(), "xor-sparse", packed, pairs, int(np.count_nonzero(xors.view(np.uint8))))


def _pack_dense(new: np.ndarray, base: np.ndarray | None) -> _PackedChunk:
    compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compressobj(size=new.size)
    h = xxhash.xxh3_128()
    scratch = np.empty(min(BLOCK_BYTES, new.size), dtype=np.uint8)
    pieces, changed = [], new.size if base is None else 0
    for begin in range(0, new.size, BLOCK_BYTES):
        block = new[begin : begin + BLOCK_BYTES]
        h.update(block.data)
        if base is not None:
            xor = scratch[: block.size]
            np.bitwise_xor(block, base[begin : begin + BLOCK_BYTES], out=xor)
            changed += int(np.count_nonzero(xor))
            block = xor
        pieces.append(compressor.compress(block.data))
    pieces.append(compressor.flush())
    encoding = "zstd" if base is None else "xor-zstd"
    return _PackedChunk(h.digest(), encoding, b"".join(pieces), 0, changed)
