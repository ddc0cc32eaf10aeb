"""An update checked and applied part by part, as the parts arrive: :class:`UpdateDecoder`. Every
digest is verified before it returns, and an update is applied whole or not at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

import torch

from fp8rl.codec import apply
from fp8rl.codec.layout import (
    MAX_PARTS,
    Encoding,
    checked_metadata,
    json_field,
    read_header,
    tensors_of,
)
from fp8rl.codec.weight_set import DTYPES, WeightSet, digest_tensors, joined
from fp8rl.errors import BaseMismatchError, CorruptUpdateError
from fp8rl.recipes import WEIGHT_FORMATS, WeightFormat

Admit = Callable[[str, torch.dtype, tuple[int, ...]], None]
"""``admit(name, dtype, shape)`` sees each tensor of an update before it is allocated; raises to refuse."""
_IDENTITY = ("kind", "version", "base_version", "base_digest", "recipe", "format", "parts")
_DELTA_ENTRY_FIELDS = {"dtype", "shape", "digest", "word", "chunks"}


@dataclass(frozen=True)
class DecodedUpdate:
    """What an update decoded to: the new set, its version and encoding, and the tensors it touched."""

    weights: WeightSet
    version: int
    encoding: Encoding
    tensors_updated: int


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
            self.held.consume()  # its memory now belongs to (and may hold) the new version
        return decoded

    def abort(self) -> None:
        """Put back everything applied so far (a no-op once finished or aborted)."""
        if self._closed:
            return
        self._closed = True
        if self.held is not None:
            apply.undo(self.held, self._outcomes)
        self._outcomes.clear()

    def _add(self, blob: bytes | bytearray | memoryview) -> None:
        header, start = read_header(blob)
        metadata = checked_metadata(header)
        tensors = tensors_of(blob, header, start)
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
            self._in_place = apply.unshared(held.tensors) if held.owned else set()
        elif kind != "full":
            raise CorruptUpdateError(f"unknown update kind {kind!r}")
        self._identity = identity

    def _add_full(self, tensors: dict[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
        digests = json_field(metadata, "digests")
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
        entries = json_field(metadata, "tensors")
        if not isinstance(entries, dict) or set(entries) != set(payload):
            raise CorruptUpdateError("delta tensor list does not match its payload")
        self._admit_entries(entries)
        targets = [
            apply.target_of(name, entry, payload[name], held.tensors.get(name), name in self._in_place)
            for name, entry in entries.items()
        ]
        work = [(target, i) for target in targets for i in range(len(target.chunks))]
        work.sort(key=lambda w: w[0].spans[w[1]][0] - w[0].spans[w[1]][1])  # big first: balanced threads
        # Each outcome is recorded (for abort's undo) by the thread that applied it, as soon as it did.
        outcomes, interrupted = apply.settled(lambda w: apply.unpack_chunk(*w), work, self._outcomes)
        if interrupted is not None:
            raise interrupted
        hashed: dict[tuple[str, int], bytes] = {}
        for (target, i), outcome in zip(work, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                raise outcome
            hashed[target.name, i] = outcome[0]
        for target in targets:
            digest = joined([hashed[target.name, i] for i in range(len(target.chunks))])
            if digest != entries[target.name]["digest"]:
                raise CorruptUpdateError(f"digest mismatch for tensor {target.name!r}")
            self._tensors[target.name] = torch.from_numpy(target.out).view(target.dtype).reshape(target.shape)
            self._digests[target.name] = digest
        self._updated += len(entries)

    def _admit_entries(self, entries: Mapping[str, object]) -> None:
        """Checks each delta entry's fields, and shows ``admit`` what each tensor will be."""
        for name, entry in entries.items():
            if not isinstance(entry, dict) or set(entry) != _DELTA_ENTRY_FIELDS:
                raise CorruptUpdateError(f"delta entry for tensor {name!r} is malformed")
            if self.admit is not None:
                try:
                    dtype, shape = DTYPES[str(entry["dtype"])], tuple(int(d) for d in entry["shape"])
                except Exception as exc:
                    raise CorruptUpdateError(f"bad entry for tensor {name!r}: {exc}") from exc
                self.admit(name, dtype, shape)

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
        removed = json_field(metadata, "removed")
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
