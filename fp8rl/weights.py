"""WeightSet — the rollout's view of the policy weights — and its safetensors wire codec.

A WeightSet maps HF parameter names (unfused q/k/v and gate/up; vLLM's loader fuses them) to tensors in
the rollout's format. For ``fp8-block128`` (and ``fp8-block128-pow2``) every linear weight inside the
transformer blocks ships as ``<module>.weight`` (float8_e4m3fn) plus ``<module>.weight_scale_inv``
(float32 block scales, powers of two under ``-pow2``, from :mod:`fp8rl.quant`); under a recipe with an
FP8 KV cache, each layer's ``self_attn.q_scale``, ``k_scale`` and ``v_scale`` (float32 scalars);
everything else, and every tensor of ``bf16``, in the high-precision dtype (bf16 unless a float32
exactness run asks for float32).

Two encodings, both sent as one or more *parts*, each part laid out as one safetensors file with string
metadata (its index and the number of parts; the last part seals the set with its digest). Parts cover
consecutive tensors, about 64 MiB of them each, so that a stream sends one part while the next is
encoded and its receiver applies one part while the next arrives:

* keyframe (``kind: full``): the whole set, with a digest per tensor.
* delta (``kind: delta``): each tensor whose bytes changed, as a uint8 tensor of packed chunks (16 MiB of
  the tensor each): an unchanged chunk packs to nothing, a sparse one to its changed words as (index
  gap, XOR) pairs with their bytes grouped by significance, a dense one to a stream of its XOR with the
  base, a new tensor's to a stream of its bytes (zstd throughout), each with the digest of its packed
  bytes; and the digest of each resulting tensor. A delta names its base version and the base set's
  digest, so it is only ever applied to exactly the bytes it was computed against.

Decoding verifies every digest before it returns, and an update is applied whole or not at all (parts are
applied as they arrive, and every part is put back if a later one fails). A delta
against a set that owns its memory (one the codec built or decoded) is applied in place: XORed into that
memory (no second copy of the set is made), and on any refusal XORed back, bit for bit (XOR is its own
inverse).

Speed (bench/weight_sync.py): every byte is hashed once, with XXH3-128 (integrity against corruption;
authenticity is the transport's job: TLS, or a MAC over the update); a tensor's digest is built from its
chunks' digests and the set digest from the tensors'. An update is a list of segments (its header, then
each tensor's bytes, viewed, not copied) that the stream cuts into pieces; a received buffer is decoded in
place. Chunks are the unit of work on a thread pool (numpy, zstd and xxhash release the GIL), so a big
tensor keeps every core busy; within a chunk, deltas are computed in cache-sized blocks.
"""

from __future__ import annotations

import contextvars
import functools
import json
import math
import os
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Literal, TypeVar, cast

import numpy as np
import torch
import xxhash
import zstandard

from fp8rl import quant
from fp8rl.errors import BaseMismatchError, CorruptUpdateError
from fp8rl.recipes import WEIGHT_FORMATS, WeightFormat, is_fp8, weight_scale_format

FORMAT_VERSION = "5"  # 4: 16 MiB chunks, sparse streams in byte planes; 5: updates in parts
Encoding = Literal["keyframe", "delta"]
SCALE_SUFFIX = "weight_scale_inv"
_ZSTD_LEVEL = 1  # XOR streams are mostly zero bytes: level 1 already finds the runs, and is fast
_BLOCK = 1 << 20  # bytes per step of the delta loops: a block is compared, gathered and hashed from cache
_CHUNK = 16 * _BLOCK  # bytes per task on the thread pool: a big tensor keeps every core busy
PART_BYTES = 4 * _CHUNK  # tensor bytes per part of a streamed update (a bigger tensor is a part alone)
MAX_PARTS = 1 << 20  # parts in one update: 64 TiB of tensors at the default part size
_DIGEST = "xxh3-128:"
T = TypeVar("T")
R = TypeVar("R")


def is_block_linear(name: str, ndim: int) -> bool:
    """True for linear weights inside transformer blocks — the ones FP8 recipes quantize.

    Norms are 1-D, biases end in ``.bias``, and embeddings / lm_head live outside ``.layers.``.
    """
    return ndim == 2 and name.endswith(".weight") and ".layers." in name


def is_fp8_linear(name: str, ndim: int, high_precision: Collection[str] = frozenset()) -> bool:
    """True for the block linears an FP8 format ships as codes and scales: all but ``high_precision``
    (module names, e.g. ``model.layers.0.self_attn.q_proj``)."""
    return is_block_linear(name, ndim) and name.removesuffix(".weight") not in high_precision


ATTENTION_SCALES = ("q_scale", "k_scale", "v_scale")
"""The per-layer scales of FP8 attention, in this order: the query's and the KV cache's (vLLM's names)."""


def attention_scale_names(attention_module: str) -> list[str]:
    """The names an attention module's scales ship under (``model.layers.0.self_attn.q_scale``, ...)."""
    return [f"{attention_module}.{scale}" for scale in ATTENTION_SCALES]


