"""WeightSet — the rollout's view of the policy weights — and its safetensors wire codec.

A WeightSet maps HF parameter names (unfused q/k/v and gate/up; vLLM's loader fuses them) to tensors in
the rollout's format. For ``fp8-block128`` (and ``fp8-block128-pow2``) every linear weight inside the
transformer blocks ships as ``<module>.weight`` (float8_e4m3fn) plus ``<module>.weight_scale_inv``
(float32 block scales, powers of two under ``-pow2``, from :mod:`fp8rl.quant`); everything else, and
every tensor of ``bf16``, in the high-precision dtype (bf16 unless a float32 exactness run asks for
float32).

Two encodings, both laid out as one safetensors file with string metadata:

* keyframe (``kind: full``): the whole set, with a digest per tensor.
* delta (``kind: delta``): for each tensor whose bytes changed, the XOR of its raw bytes with the base
  version's, zstd-compressed, stored as a uint8 tensor, with the digests of the packed bytes and of the
  result; unchanged tensors are omitted. A delta names its base version and the base set's digest, so it
  is only ever applied to exactly the bytes it was computed against.

Decoding verifies every digest before it returns, and builds a new set without touching the held one:
an update is applied whole or not at all.

Speed (bench/weight_sync.py): every byte is hashed once, with XXH3-128 (integrity against corruption;
authenticity is the transport's job: TLS, or a MAC over the header); the set digest is built from the
per-tensor digests. An update is a list of segments (its header, then each tensor's bytes, viewed, not
copied) that the stream cuts into chunks; a received buffer is decoded in place. Deltas are computed and
applied in cache-sized blocks (XOR, count, compress, hash while the block is in cache), tensors in
parallel on a thread pool (numpy, zstd and xxhash release the GIL).
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, TypeVar, cast

import numpy as np
import torch
import xxhash
import zstandard

from fp8rl import quant
from fp8rl.errors import BaseMismatchError, CorruptUpdateError
from fp8rl.recipes import WEIGHT_FORMATS, WeightFormat, is_fp8, weight_scale_format

FORMAT_VERSION = "3"  # 3: XXH3-128 digests; the update digest covers the header (which seals the rest)
Encoding = Literal["keyframe", "delta"]
SCALE_SUFFIX = "weight_scale_inv"
_ZSTD_LEVEL = 1  # XOR streams are mostly zero bytes: level 1 already finds the runs, and is fast
_BLOCK = 1 << 20  # bytes per step of the fused delta loops: a block and its XOR stay in L2 cache
_DIGEST = "xxh3-128:"
T = TypeVar("T")
R = TypeVar("R")


def is_block_linear(name: str, ndim: int) -> bool:
    """True for linear weights inside transformer blocks — the ones FP8 recipes quantize.

    Norms are 1-D, biases end in ``.bias``, and embeddings / lm_head live outside ``.layers.``.
    """
    return ndim == 2 and name.endswith(".weight") and ".layers." in name


def scale_name(weight_name: str) -> str:
    return weight_name.removesuffix("weight") + SCALE_SUFFIX


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array (a view when ``t`` is contiguous on CPU)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def bytes_digest(data: bytes | bytearray | memoryview | np.ndarray) -> str:
    return _DIGEST + xxhash.xxh3_128_hexdigest(data.data if isinstance(data, np.ndarray) else data)


def tensor_digest(t: torch.Tensor) -> str:
    return bytes_digest(raw_bytes(t))


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
MAX_TENSOR_BYTES = 1 << 40  # no tensor is larger; a claim beyond it is corrupt


def parallel_map(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]`` on a process-wide pool of one thread per core (the work is numpy, zstd
    and xxhash calls, which release the GIL)."""
    global _POOL
    if len(items) < 2:
        return [fn(x) for x in items]
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="codec")
    return list(_POOL.map(fn, items))


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
    """Named tensors in one rollout weight format. Treated as immutable: updates build a new set."""

    format: WeightFormat
    tensors: Mapping[str, torch.Tensor]

    @functools.cached_property
    def tensor_digests(self) -> dict[str, str]:
        names = sorted(self.tensors, key=lambda n: -self.tensors[n].numel())  # big first: balanced threads
        return dict(zip(names, parallel_map(lambda n: tensor_digest(self.tensors[n]), names), strict=True))

    @functools.cached_property
    def digest(self) -> str:
        """Digest over names, dtypes, shapes and tensor digests, independent of order (no tensor byte is
        read again)."""
        h = xxhash.xxh3_128()
        for name in sorted(self.tensors):
            t = self.tensors[name]
            h.update(f"{name}|{_DTYPE_NAMES[t.dtype]}|{list(t.shape)}|{self.tensor_digests[name]}\n".encode())
        return _DIGEST + h.hexdigest()

    @classmethod
    def verified(
        cls, weight_format: WeightFormat, tensors: Mapping[str, torch.Tensor], digests: Mapping[str, str]
    ) -> WeightSet:
        """A set whose tensor digests were just checked (or computed): keep them rather than hash again."""
        weights = cls(weight_format, tensors)
        weights.__dict__["tensor_digests"] = dict(digests)
        return weights

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def build_weight_set(
    state_dict: Mapping[str, torch.Tensor],
    weight_format: WeightFormat,
    hp_dtype: torch.dtype = torch.bfloat16,
) -> WeightSet:
    """Convert a model state dict (HF names) to the rollout's format.

    ``hp_dtype`` is the dtype of every tensor that is not FP8 (bf16 normally; float32 for exactness
    checks). FP8 codes and scales are exactly :func:`fp8rl.quant.quantize_blockwise` of the weight, in
    the format's scale format.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r}; expected one of {WEIGHT_FORMATS}")
    scale_format = weight_scale_format(weight_format)
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        t = t.detach().cpu()
        if is_fp8(weight_format) and is_block_linear(name, t.ndim):
            out[name], out[scale_name(name)] = quant.quantize_blockwise(t, scale_format=scale_format)
        else:
            # Always a copy: a set must never alias live parameters the optimizer keeps changing.
            out[name] = t.to(hp_dtype, copy=True).contiguous()
    return WeightSet(weight_format, out)


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
    """One encoded update as segments to stream (header, then tensor bytes, not concatenated), and what
    the header and reports need."""

    segments: tuple[memoryview, ...]
    encoding: Encoding
    version: int
    base_version: int  # -1 for a keyframe
    format: WeightFormat
    recipe: str
    tensors_changed: int
    density: float  # fraction of the set's tensor bytes that changed (1.0 for a keyframe)

    @functools.cached_property
    def digest(self) -> str:
        """Digest of the header segment, which seals the rest: it holds every tensor's digest and, through
        the set digest, every name, dtype and shape."""
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


def _view(t: torch.Tensor) -> memoryview:
    return raw_bytes(t).data


def sealed(metadata: dict[str, str]) -> dict[str, str]:
    """``metadata`` plus a digest of it: the tensor digests cover the data, this covers the rest (a
    flipped digit in ``version`` would otherwise be read as another version)."""
    return metadata | {"metadata_digest": _metadata_digest(metadata)}


def _metadata_digest(metadata: Mapping[str, str]) -> str:
    return bytes_digest(json.dumps(dict(metadata), sort_keys=True).encode())


def encode_keyframe(weights: WeightSet, version: int, recipe: str = "") -> EncodedUpdate:
    metadata = {
        "format_version": FORMAT_VERSION,
        "kind": "full",
        "version": str(version),
        "recipe": recipe,
        "format": weights.format,
        "digests": json.dumps(weights.tensor_digests, sort_keys=True),
        "set_digest": weights.digest,
    }
    tensors = {n: t.contiguous() for n, t in weights.tensors.items()}
    layout = {n: (t.dtype, t.shape, t.numel() * t.element_size()) for n, t in tensors.items()}
    segments = (memoryview(_layout(layout, sealed(metadata))), *(_view(t) for t in tensors.values()))
    return EncodedUpdate(
        segments, "keyframe", version, -1, weights.format, recipe, tensors_changed=len(tensors), density=1.0
    )


@dataclass(frozen=True)
class _PackedTensor:
    name: str
    digest: str  # of the new tensor's bytes
    packed: bytes | None  # None: unchanged
    entry: dict[str, object]
    changed_bytes: int
    nbytes: int


def _word(nbytes: int) -> np.dtype:
    """The widest little-endian unsigned word that tiles ``nbytes``: sparse deltas index words."""
    return np.dtype(next(f"<u{w}" for w in (8, 4, 2, 1) if nbytes % w == 0))


def _pack(name: str, t: torch.Tensor, old: torch.Tensor | None) -> _PackedTensor:
    """Hash the new bytes and find the words that differ from the base's, one cache-sized block at a time;
    ship them as (index, XOR) pairs. Dense changes (or no base) ship as a zstd stream of the XOR (or of the
    bytes) instead."""
    new = raw_bytes(t)
    if old is None or old.dtype != t.dtype or old.shape != t.shape:
        return _pack_dense(name, t, new, None)
    word = _word(new.size)
    new_words, base_words = new.view(word), raw_bytes(old).view(word)
    step = _BLOCK // word.itemsize
    scratch = np.empty(min(step, new_words.size), dtype=word)
    h = xxhash.xxh3_128()
    where, what = [], []
    for begin in range(0, new_words.size, step):
        block = new_words[begin : begin + step]
        h.update(block.data)
        xor = scratch[: block.size]
        np.bitwise_xor(block, base_words[begin : begin + step], out=xor)
        at = np.flatnonzero(xor != 0)
        if at.size:
            where.append(at + begin)
            what.append(xor[at])
    digest = _DIGEST + h.hexdigest()
    changes = sum(a.size for a in where)
    if changes == 0:
        return _PackedTensor(name, digest, None, {}, 0, new.size)
    if changes * (4 + word.itemsize) > new.size // 4:  # dense: a stream of the XOR is smaller
        return _pack_dense(name, t, new, raw_bytes(old))
    index = np.concatenate(where)
    gaps = np.diff(index, prepend=0).astype("<u4")  # word indices < 2**32: tensors below 32 GiB
    packed = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(
        gaps.tobytes() + np.concatenate(what).tobytes()
    )
    entry = _entry("xor-sparse", t, digest, packed, word.itemsize, changes)
    changed_bytes = int(np.count_nonzero(np.concatenate(what).view(np.uint8)))
    return _PackedTensor(name, digest, packed, entry, changed_bytes, new.size)


def _pack_dense(name: str, t: torch.Tensor, new: np.ndarray, base: np.ndarray | None) -> _PackedTensor:
    compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compressobj(size=new.size)
    h = xxhash.xxh3_128()
    scratch = np.empty(min(_BLOCK, new.size), dtype=np.uint8)
    pieces, changed = [], new.size
    if base is not None:
        changed = 0
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
    digest, packed = _DIGEST + h.hexdigest(), b"".join(pieces)
    entry = _entry("zstd" if base is None else "xor-zstd", t, digest, packed, 1, changed)
    return _PackedTensor(name, digest, packed, entry, changed, new.size)


def _entry(
    encoding: str, t: torch.Tensor, digest: str, packed: bytes, word: int, changes: int
) -> dict[str, object]:
    return {
        "encoding": encoding,
        "dtype": _DTYPE_NAMES[t.dtype],
        "shape": list(t.shape),
        "digest": digest,
        # Some flipped bits in a zstd stream decode to the same bytes: checking the packed bytes too
        # means no altered update is ever applied, even one that would come out right.
        "packed_digest": bytes_digest(packed),
        "word": word,  # bytes per index of xor-sparse
        "changes": changes,  # xor-sparse: (index, XOR) pairs; otherwise bytes that changed
    }


def encode_delta(
    new: WeightSet, base: WeightSet, version: int, base_version: int, recipe: str = ""
) -> EncodedUpdate:
    """Encode ``new`` as changes against ``base`` (which the receiver holds as ``base_version``). The new
    set's tensor digests are computed on the way (and kept on ``new``, the next delta's base)."""
    if new.format != base.format:
        raise ValueError(f"cannot delta-encode format {new.format!r} against {base.format!r}")
    names = sorted(new.tensors, key=lambda n: -new.tensors[n].numel())  # big first: balanced threads
    results = parallel_map(lambda n: _pack(n, new.tensors[n], base.tensors.get(n)), names)
    if "tensor_digests" not in new.__dict__:
        new.__dict__["tensor_digests"] = {r.name: r.digest for r in results}
    changed = [r for r in sorted(results, key=lambda r: r.name) if r.packed is not None]
    removed = sorted(set(base.tensors) - set(new.tensors))
    metadata = {
        "format_version": FORMAT_VERSION,
        "kind": "delta",
        "version": str(version),
        "base_version": str(base_version),
        "base_digest": base.digest,
        "recipe": recipe,
        "format": new.format,
        "tensors": json.dumps({r.name: r.entry for r in changed}, sort_keys=True),
        "removed": json.dumps(removed),
        "set_digest": new.digest,
    }
    layout = {r.name: (torch.uint8, [len(r.packed)], len(r.packed)) for r in changed if r.packed is not None}
    segments = (
        memoryview(_layout(layout, sealed(metadata))),
        *(memoryview(r.packed) for r in changed if r.packed),
    )
    total = sum(r.nbytes for r in results)
    return EncodedUpdate(
        segments,
        "delta",
        version,
        base_version,
        new.format,
        recipe,
        tensors_changed=len(changed) + len(removed),
        density=sum(r.changed_bytes for r in results) / total if total else 0.0,
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
) -> DecodedUpdate:
    """Verify and apply an encoded update, returning the new set; ``held`` is never modified. A writable
    ``blob`` (a received buffer) is decoded in place: a keyframe's tensors are views of it. ``admit(name,
    dtype, shape)`` sees every tensor the update brings before any of it is allocated or decompressed, and
    raises to refuse it (the receiver's model decides what it can take).

    Raises :class:`BaseMismatchError` for a delta whose base is not (``held_version``, ``held``), and
    :class:`CorruptUpdateError` when any size, parse or digest check fails.
    """
    header, start = _read_header(blob)
    metadata = _checked_metadata(header)
    tensors = _tensors_of(blob, header, start)
    try:
        version = int(metadata["version"])
        kind = metadata["kind"]
        weight_format = cast(WeightFormat, metadata["format"])
    except Exception as exc:  # any parse failure means the bytes are not what was sent
        raise CorruptUpdateError(f"cannot parse weight update: {exc}") from exc
    if weight_format not in WEIGHT_FORMATS:
        raise CorruptUpdateError(f"unknown weight format {weight_format!r}")
    if kind == "full":
        for name, t in tensors.items():
            if admit is not None:
                admit(name, t.dtype, tuple(t.shape))
        new = _decode_full(tensors, metadata, weight_format)
        return DecodedUpdate(new, version, "keyframe", len(new.tensors))
    if kind == "delta":
        new, updated = _decode_delta(tensors, metadata, held, held_version, weight_format, admit)
        return DecodedUpdate(new, version, "delta", updated)
    raise CorruptUpdateError(f"unknown update kind {kind!r}")


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


def _decode_full(
    tensors: dict[str, torch.Tensor], metadata: Mapping[str, str], weight_format: WeightFormat
) -> WeightSet:
    digests = _json_field(metadata, "digests")
    if not isinstance(digests, dict) or set(digests) != set(tensors):
        raise CorruptUpdateError("keyframe tensor names do not match its digests")
    names = sorted(tensors, key=lambda n: -tensors[n].numel())
    for name, digest in zip(names, parallel_map(lambda n: tensor_digest(tensors[n]), names), strict=True):
        if digest != digests[name]:
            raise CorruptUpdateError(f"digest mismatch for tensor {name!r}")
    return _checked_set(weight_format, tensors, digests, metadata)


_DELTA_ENTRY_FIELDS = {"encoding", "dtype", "shape", "digest", "packed_digest", "word", "changes"}


def _decode_delta(
    payload: dict[str, torch.Tensor],
    metadata: Mapping[str, str],
    held: WeightSet | None,
    held_version: int | None,
    weight_format: WeightFormat,
    admit: Admit | None = None,
) -> tuple[WeightSet, int]:
    try:
        base_version = int(metadata["base_version"])
    except (KeyError, ValueError) as exc:
        raise CorruptUpdateError(f"bad delta base_version: {exc}") from exc
    if held is None or held_version != base_version:
        raise BaseMismatchError(
            f"delta applies to version {base_version}, receiver holds "
            f"{'nothing' if held is None else held_version}"
        )
    if held.digest != metadata.get("base_digest") or held.format != weight_format:
        raise BaseMismatchError(f"delta base digest does not match the held version {held_version}")
    entries = _json_field(metadata, "tensors")
    removed = _json_field(metadata, "removed")
    if not isinstance(entries, dict) or set(entries) != set(payload) or not isinstance(removed, list):
        raise CorruptUpdateError("delta tensor list does not match its payload")
    for name, entry in entries.items():
        if not isinstance(entry, dict) or set(entry) != _DELTA_ENTRY_FIELDS:
            raise CorruptUpdateError(f"delta entry for tensor {name!r} is malformed")
        if admit is not None:
            try:
                dtype, shape = _DTYPES[str(entry["dtype"])], tuple(int(d) for d in entry["shape"])
            except Exception as exc:
                raise CorruptUpdateError(f"bad entry for tensor {name!r}: {exc}") from exc
            admit(name, dtype, shape)
    new = {name: t for name, t in held.tensors.items() if name not in removed}
    digests = {name: d for name, d in held.tensor_digests.items() if name not in removed}
    names = sorted(entries, key=lambda n: -payload[n].numel())
    decoded = parallel_map(lambda n: _unpack(n, entries[n], payload[n], held.tensors.get(n)), names)
    for name, tensor in zip(names, decoded, strict=True):
        new[name] = tensor
        digests[name] = str(entries[name]["digest"])
    return _checked_set(held.format, new, digests, metadata), len(entries) + len(removed)


def _unpack(
    name: str, entry: dict[str, object], packed: torch.Tensor, old: torch.Tensor | None
) -> torch.Tensor:
    """Check the packed bytes, then rebuild the tensor into a fresh buffer one cache-sized block at a time
    (copy the base and apply the XORs of its words, or decompress and XOR), hashing each block while it is
    in cache. Nothing decompresses to more than the sizes the entry allows, whatever the stream claims."""
    packed_bytes = raw_bytes(packed)
    if bytes_digest(packed_bytes) != entry["packed_digest"]:
        raise CorruptUpdateError(f"digest mismatch for the packed bytes of tensor {name!r}")
    try:
        dtype = _DTYPES[str(entry["dtype"])]
        shape = [int(d) for d in entry["shape"]]  # type: ignore[attr-defined]
        nbytes = _nbytes(dtype, shape)
        word, changes = int(entry["word"]), int(entry["changes"])  # type: ignore[call-overload]
        if word not in (1, 2, 4, 8) or nbytes % word or not 0 <= changes <= nbytes // word:
            raise ValueError(f"shape {shape}, word {word}, changes {changes}")
    except Exception as exc:
        raise CorruptUpdateError(f"bad entry for tensor {name!r}: {exc}") from exc
    encoding = entry["encoding"]
    if encoding not in ("xor-sparse", "xor-zstd", "zstd"):
        raise CorruptUpdateError(f"unknown tensor encoding {encoding!r} for {name!r}")
    base = None
    if encoding != "zstd":
        if old is None or old.dtype != dtype or list(old.shape) != shape:
            raise BaseMismatchError(f"delta XORs tensor {name!r} against a base it does not match")
        base = raw_bytes(old)
    out = np.empty(nbytes, dtype=np.uint8)  # numpy asks for huge pages: fewer faults on fresh memory
    try:
        if encoding == "xor-sparse":
            assert base is not None
            digest = _apply_words(out, base, packed_bytes, np.dtype(f"<u{word}"), changes)
        else:
            digest = _apply_stream(out, base, packed_bytes)
    except CorruptUpdateError:
        raise
    except Exception as exc:
        raise CorruptUpdateError(f"cannot decode tensor {name!r}: {exc}") from exc
    if digest != entry["digest"]:
        raise CorruptUpdateError(f"digest mismatch for tensor {name!r}")
    return torch.from_numpy(out).view(dtype).reshape(shape)


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


def _apply_words(out: np.ndarray, base: np.ndarray, packed: np.ndarray, word: np.dtype, changes: int) -> str:
    pairs = np.empty(changes * (4 + word.itemsize), dtype=np.uint8)
    _decompress_exactly(packed, pairs)
    index = np.cumsum(pairs[: 4 * changes].view("<u4"), dtype=np.int64)
    xors = pairs[4 * changes :].view(word)
    out_words, base_words = out.view(word), base.view(word)
    if changes and (index[-1] >= out_words.size or (changes > 1 and np.diff(index).min() < 1)):
        raise ValueError("word indices out of order or out of range")
    step = _BLOCK // word.itemsize
    h = xxhash.xxh3_128()
    for begin in range(0, out_words.size, step):
        block = out_words[begin : begin + step]
        np.copyto(block, base_words[begin : begin + step])
        lo, hi = np.searchsorted(index, [begin, begin + block.size])
        at = index[lo:hi] - begin
        block[at] ^= xors[lo:hi]
        h.update(block.data)
    return _DIGEST + h.hexdigest()


def _apply_stream(out: np.ndarray, base: np.ndarray | None, packed: np.ndarray) -> str:
    _decompress_exactly(packed, out)
    h = xxhash.xxh3_128()
    for begin in range(0, out.size, _BLOCK):
        block = out[begin : begin + _BLOCK]
        if base is not None:
            np.bitwise_xor(block, base[begin : begin + _BLOCK], out=block)
        h.update(block.data)
    return _DIGEST + h.hexdigest()


def _checked_set(
    weight_format: WeightFormat,
    tensors: Mapping[str, torch.Tensor],
    digests: Mapping[str, str],
    metadata: Mapping[str, str],
) -> WeightSet:
    weights = WeightSet.verified(weight_format, tensors, digests)
    if weights.digest != metadata.get("set_digest"):
        raise CorruptUpdateError("weight set digest mismatch")
    return weights
