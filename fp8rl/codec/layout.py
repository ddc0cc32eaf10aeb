"""How the bytes of one part of an update are laid out: a safetensors file, its sealed string metadata,
and the byte planes of a sparse chunk.

The safetensors layout: an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}, __metadata__}, padded with spaces to a multiple of 8, then the tensors' bytes back to back.
Written and read here so that an update is never concatenated into one buffer on the way out nor copied
out of one on the way in; safetensors itself reads what this writes.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import torch

from fp8rl.codec.weight_set import DTYPE_NAMES, DTYPES, bytes_digest
from fp8rl.errors import CorruptUpdateError

FORMAT_VERSION = "5"  # 4: 16 MiB chunks, sparse streams in byte planes; 5: updates in parts
Encoding = Literal["keyframe", "delta"]
MAX_PARTS = 1 << 20  # parts in one update: 64 TiB of tensors at the default part size
MAX_TENSOR_BYTES = 1 << 40  # no tensor is larger; a claim beyond it is corrupt


def header_segment(
    tensors: Mapping[str, tuple[torch.dtype, Sequence[int], int]], metadata: Mapping[str, str]
) -> bytes:
    """The header segment for tensors given as name -> (dtype, shape, nbytes), in that order."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def read_header(blob: bytes | bytearray | memoryview) -> tuple[dict[str, object], int]:
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


def tensor_nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Bytes of a tensor, for shapes read from an update (bounded: no overflow, no absurd claim, and no
    dimension beyond what any tensor has, which an empty tensor's product of dimensions would hide)."""
    if any(not 0 <= d <= MAX_TENSOR_BYTES for d in shape):
        raise ValueError(f"a dimension outside [0, {MAX_TENSOR_BYTES}] in shape {list(shape)}")
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes > MAX_TENSOR_BYTES:
        raise ValueError(f"shape {list(shape)} claims {nbytes} bytes")
    return nbytes


def tensors_of(
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
            dtype, shape = DTYPES[spec["dtype"]], [int(d) for d in spec["shape"]]
            begin, end = (int(x) for x in spec["data_offsets"])
            nbytes = tensor_nbytes(dtype, shape)
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


# -- the metadata -----------------------------------------------------------------------------------------


def sealed(metadata: dict[str, str]) -> dict[str, str]:
    """``metadata`` plus a digest of it: the tensor digests cover the data, this covers the rest (a
    flipped digit in ``version`` would otherwise be read as another version)."""
    return metadata | {"metadata_digest": _metadata_digest(metadata)}


def _metadata_digest(metadata: Mapping[str, str]) -> str:
    return bytes_digest(json.dumps(dict(metadata), sort_keys=True).encode())


def checked_metadata(header: Mapping[str, object]) -> dict[str, str]:
    """A header's string metadata, checked against its format version and its own digest (dropped)."""
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptUpdateError("weight update metadata is not a map of strings")
    metadata = dict(metadata)
    if metadata.get("format_version") != FORMAT_VERSION:
        raise CorruptUpdateError(f"unsupported format_version {metadata.get('format_version')!r}")
    if metadata.pop("metadata_digest", None) != _metadata_digest(metadata):
        raise CorruptUpdateError("weight update metadata digest mismatch")
    return metadata


def json_field(metadata: Mapping[str, str], key: str) -> object:
    """A metadata field that holds JSON, parsed (a parse failure means the bytes are corrupt)."""
    try:
        return json.loads(metadata[key])
    except Exception as exc:
        raise CorruptUpdateError(f"bad metadata field {key!r}: {exc}") from exc


# -- a sparse chunk's words -------------------------------------------------------------------------------


def word_of(nbytes: int) -> np.dtype:
    """The widest little-endian unsigned word that tiles ``nbytes``: sparse deltas index words."""
    return np.dtype(next(f"<u{w}" for w in (8, 4, 2, 1) if nbytes % w == 0))


def planes(a: np.ndarray) -> np.ndarray:
    """``a``'s bytes regrouped by significance (every element's first byte, then every second byte...):
    the high bytes of small gaps and of XORs are runs of zeros that zstd then finds at once."""
    return a.view(np.uint8).reshape(-1, a.itemsize).T.ravel()


def from_planes(data: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The inverse of :func:`planes`: elements of ``dtype`` from their bytes grouped by significance."""
    return data.reshape(dtype.itemsize, -1).T.copy().view(dtype).ravel()