def is_attention_scale(name: str) -> bool:
    """True for the per-layer scales of FP8 attention (float32 scalars)."""
    return name.endswith(tuple(f".self_attn.{scale}" for scale in ATTENTION_SCALES))


def scale_name(weight_name: str) -> str:
    return weight_name.removesuffix("weight") + SCALE_SUFFIX


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array (a view when ``t`` is contiguous on CPU)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def bytes_digest(data: bytes | bytearray | memoryview | np.ndarray) -> str:
    return _DIGEST + xxhash.xxh3_128_hexdigest(data.data if isinstance(data, np.ndarray) else data)


def _spans(nbytes: int) -> list[tuple[int, int]]:
    """The byte ranges a tensor is hashed, packed and unpacked in, each on whichever core is free (one,
    maybe empty, for a small tensor)."""
    return [(begin, min(begin + _CHUNK, nbytes)) for begin in range(0, nbytes, _CHUNK)] or [(0, 0)]


def _joined(chunk_digests: Sequence[bytes]) -> str:
    """A tensor's digest: XXH3-128 over its chunks' XXH3-128 digests, so that a big tensor is hashed on
    every core at once."""
    return _DIGEST + xxhash.xxh3_128_hexdigest(b"".join(chunk_digests))


def digest_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Every tensor's digest, all their chunks hashed in parallel."""
    arrays = {name: raw_bytes(t) for name, t in tensors.items()}
    hashed = _map_chunks(
        {name: a.size for name, a in arrays.items()},
        lambda name, span: xxhash.xxh3_128_digest(arrays[name][span[0] : span[1]].data),
    )
    return {name: _joined(digests) for name, digests in hashed.items()}


def _map_chunks(sizes: Mapping[str, int], fn: Callable[[str, tuple[int, int]], R]) -> dict[str, list[R]]:
    """``fn(name, span)`` for every chunk of every tensor (``sizes``: bytes per name) on the pool, biggest
    first (balanced threads); each tensor's results in chunk order."""
    work = [(name, i, span) for name, nbytes in sizes.items() for i, span in enumerate(_spans(nbytes))]
    work.sort(key=lambda w: w[2][0] - w[2][1])
    results = parallel_map(lambda w: fn(w[0], w[2]), work)
    chunks: dict[str, dict[int, R]] = {name: {} for name in sizes}
    for (name, i, _), result in zip(work, results, strict=True):
        chunks[name][i] = result
    return {name: [c[i] for i in range(len(c))] for name, c in chunks.items()}


_WORKERS = os.cpu_count() or 2  # one thread per core
_IN_FLIGHT = 4  # tensors converted or waiting at a time while a set is built (memory, not speed)
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
MAX_TENSOR_BYTES = 1 << 40  # no tensor is larger; a claim beyond it is corrupt


