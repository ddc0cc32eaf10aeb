"""WeightSet — named tensors in one rollout weight format — and their digests, hashed in chunks on a
process-wide thread pool (the pool the rest of the codec runs its chunks on too).

Every byte is hashed with XXH3-128 (integrity against corruption; authenticity is the transport's job:
TLS, and the trainer's Ed25519 signature over every update): a tensor's digest is built from its
chunks' digests, so that a big tensor is hashed on every core at once, and the set digest from the tensors'.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch
import xxhash

from fp8rl.recipes import WeightFormat

BLOCK_BYTES = 1 << 20  # bytes per step of the delta loops: a block is compared, gathered, hashed in cache
CHUNK_BYTES = 16 * BLOCK_BYTES  # bytes per task on the thread pool: a big tensor keeps every core busy
DIGEST_PREFIX = "xxh3-128:"
DTYPE_NAMES = {  # the dtypes a set may hold, by their safetensors names (which the set digest covers)
    torch.float8_e4m3fn: "F8_E4M3",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.uint8: "U8",
    torch.int64: "I64",
    torch.int32: "I32",
}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
T = TypeVar("T")
R = TypeVar("R")


class WeightSet:
    """Named tensors in one rollout weight format.

    ``owned``: the tensors' memory is the codec's own (copies it made, or a received buffer handed to
    it), so a delta decoded against this set may rewrite it in place; the set is then consumed (its
    digests refuse to be read, since its memory now holds another version), and the decoded set, which
    shares that memory, takes its place. A set over the caller's own tensors is never written to.

    The digests are computed once, when first read (or handed over by the codec, which has just hashed
    the bytes), and kept; a set is never changed, so they stay true until it is consumed."""

    __slots__ = ("_consumed", "_digest", "_format", "_lock", "_owned", "_tensor_digests", "_tensors")

    def __init__(
        self, format: WeightFormat, tensors: Mapping[str, torch.Tensor], owned: bool = False
    ) -> None:
        self._format, self._tensors, self._owned = format, tensors, owned
        self._tensor_digests: dict[str, str] | None = None  # every tensor's, once known
        self._digest: str | None = None  # the set's, once computed
        self._consumed = False  # a delta rewrote this set's memory in place: it holds another version
        self._lock = threading.RLock()  # (encoders on several threads may ask for the digests at once)

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
        weights._tensor_digests = dict(digests)
        return weights

    @property
    def format(self) -> WeightFormat:
        return self._format

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._tensors

    @property
    def owned(self) -> bool:
        return self._owned

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    @property
    def tensor_digests(self) -> dict[str, str]:
        """Every tensor's digest (``xxh3-128:`` and 32 hex digits), hashed on the first read."""
        with self._lock:
            self.check_not_consumed()
            if self._tensor_digests is None:
                self._tensor_digests = digest_tensors(self._tensors)
            return self._tensor_digests

    @property
    def known_tensor_digests(self) -> dict[str, str] | None:
        """The tensor digests if they are known already (nothing is hashed), else None."""
        with self._lock:
            return self._tensor_digests

    def keep_tensor_digests(self, digests: Mapping[str, str]) -> None:
        """Keep ``digests`` (every tensor's, just computed from its bytes) unless the set has them already,
        so that nothing is hashed twice."""
        with self._lock:
            if self._tensor_digests is None:
                self._tensor_digests = dict(digests)

    @property
    def digest(self) -> str:
        """Digest over names, dtypes, shapes and tensor digests, independent of order (no tensor byte is
        read again)."""
        with self._lock:
            self.check_not_consumed()
            if self._digest is None:
                h = xxhash.xxh3_128()
                digests = self.tensor_digests
                for name in sorted(self._tensors):
                    t = self._tensors[name]
                    h.update(f"{name}|{DTYPE_NAMES[t.dtype]}|{list(t.shape)}|{digests[name]}\n".encode())
                self._digest = DIGEST_PREFIX + h.hexdigest()
            return self._digest

    @property
    def consumed(self) -> bool:
        return self._consumed

    def consume(self) -> None:
        """Mark the set consumed (its memory now holds, or may hold, another version): its digests are
        forgotten and refuse to be read, so that it cannot pass for its old version."""
        with self._lock:
            self._tensor_digests = self._digest = None
            self._consumed = True

    def check_not_consumed(self) -> None:
        if self._consumed:
            raise ValueError("this weight set was consumed by a delta applied in place: use the decoded set")

    def __repr__(self) -> str:
        return f"WeightSet({self._format!r}, {len(self._tensors)} tensors, owned={self._owned})"


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array (a view when ``t`` is contiguous on CPU)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def bytes_digest(data: bytes | bytearray | memoryview | np.ndarray) -> str:
    return DIGEST_PREFIX + xxhash.xxh3_128_hexdigest(data.data if isinstance(data, np.ndarray) else data)


def spans(nbytes: int) -> list[tuple[int, int]]:
    """The byte ranges a tensor is hashed, packed and unpacked in, each on whichever core is free (one,
    maybe empty, for a small tensor)."""
    return [(begin, min(begin + CHUNK_BYTES, nbytes)) for begin in range(0, nbytes, CHUNK_BYTES)] or [(0, 0)]


def joined(chunk_digests: Sequence[bytes]) -> str:
    """A tensor's digest: XXH3-128 over its chunks' XXH3-128 digests, so that a big tensor is hashed on
    every core at once."""
    return DIGEST_PREFIX + xxhash.xxh3_128_hexdigest(b"".join(chunk_digests))


def digest_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Every tensor's digest, all their chunks hashed in parallel."""
    arrays = {name: raw_bytes(t) for name, t in tensors.items()}
    hashed = map_chunks(
        {name: a.size for name, a in arrays.items()},
        lambda name, span: xxhash.xxh3_128_digest(arrays[name][span[0] : span[1]].data),
    )
    return {name: joined(digests) for name, digests in hashed.items()}


def map_chunks(sizes: Mapping[str, int], fn: Callable[[str, tuple[int, int]], R]) -> dict[str, list[R]]:
    """``fn(name, span)`` for every chunk of every tensor (``sizes``: bytes per name) on the pool, biggest
    first (balanced threads); each tensor's results in chunk order."""
    work = [(name, i, span) for name, nbytes in sizes.items() for i, span in enumerate(spans(nbytes))]
    work.sort(key=lambda w: w[2][0] - w[2][1])
    results = parallel_map(lambda w: fn(w[0], w[2]), work)
    chunks: dict[str, dict[int, R]] = {name: {} for name in sizes}
    for (name, i, _), result in zip(work, results, strict=True):
        chunks[name][i] = result
    return {name: [c[i] for i in range(len(c))] for name, c in chunks.items()}


_WORKERS = os.cpu_count() or 2  # one thread per core
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def parallel_map(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]`` on a process-wide pool of one thread per core (the work is numpy, zstd
    and xxhash calls, which release the GIL)."""
    if len(items) < 2:
        return [fn(x) for x in items]
    return list(pool().map(fn, items))


def pool() -> ThreadPoolExecutor:
    """The codec's process-wide pool: one thread per core, started on first use."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="codec")
        return _POOL
