"""WeightSet — the rollout's view of the policy weights — and its safetensors wire codec.

A WeightSet maps HF parameter names (unfused q/k/v and gate/up; vLLM's loader fuses them) to tensors in
the rollout's format. For ``fp8-block128`` every linear weight inside the transformer blocks ships as
``<module>.weight`` (float8_e4m3fn) plus ``<module>.weight_scale_inv`` (float32 block scales, from
:mod:`fp8rl.quant`); everything else, and every tensor of ``bf16``, in the high-precision dtype (bf16
unless a float32 exactness run asks for float32).

Two encodings, both one safetensors blob with string metadata:

* keyframe (``kind: full``): the whole set, with a digest per tensor.
* delta (``kind: delta``): for each tensor whose bytes changed, the XOR of its raw bytes with the base
  version's, zstd-compressed, stored as a uint8 tensor, with the digests of the packed bytes and of the
  result; unchanged tensors are omitted. A delta names its base version and the base set's digest, so it
  is only ever applied to exactly the bytes it was computed against.

Decoding verifies every digest before it returns, and builds a new set without touching the held one:
an update is applied whole or not at all.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, cast

import numpy as np
import safetensors.torch
import torch
import zstandard

from fp8rl import quant
from fp8rl.errors import BaseMismatchError, CorruptUpdateError
from fp8rl.recipes import WEIGHT_FORMATS, WeightFormat

FORMAT_VERSION = "2"  # 2: metadata digest and per-tensor packed digests
Encoding = Literal["keyframe", "delta"]
SCALE_SUFFIX = "weight_scale_inv"
_ZSTD_LEVEL = 1  # XOR streams are mostly zero bytes: level 1 already finds the runs, and is fast


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


def bytes_digest(data: bytes | np.ndarray) -> str:
    return "sha256:" + hashlib.sha256(data.data if isinstance(data, np.ndarray) else data).hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    return bytes_digest(raw_bytes(t))


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
        return {name: tensor_digest(t) for name, t in self.tensors.items()}

    @functools.cached_property
    def digest(self) -> str:
        """Digest over names, dtypes, shapes and bytes of every tensor, independent of order."""
        h = hashlib.sha256()
        for name in sorted(self.tensors):
            t = self.tensors[name]
            h.update(f"{name}|{_DTYPE_NAMES[t.dtype]}|{list(t.shape)}|{self.tensor_digests[name]}\n".encode())
        return "sha256:" + h.hexdigest()

    @classmethod
    def verified(
        cls, weight_format: WeightFormat, tensors: Mapping[str, torch.Tensor], digests: Mapping[str, str]
    ) -> WeightSet:
        """A set whose tensor digests were just checked: keep them rather than hash again."""
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
    checks). FP8 codes and scales are exactly :func:`fp8rl.quant.quantize_blockwise` of the weight.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r}; expected one of {WEIGHT_FORMATS}")
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        t = t.detach().cpu()
        if weight_format == "fp8-block128" and is_block_linear(name, t.ndim):
            out[name], out[scale_name(name)] = quant.quantize_blockwise(t)
        else:
            # Always a copy: a set must never alias live parameters the optimizer keeps changing.
            out[name] = t.to(hp_dtype, copy=True).contiguous()
    return WeightSet(weight_format, out)


@dataclass(frozen=True)
class EncodedUpdate:
    """One encoded update: the blob to stream and what the header and reports need."""

    blob: bytes
    encoding: Encoding
    version: int
    base_version: int  # -1 for a keyframe
    format: WeightFormat
    recipe: str
    tensors_changed: int
    density: float  # fraction of the set's tensor bytes that changed (1.0 for a keyframe)
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", bytes_digest(self.blob))

    @property
    def wire_bytes(self) -> int:
        return len(self.blob)


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
    blob = safetensors.torch.save(dict(weights.tensors), metadata=sealed(metadata))
    return EncodedUpdate(
        blob,
        "keyframe",
        version,
        -1,
        weights.format,
        recipe,
        tensors_changed=len(weights.tensors),
        density=1.0,
    )


def encode_delta(
    new: WeightSet, base: WeightSet, version: int, base_version: int, recipe: str = ""
) -> EncodedUpdate:
    """Encode ``new`` as changes against ``base`` (which the receiver holds as ``base_version``)."""
    if new.format != base.format:
        raise ValueError(f"cannot delta-encode format {new.format!r} against {base.format!r}")
    compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
    entries: dict[str, dict[str, object]] = {}
    payload: dict[str, torch.Tensor] = {}
    changed = total = 0
    for name, t in new.tensors.items():
        data = raw_bytes(t)
        total += data.size
        old = base.tensors.get(name)
        if old is not None and old.dtype == t.dtype and old.shape == t.shape:
            data = np.bitwise_xor(data, raw_bytes(old))
            nonzero = int(np.count_nonzero(data))
            if nonzero == 0:
                continue
            changed += nonzero
            encoding = "xor-zstd"
        else:
            changed += data.size
            encoding = "zstd"
        packed = compressor.compress(data.data)
        payload[name] = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
        entries[name] = {
            "encoding": encoding,
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "digest": new.tensor_digests[name],
            # Some flipped bits in a zstd stream decode to the same bytes: checking the packed bytes too
            # means no altered update is ever applied, even one that would come out right.
            "packed_digest": bytes_digest(packed),
        }
    removed = sorted(set(base.tensors) - set(new.tensors))
    metadata = {
        "format_version": FORMAT_VERSION,
        "kind": "delta",
        "version": str(version),
        "base_version": str(base_version),
        "base_digest": base.digest,
        "recipe": recipe,
        "format": new.format,
        "tensors": json.dumps(entries, sort_keys=True),
        "removed": json.dumps(removed),
        "set_digest": new.digest,
    }
    blob = safetensors.torch.save(payload, metadata=sealed(metadata))
    return EncodedUpdate(
        blob,
        "delta",
        version,
        base_version,
        new.format,
        recipe,
        tensors_changed=len(entries) + len(removed),
        density=changed / total if total else 0.0,
    )


@dataclass(frozen=True)
class DecodedUpdate:
    weights: WeightSet
    version: int
    encoding: Encoding
    tensors_updated: int


def decode_update(
    blob: bytes, held: WeightSet | None = None, held_version: int | None = None
) -> DecodedUpdate:
    """Verify and apply an encoded update, returning the new set; ``held`` is never modified.

    Raises :class:`BaseMismatchError` for a delta whose base is not (``held_version``, ``held``), and
    :class:`CorruptUpdateError` when any size, parse or digest check fails.
    """
    metadata = read_metadata(blob)
    try:
        tensors = safetensors.torch.load(blob)
        version = int(metadata["version"])
        kind = metadata["kind"]
        weight_format = cast(WeightFormat, metadata["format"])
    except Exception as exc:  # any parse failure means the bytes are not what was sent
        raise CorruptUpdateError(f"cannot parse weight update: {exc}") from exc
    if weight_format not in WEIGHT_FORMATS:
        raise CorruptUpdateError(f"unknown weight format {weight_format!r}")
    if kind == "full":
        new = _decode_full(tensors, metadata, weight_format)
        return DecodedUpdate(new, version, "keyframe", len(new.tensors))
    if kind == "delta":
        new, updated = _decode_delta(tensors, metadata, held, held_version, weight_format)
        return DecodedUpdate(new, version, "delta", updated)
    raise CorruptUpdateError(f"unknown update kind {kind!r}")


def read_metadata(blob: bytes) -> dict[str, str]:
    """The string metadata of a safetensors blob (its JSON header's ``__metadata__``)."""
    try:
        (header_len,) = struct.unpack("<Q", blob[:8])
        if header_len > len(blob) - 8:
            raise ValueError(f"header of {header_len} bytes in a blob of {len(blob)}")
        header = json.loads(bytes(blob[8 : 8 + header_len]))
        metadata = header["__metadata__"]
    except Exception as exc:
        raise CorruptUpdateError(f"cannot read weight update header: {exc}") from exc
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
    for name, t in tensors.items():
        if tensor_digest(t) != digests[name]:
            raise CorruptUpdateError(f"digest mismatch for tensor {name!r}")
    return _checked_set(weight_format, tensors, digests, metadata)


_DELTA_ENTRY_FIELDS = {"encoding", "dtype", "shape", "digest", "packed_digest"}


def _decode_delta(
    payload: dict[str, torch.Tensor],
    metadata: Mapping[str, str],
    held: WeightSet | None,
    held_version: int | None,
    weight_format: WeightFormat,
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
    decompressor = zstandard.ZstdDecompressor()
    new = {name: t for name, t in held.tensors.items() if name not in removed}
    digests = {name: d for name, d in held.tensor_digests.items() if name not in removed}
    for name, entry in entries.items():
        new[name] = _decode_tensor(name, entry, payload[name], held.tensors.get(name), decompressor)
        digests[name] = str(entry["digest"])
    return _checked_set(held.format, new, digests, metadata), len(entries) + len(removed)


def _decode_tensor(
    name: str,
    entry: dict[str, object],
    packed: torch.Tensor,
    old: torch.Tensor | None,
    decompressor: zstandard.ZstdDecompressor,
) -> torch.Tensor:
    if bytes_digest(raw_bytes(packed)) != entry["packed_digest"]:
        raise CorruptUpdateError(f"digest mismatch for the packed bytes of tensor {name!r}")
    try:
        dtype = _DTYPES[str(entry["dtype"])]
        shape = [int(d) for d in entry["shape"]]  # type: ignore[attr-defined]
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
        data = np.frombuffer(
            decompressor.decompress(raw_bytes(packed).data, max_output_size=nbytes), dtype=np.uint8
        )
    except Exception as exc:
        raise CorruptUpdateError(f"cannot decode tensor {name!r}: {exc}") from exc
    if data.size != nbytes:
        raise CorruptUpdateError(f"tensor {name!r} decodes to {data.size} bytes, expected {nbytes}")
    if entry["encoding"] == "xor-zstd":
        if old is None or old.dtype != dtype or list(old.shape) != shape:
            raise BaseMismatchError(f"delta XORs tensor {name!r} against a base it does not match")
        data = np.bitwise_xor(data, raw_bytes(old))
    elif entry["encoding"] != "zstd":
        raise CorruptUpdateError(f"unknown tensor encoding {entry['encoding']!r} for {name!r}")
    if bytes_digest(data) != entry["digest"]:
        raise CorruptUpdateError(f"digest mismatch for tensor {name!r}")
    return torch.from_numpy(data.copy()).view(dtype).reshape(shape)


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