def parallel_map(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]`` on a process-wide pool of one thread per core (the work is numpy, zstd
    and xxhash calls, which release the GIL)."""
    if len(items) < 2:
        return [fn(x) for x in items]
    return list(_pool().map(fn, items))


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="codec")
        return _POOL


_DTYPE_NAMES = {
    torch.float8_e4m3fn: "F8_E4M3",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.uint8: "U8",
    torch.int64: "I64",
    torch.int32: "I32",
}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


@dataclass(frozen=True)
class WeightSet:
    """Named tensors in one rollout weight format.

    ``owned``: the tensors' memory is the codec's own (copies it made, or a received buffer handed to
    it), so a delta decoded against this set may rewrite it in place; the set is then consumed (its
    digests refuse to be read, since its memory now holds another version), and the decoded set, which
    shares that memory, takes its place. A set over the caller's own tensors is never written to."""

    format: WeightFormat
    tensors: Mapping[str, torch.Tensor]
    owned: bool = False

    @functools.cached_property
    def tensor_digests(self) -> dict[str, str]:
        self._check_not_consumed()
        return digest_tensors(self.tensors)

    @functools.cached_property
    def digest(self) -> str:
        """Digest over names, dtypes, shapes and tensor digests, independent of order (no tensor byte is
        read again)."""
        self._check_not_consumed()
        h = xxhash.xxh3_128()
        for name in sorted(self.tensors):
            t = self.tensors[name]
            h.update(f"{name}|{_DTYPE_NAMES[t.dtype]}|{list(t.shape)}|{self.tensor_digests[name]}\n".encode())
        return _DIGEST + h.hexdigest()

    @classmethod
    def verified(
        cls,
        weight_format: WeightFormat,
        tensors: Mapping[str, torch.Tensor],
        digests: Mapping[str, str],
        owned: bool = False,
    ) -> WeightSet:
        """A set whose tensor digests were just checked (or computed): keep them rather than hash again."""
        weights = cls(weight_format, tensors, owned)
        weights.__dict__["tensor_digests"] = dict(digests)
        return weights

    @property
    def consumed(self) -> bool:
        return bool(self.__dict__.get("_consumed"))

    def _consume(self) -> None:
        self.__dict__.pop("tensor_digests", None)
        self.__dict__.pop("digest", None)
        self.__dict__["_consumed"] = True

    def _check_not_consumed(self) -> None:
        if self.consumed:
            raise ValueError("this weight set was consumed by a delta applied in place: use the decoded set")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def build_weight_set(
    state_dict: Mapping[str, torch.Tensor],
    weight_format: WeightFormat,
    hp_dtype: torch.dtype = torch.bfloat16,
    high_precision: Collection[str] = frozenset(),
) -> WeightSet:
    """Convert a model state dict (HF names) to the rollout's format.

    ``hp_dtype`` is the dtype of every tensor that is not FP8 (bf16 normally; float32 for exactness
    checks). FP8 codes and scales are exactly :func:`fp8rl.quant.quantize_blockwise` of the weight, in
    the format's scale format. ``high_precision``: block linears (module names, as
    :class:`fp8rl.architectures.FP8Plan` keeps them) that ship in ``hp_dtype`` under an FP8 format.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r}; expected one of {WEIGHT_FORMATS}")
    scale_format = weight_scale_format(weight_format)

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        # On the weight's own device, then to the host: a GPU quantizes fast and sends the host a quarter
        # of the bytes, and its codes equal the CPU's bit for bit (tests/test_quant_gpu.py).
        if is_fp8(weight_format) and is_fp8_linear(name, t.ndim, high_precision):
            codes, scales = quant.quantize_blockwise(t, scale_format=scale_format)
            return {name: codes.cpu(), scale_name(name): scales.cpu()}
        if is_attention_scale(name):  # scales stay float32, as the engines use them
            return {name: t.to(torch.float32, copy=True).cpu().contiguous()}
        # Always a copy: a set must never alias live parameters the optimizer keeps changing.
        return {name: t.to(hp_dtype, copy=True).cpu().contiguous()}

    # Tensors are read in order on this thread (a sharded learner gathers each one, collectively, as it
    # is read). CPU tensors are converted on the pool (quantizing is many small torch ops: two tensors
    # at a time keep two cores busy), at most _IN_FLIGHT at a time, so that a gathered model is never
    # held whole. GPU tensors are converted on this thread: their kernels queue on the device anyway,
    # and a pool thread's current CUDA device is not this one's.
    out: dict[str, torch.Tensor] = {}
    pool, pending = _pool(), deque[Future[dict[str, torch.Tensor]]]()
    try:
        for name, t in state_dict.items():
            t = t.detach()
            if t.device.type != "cpu":
                while pending:  # (in order)
                    out.update(pending.popleft().result())
                out.update(convert(name, t))
                continue
            # The caller's context (e.g. quant.nonfinite_passes) goes with the work to the pool's thread.
            pending.append(pool.submit(contextvars.copy_context().run, convert, name, t))
            while len(pending) >= _IN_FLIGHT:
                out.update(pending.popleft().result())
        while pending:
            out.update(pending.popleft().result())
    finally:
        for future in pending:  # after an error: nothing keeps converting once this returns
            future.cancel()
        wait(pending)
    return WeightSet(weight_format, out, owned=True)


# -- the safetensors layout -------------------------------------------------------------------------------
# An 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, __metadata__},
# padded with spaces to a multiple of 8, then the tensors' bytes back to back. Written and read here so
# that an update is never concatenated into one buffer on the way out nor copied out of one on the way in;
# safetensors itself reads what this writes.


def _layout(
    tensors: Mapping[str, tuple[torch.dtype, Sequence[int], int]], metadata: Mapping[str, str]
) -> bytes:
    """The header segment for tensors given as name -> (dtype, shape, nbytes), in that order."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {
            "dtype": _DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _read_header(blob: bytes | bytearray | memoryview) -> tuple[dict[str, object], int]:
    """The parsed JSON header and where the data starts."""
    try:
        (header_len,) = struct.unpack("<Q", bytes(blob[:8]))
        if header_len > len(blob) - 8:
            raise ValueError(f"header of {header_len} bytes in a blob of {len(blob)}")
        text = bytes(blob[8 : 8 + header_len])
        header = json.loads(text)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        canonical = json.dumps(header, separators=(",", ":")).encode()
        if text != canonical + b" " * (-len(canonical) % 8):  # one spelling: no byte of it goes unchecked
            raise ValueError("header is not in its canonical form")
    except Exception as exc:
        raise CorruptUpdateError(f"cannot read weight update header: {exc}") from exc
    return header, 8 + header_len


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Bytes of a tensor, for shapes read from an update (bounded: no overflow, no absurd claim)."""
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in shape {list(shape)}")
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes > MAX_TENSOR_BYTES:
        raise ValueError(f"shape {list(shape)} claims {nbytes} bytes")
    return nbytes


Admit = Callable[[str, torch.dtype, tuple[int, ...]], None]


def _tensors_of(
    blob: bytes | bytearray | memoryview, header: Mapping[str, object], start: int
) -> dict[str, torch.Tensor]:
    """The tensors a header describes, as views of ``blob`` when it is writable (a received buffer),
    copies otherwise. The data must be exactly the tensors' bytes, back to back, in header order."""
    writable = not memoryview(blob).readonly
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            assert isinstance(spec, dict) and set(spec) == {"dtype", "shape", "data_offsets"}, "bad entry"
            dtype, shape = _DTYPES[spec["dtype"]], [int(d) for d in spec["shape"]]
            begin, end = (int(x) for x in spec["data_offsets"])
            nbytes = _nbytes(dtype, shape)
            if begin != offset or end - begin != nbytes:
                raise ValueError(f"data_offsets {[begin, end]} do not fit shape {shape} at offset {offset}")
        except Exception as exc:
            raise CorruptUpdateError(f"bad header entry for tensor {name!r}: {exc}") from exc
        offset = end
        if start + end > len(blob):
            raise CorruptUpdateError(f"tensor {name!r} runs past the end of the update")
        if nbytes == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        data = np.frombuffer(blob, dtype=np.uint8, count=nbytes, offset=start + begin)
        out[name] = torch.from_numpy(data if writable else data.copy()).view(dtype).reshape(shape)
    if start + offset != len(blob):
        raise CorruptUpdateError(f"update has {len(blob) - start - offset} bytes beyond its tensors")
    return out


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

    @functools.cached_property
    def blob(self) -> bytes:
        """The update as one buffer (tests, files); the stream sends the segments as they are."""
        return b"".join(self.segments)

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


def _view(t: torch.Tensor) -> memoryview:
    return raw_bytes(t).data


def sealed(metadata: dict[str, str]) -> dict[str, str]:
    """``metadata`` plus a digest of it: the tensor digests cover the data, this covers the rest (a
    flipped digit in ``version`` would otherwise be read as another version)."""
    return metadata | {"metadata_digest": _metadata_digest(metadata)}


def _metadata_digest(metadata: Mapping[str, str]) -> str:
    return bytes_digest(json.dumps(dict(metadata), sort_keys=True).encode())


def encode_keyframe(weights: WeightSet, version: int, recipe: str = "") -> EncodedUpdate:
    """The whole set as a keyframe in one part."""
    (whole,) = keyframe_parts(weights, version, recipe, part_bytes=sys.maxsize)
    return whole


def keyframe_parts(
    weights: WeightSet, version: int, recipe: str = "", part_bytes: int = PART_BYTES
) -> Iterator[EncodedUpdate]:
    """The set as a keyframe in parts of about ``part_bytes`` tensor bytes, each hashed as it is asked
    for: a stream sends one part while the next is hashed, and its receiver checks one part while the
    next arrives. The last part seals the set."""
    weights._check_not_consumed()
    tensors = {n: t.contiguous() for n, t in weights.tensors.items()}
    groups = _grouped({n: t.numel() * t.element_size() for n, t in tensors.items()}, part_bytes)
    known = weights.__dict__.get("tensor_digests")  # hashed already (e.g. as the last delta's new set)
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
        layout = {n: (t.dtype, t.shape, t.numel() * t.element_size()) for n, t in part.items()}
        nbytes = sum(size for _, _, size in layout.values())
        yield EncodedUpdate(
            (memoryview(_layout(layout, sealed(metadata))), *(_view(t) for t in part.values())),
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


def _set_digest(weights: WeightSet, digests: dict[str, str]) -> str:
    """The set's digest; ``digests`` (every tensor's, just computed from its bytes) are kept on the set
    unless it had them already, so that nothing is hashed twice."""
    weights.__dict__.setdefault("tensor_digests", digests)
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


def _word(nbytes: int) -> np.dtype:
    """The widest little-endian unsigned word that tiles ``nbytes``: sparse deltas index words."""
    return np.dtype(next(f"<u{w}" for w in (8, 4, 2, 1) if nbytes % w == 0))


def _planes(a: np.ndarray) -> np.ndarray:
    """``a``'s bytes regrouped by significance (every element's first byte, then every second byte...):
    the high bytes of small gaps and of XORs are runs of zeros that zstd then finds at once."""
    return a.view(np.uint8).reshape(-1, a.itemsize).T.ravel()


def _from_planes(data: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return data.reshape(dtype.itemsize, -1).T.copy().view(dtype).ravel()


def _pack_chunk(new: np.ndarray, old: np.ndarray | None, word: np.dtype) -> _PackedChunk:
    """One chunk of a tensor: hash its new bytes and find the words that differ from the base's, a
    cache-sized block at a time; ship them as (index gap, XOR) pairs, their bytes grouped by significance.
    Dense changes (or no base) ship as a zstd stream of the XOR (or of the bytes) instead."""
    if old is None:
        return _pack_dense(new, None)
    new_words, base_words = new.view(word), old.view(word)
    dense_from = new.size // 4 // (4 + word.itemsize)  # more pairs than this: a stream of the XOR is smaller
    step = _BLOCK // word.itemsize
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
    stream = np.concatenate([_planes(gaps), _planes(xors)])
    packed = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(stream.data)
    return _PackedChunk(h.digest(), "xor-sparse", packed, pairs, int(np.count_nonzero(xors.view(np.uint8))))


def _pack_dense(new: np.ndarray, base: np.ndarray | None) -> _PackedChunk:
    compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compressobj(size=new.size)
    h = xxhash.xxh3_128()
    scratch = np.empty(min(_BLOCK, new.size), dtype=np.uint8)
    pieces, changed = [], new.size if base is None else 0
    for begin in range(0, new.size, _BLOCK):
        block = new[begin : begin + _BLOCK]
        h.update(block.data)
        if base is not None:
            xor = scratch[: block.size]
            np.bitwise_xor(block, base[begin : begin + _BLOCK], out=xor)
            changed += int(np.count_nonzero(xor))
            block = xor
        pieces.append(compressor.compress(block.data))
    pieces.append(compressor.flush())
    encoding = "zstd" if base is None else "xor-zstd"
    return _PackedChunk(h.digest(), encoding, b"".join(pieces), 0, changed)


def encode_delta(
    new: WeightSet, base: WeightSet, version: int, base_version: int, recipe: str = ""
) -> EncodedUpdate:
    """``new`` as changes against ``base`` in one part (see :func:`delta_parts`)."""
    (whole,) = delta_parts(new, base, version, base_version, recipe, part_bytes=sys.maxsize)
    return whole


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
    new._check_not_consumed()
    base_digest = base.digest
    arrays, bases, words = {}, {}, {}
    for name, t in new.tensors.items():
        arrays[name], old = raw_bytes(t), base.tensors.get(name)
        words[name] = _word(arrays[name].size)
        same_kind = old is not None and old.dtype == t.dtype and old.shape == t.shape
        bases[name] = raw_bytes(old) if same_kind else None  # type: ignore[arg-type]

    def pack(name: str, span: tuple[int, int]) -> _PackedChunk:
        old = bases[name]
        return _pack_chunk(
            arrays[name][span[0] : span[1]], None if old is None else old[span[0] : span[1]], words[name]
        )

    groups = _grouped({name: a.size for name, a in arrays.items()}, part_bytes)
    removed = sorted(set(base.tensors) - set(new.tensors))
    digests: dict[str, str] = {}
    for i, names in enumerate(groups):
        packed = _map_chunks({name: arrays[name].size for name in names}, pack)
        digests.update({name: _joined([c.digest for c in cs]) for name, cs in packed.items()})
        changed = {name: cs for name, cs in packed.items() if any(c.encoding != "same" for c in cs)}
        entries = {
            name: {
                "dtype": _DTYPE_NAMES[new.tensors[name].dtype],
                "shape": list(new.tensors[name].shape),
                "digest": digests[name],
                "word": words[name].itemsize,
                "chunks": [c.spec for c in cs],
            }
            for name, cs in changed.items()
        }
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
            "tensors": json.dumps(entries, sort_keys=True),
        }
        last = i == len(groups) - 1
        if last:
            metadata |= {"removed": json.dumps(removed), "set_digest": _set_digest(new, digests)}
        sizes = {name: sum(len(c.packed) for c in cs) for name, cs in changed.items()}
        layout = {name: (torch.uint8, [size], size) for name, size in sizes.items()}
        yield EncodedUpdate(
            (
                memoryview(_layout(layout, sealed(metadata))),
                *(memoryview(c.packed) for cs in changed.values() for c in cs if c.packed),
            ),
            "delta",
            version,
            base_version,
            new.format,
            recipe,
            tensors_changed=len(changed) + (len(removed) if last else 0),
            changed_bytes=sum(c.changed_bytes for cs in packed.values() for c in cs),
            tensor_bytes=sum(arrays[name].size for name in names),
            part=i,
            parts=len(groups),
        )


@dataclass(frozen=True)
class DecodedUpdate:
    weights: WeightSet
    version: int
    encoding: Encoding
    tensors_updated: int


def decode_update(
    blob: bytes | bytearray | memoryview,
    held: WeightSet | None = None,
    held_version: int | None = None,
    admit: Admit | None = None,
    accept: Callable[[DecodedUpdate], None] | None = None,
) -> DecodedUpdate:
    """Verify and apply an update that is one part (see :class:`UpdateDecoder`)."""
    decoder = UpdateDecoder(held, held_version, admit)
    decoder.add(blob)
    return decoder.finish(accept)


class UpdateDecoder:
    """Verifies and applies an update part by part, as the parts arrive; :meth:`finish` returns the new
    set once the last part sealed it. A writable part (a received buffer) is decoded in place: a
    keyframe's tensors are views of it, and the set owns it from then on (a later delta may rewrite it).
    ``admit(name, dtype, shape)`` sees every tensor a part brings before any of it is allocated or
    decompressed, and raises to refuse it (the receiver's model decides what it can take);
    ``accept(decoded)`` sees the result, and raises to refuse it.

    A delta against a set that owns its memory (:attr:`WeightSet.owned`) is applied in place, part by
    part: the held tensors it changes are rewritten in their own memory (no copy of the set is made; the
    new set shares them), and ``held`` is consumed once the update is accepted, so that it cannot pass for
    its old version. It is all or nothing all the same: on any failure (a digest, a bound, a missing part,
    ``accept``, an interrupt, or :meth:`abort` from a caller whose stream broke) every rewritten chunk of
    every part is XORed back, bit for bit, before the error propagates. Against any other set, changed
    tensors are copies. Used as a context manager, it aborts unless it finished.

    Raises :class:`BaseMismatchError` for a delta whose base is not (``held_version``, ``held``), and
    :class:`CorruptUpdateError` when any size, parse, order or digest check fails.
    """

    def __init__(
        self, held: WeightSet | None = None, held_version: int | None = None, admit: Admit | None = None
    ) -> None:
        self.held, self.held_version, self.admit = held, held_version, admit
        self.parts = 0  # parts added
        self._identity: dict[str, str | None] | None = None  # what every part must say alike
        self._last: dict[str, str] | None = None  # the sealing part's metadata
        self._tensors: dict[str, torch.Tensor] = {}
        self._digests: dict[str, str] = {}
        self._outcomes: list[tuple[bytes, Callable[[], None] | None] | BaseException] = []
        self._in_place: set[str] = set()
        self._updated = 0
        self._closed = False

    def __enter__(self) -> UpdateDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    def add(self, blob: bytes | bytearray | memoryview) -> None:
        """Verify and apply the next part."""
        if self._closed:
            raise ValueError("this update was finished or aborted")
        try:
            self._add(blob)
        except BaseException:
            self.abort()
            raise

    def finish(self, accept: Callable[[DecodedUpdate], None] | None = None) -> DecodedUpdate:
        """The new set, once every part is in and the set digest checks out (and ``accept`` took it)."""
        if self._closed:
            raise ValueError("this update was finished or aborted")
        try:
            decoded = self._finish()
            if accept is not None:
                accept(decoded)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._outcomes.clear()  # (the undo records hold received bytes)
        if decoded.encoding == "delta" and self.held is not None and self.held.owned:
            self.held._consume()  # its memory now belongs to (and may hold) the new version
        return decoded

    def abort(self) -> None:
        """Put back everything applied so far (a no-op once finished or aborted)."""
        if self._closed:
            return
        self._closed = True
        if self.held is not None:
            _undo(self.held, self._outcomes)
        self._outcomes.clear()

    def _add(self, blob: bytes | bytearray | memoryview) -> None:
        header, start = _read_header(blob)
        metadata = _checked_metadata(header)
        tensors = _tensors_of(blob, header, start)
        identity = {key: metadata.get(key) for key in _IDENTITY}
        try:
            part, parts = int(metadata["part"]), int(identity["parts"])  # type: ignore[arg-type]
            int(metadata["version"])
        except Exception as exc:  # any parse failure means the bytes are not what was sent
            raise CorruptUpdateError(f"cannot parse weight update: {exc}") from exc
        if self._identity is None:
            if not 0 < parts <= MAX_PARTS:
                raise CorruptUpdateError(f"an update of {parts} parts (at most {MAX_PARTS})")
            self._start(identity)
        elif identity != self._identity:
            raise CorruptUpdateError(f"part {part} belongs to another update than part 0")
        if part != self.parts or part >= parts:
            raise CorruptUpdateError(f"part {part} arrived where part {self.parts} of {parts} was due")
        last = part == parts - 1
        if ("set_digest" in metadata) != last:
            raise CorruptUpdateError(f"part {part} of {parts}: only the last part seals the set")
        names = set(tensors)
        if names & self._tensors.keys():
            raise CorruptUpdateError(f"tensors {sorted(names & self._tensors.keys())} came in two parts")
        if identity["kind"] == "full":
            self._add_full(tensors, metadata)
        else:
            self._add_delta(tensors, metadata)
        self.parts += 1
        if last:
            self._last = metadata

    def _start(self, identity: dict[str, str | None]) -> None:
        """Checks the first part's identity: what it is, and for a delta, that it applies to what is held."""
        kind, weight_format = identity["kind"], identity["format"]
        if weight_format not in WEIGHT_FORMATS:
            raise CorruptUpdateError(f"unknown weight format {weight_format!r}")
        if kind == "delta":
            held, held_version = self.held, self.held_version
            try:
                base_version = int(identity["base_version"])  # type: ignore[arg-type]
            except (TypeError, ValueError) as exc:
                raise CorruptUpdateError(f"bad delta base_version: {exc}") from exc
            if held is not None and held.consumed:
                raise BaseMismatchError(
                    "the held set was consumed by an earlier delta: decode against the set it gave"
                )
            if held is None or held_version != base_version:
                raise BaseMismatchError(
                    f"delta applies to version {base_version}, receiver holds "
                    f"{'nothing' if held is None else held_version}"
                )
            if held.digest != identity["base_digest"] or held.format != weight_format:
                raise BaseMismatchError(f"delta base digest does not match the held version {held_version}")
            self._in_place = _unshared(held.tensors) if held.owned else set()
        elif kind != "full":
            raise CorruptUpdateError(f"unknown update kind {kind!r}")
        self._identity = identity

    def _add_full(self, tensors: dict[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
        digests = _json_field(metadata, "digests")
        if not isinstance(digests, dict) or set(digests) != set(tensors):
            raise CorruptUpdateError("keyframe tensor names do not match its digests")
        if self.admit is not None:
            for name, t in tensors.items():
                self.admit(name, t.dtype, tuple(t.shape))
        for name, digest in digest_tensors(tensors).items():
            if digest != digests[name]:
                raise CorruptUpdateError(f"digest mismatch for tensor {name!r}")
        self._tensors.update(tensors)
        self._digests.update(digests)
        self._updated += len(tensors)

    def _add_delta(self, payload: dict[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
        held = self.held
        assert held is not None  # checked by _start
        entries = _json_field(metadata, "tensors")
        if not isinstance(entries, dict) or set(entries) != set(payload):
            raise CorruptUpdateError("delta tensor list does not match its payload")
        for name, entry in entries.items():
            if not isinstance(entry, dict) or set(entry) != _DELTA_ENTRY_FIELDS:
                raise CorruptUpdateError(f"delta entry for tensor {name!r} is malformed")
            if self.admit is not None:
                try:
                    dtype, shape = _DTYPES[str(entry["dtype"])], tuple(int(d) for d in entry["shape"])
                except Exception as exc:
                    raise CorruptUpdateError(f"bad entry for tensor {name!r}: {exc}") from exc
                self.admit(name, dtype, shape)
        targets = [
            _target(name, entry, payload[name], held.tensors.get(name), name in self._in_place)
            for name, entry in entries.items()
        ]
        work = [(target, i) for target in targets for i in range(len(target.chunks))]
        work.sort(key=lambda w: w[0].spans[w[1]][0] - w[0].spans[w[1]][1])  # big first: balanced threads
        # Each outcome is recorded (for abort's undo) by the thread that applied it, as soon as it did.
        outcomes, interrupted = _settled(lambda w: _unpack_chunk(*w), work, self._outcomes)
        if interrupted is not None:
            raise interrupted
        hashed: dict[tuple[str, int], bytes] = {}
        for (target, i), outcome in zip(work, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                raise outcome
            hashed[target.name, i] = outcome[0]
        for target in targets:
            digest = _joined([hashed[target.name, i] for i in range(len(target.chunks))])
            if digest != entries[target.name]["digest"]:
                raise CorruptUpdateError(f"digest mismatch for tensor {target.name!r}")
            self._tensors[target.name] = torch.from_numpy(target.out).view(target.dtype).reshape(target.shape)
            self._digests[target.name] = digest
        self._updated += len(entries)

    def _finish(self) -> DecodedUpdate:
        metadata, identity = self._last, self._identity
        if metadata is None or identity is None:  # (parts come in order: the last one came last)
            raise CorruptUpdateError(f"truncated update: {self.parts} parts arrived, the last did not")
        version = int(metadata["version"])
        weight_format = cast(WeightFormat, metadata["format"])
        if identity["kind"] == "full":
            # The tensors are copies, or views of buffers handed to the decoder: the set owns its memory.
            weights = _checked_set(weight_format, self._tensors, self._digests, metadata, owned=True)
            return DecodedUpdate(weights, version, "keyframe", self._updated)
        held = self.held
        assert held is not None  # checked by _start
        removed = _json_field(metadata, "removed")
        if (
            not isinstance(removed, list)
            or not all(isinstance(name, str) for name in removed)
            or not set(removed) <= held.tensors.keys()
            or set(removed) & self._tensors.keys()
            or len(set(removed)) != len(removed)
        ):
            raise CorruptUpdateError("delta removed list names tensors not held, or ones it updates")
        new = {name: t for name, t in held.tensors.items() if name not in removed} | self._tensors
        digests = {name: d for name, d in held.tensor_digests.items() if name not in removed} | self._digests
        weights = _checked_set(held.format, new, digests, metadata, held.owned)
        return DecodedUpdate(weights, version, "delta", self._updated + len(removed))


_IDENTITY = ("kind", "version", "base_version", "base_digest", "recipe", "format", "parts")


def read_metadata(blob: bytes | bytearray | memoryview) -> dict[str, str]:
    """The string metadata of a safetensors blob (its JSON header's ``__metadata__``), checked against
    its own digest."""
    return _checked_metadata(_read_header(blob)[0])


def _checked_metadata(header: Mapping[str, object]) -> dict[str, str]:
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptUpdateError("weight update metadata is not a map of strings")
    metadata = dict(metadata)
    if metadata.get("format_version") != FORMAT_VERSION:
        raise CorruptUpdateError(f"unsupported format_version {metadata.get('format_version')!r}")
    if metadata.pop("metadata_digest", None) != _metadata_digest(metadata):
        raise CorruptUpdateError("weight update metadata digest mismatch")
    return metadata


def _json_field(metadata: Mapping[str, str], key: str) -> object:
    try:
        return json.loads(metadata[key])
    except Exception as exc:
        raise CorruptUpdateError(f"bad metadata field {key!r}: {exc}") from exc


_DELTA_ENTRY_FIELDS = {"dtype", "shape", "digest", "word", "chunks"}
_CHUNK_ENCODINGS = ("same", "xor-sparse", "xor-zstd", "zstd")


def _undo(
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
        held._consume()
        raise
    if any(isinstance(outcome, _Unrestorable) for outcome in outcomes):
        held._consume()


class _Unrestorable(CorruptUpdateError):
    """A chunk that failed part-way could not be put back (e.g. out of memory): its set is consumed."""


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """(first byte, bytes) of the memory ``t`` may read: its whole storage unless it is contiguous."""
    if t.is_contiguous():
        return t.untyped_storage().data_ptr() + int(t.storage_offset()) * t.element_size(), int(t.nbytes)
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


@dataclass(frozen=True)
class _Target:
    """Where one tensor of a delta is rebuilt, and from what."""

    name: str
    dtype: torch.dtype
    shape: list[int]
    out: np.ndarray  # the held tensor's bytes (rewritten in place), a copy of them, or fresh memory
    word: np.dtype
    spans: list[tuple[int, int]]  # of ``out``, one per chunk
    chunks: list[tuple[str, int, int, str]]  # (encoding, packed bytes, pairs, packed digest)
    packed: list[np.ndarray]  # each chunk's packed bytes


def _target(
    name: str, entry: dict[str, object], payload: torch.Tensor, old: torch.Tensor | None, in_place: bool
) -> _Target:
    """One tensor of a delta, parsed and bounded against what is held before anything is decompressed."""
    try:
        dtype = _DTYPES[str(entry["dtype"])]
        shape = [int(d) for d in entry["shape"]]  # type: ignore[attr-defined]
        nbytes = _nbytes(dtype, shape)
        word = _word(nbytes)
        if entry["word"] != word.itemsize:
            raise ValueError(f"word {entry['word']} is not the widest that tiles {nbytes} bytes")
        spans, listed = _spans(nbytes), entry["chunks"]
        if not isinstance(listed, list) or len(listed) != len(spans):
            raise ValueError(f"{nbytes} bytes are {len(spans)} chunks")
        chunks, packed, offset, whole = [], [], 0, raw_bytes(payload)
        for (begin, end), chunk in zip(spans, listed, strict=True):
            encoding, size, pairs, digest = chunk
            if encoding not in _CHUNK_ENCODINGS or type(size) is not int or type(pairs) is not int:
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
    return _Target(name, dtype, shape, out, word, spans, chunks, packed)


def _unpack_chunk(target: _Target, i: int) -> tuple[bytes, Callable[[], None] | None]:
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
    except _Unrestorable:
        raise
    except Exception as exc:
        raise CorruptUpdateError(f"cannot decode tensor {target.name!r}: {exc}") from exc
    return xxhash.xxh3_128_digest(out.data), undo


def _unshared(tensors: Mapping[str, torch.Tensor]) -> set[str]:
    """Names of the tensors whose bytes no other tensor of the set shares: only those are rewritten in
    place (writing one of two aliases would change a tensor the delta does not touch)."""
    spans = sorted((*_extent(t), name) for name, t in tensors.items() if t.nbytes)
    alone: set[str] = set()
    group: list[str] = []  # overlapping spans, in order of their start
    end = -1
    for begin, nbytes, name in spans:
        if begin >= end:  # a new group: the last one was a single tensor, or aliases
            if len(group) == 1:
                alone.add(group[0])
            group = []
        group.append(name)
        end = max(end, begin + nbytes)
    if len(group) == 1:
        alone.add(group[0])
    return alone


def _settled(
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

    pool, futures = _pool(), list[Future[R | BaseException | None]]()
    interrupted: BaseException | None = None
    try:
        for item in items:
            futures.append(pool.submit(attempt, item))
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
    gaps = _from_planes(stream[: 4 * changes], np.dtype("<u4"))
    xors = _from_planes(stream[4 * changes :], word)
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
    first_scratch = np.empty(min(_BLOCK, out.size), dtype=np.uint8)  # the undo allocates its own

    def xor(upto: int, done: list[int], whole: bool, scratch: np.ndarray | None = None) -> None:
        if scratch is None:
            scratch = np.empty(min(_BLOCK, out.size), dtype=np.uint8)
        with zstandard.ZstdDecompressor().stream_reader(packed.data) as reader:
            while done[0] < upto:
                got = reader.readinto(scratch[: min(_BLOCK, upto - done[0])].data)
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
            raise _Unrestorable(f"a chunk could not be put back ({exc!r}) after: {failure!r}") from exc
        raise
    return lambda: xor(out.size, [0], whole=False)


def _checked_set(
    weight_format: WeightFormat,
    tensors: Mapping[str, torch.Tensor],
    digests: Mapping[str, str],
    metadata: Mapping[str, str],
    owned: bool,
) -> WeightSet:
    weights = WeightSet.verified(weight_format, tensors, digests, owned)
    if weights.digest != metadata.get("set_digest"):
        raise CorruptUpdateError("weight set digest mismatch")
    return weights
