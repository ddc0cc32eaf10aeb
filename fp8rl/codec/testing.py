"""Whole updates in one call — one part, one buffer — for tests and benches.

The services send and apply updates part by part (:func:`~fp8rl.codec.encode.keyframe_parts`,
:func:`~fp8rl.codec.encode.delta_parts`, :class:`~fp8rl.codec.decode.UpdateDecoder`); no module of theirs
imports this one (tests/unit/test_weight_codec.py checks). It lives in the package rather than in tests/
because the benches, run as scripts from bench/, use it too.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from fp8rl.codec.decode import Admit, DecodedUpdate, UpdateDecoder
from fp8rl.codec.encode import EncodedUpdate, delta_parts, keyframe_parts
from fp8rl.codec.layout import checked_metadata, read_header
from fp8rl.codec.weight_set import WeightSet


def encode_keyframe(weights: WeightSet, version: int, recipe: str = "") -> EncodedUpdate:
    """The whole set as a keyframe in one part."""
    (whole,) = keyframe_parts(weights, version, recipe, part_bytes=sys.maxsize)
    return whole


def encode_delta(
    new: WeightSet, base: WeightSet, version: int, base_version: int, recipe: str = ""
) -> EncodedUpdate:
    """``new`` as changes against ``base`` in one part (see :func:`~fp8rl.codec.encode.delta_parts`)."""
    (whole,) = delta_parts(new, base, version, base_version, recipe, part_bytes=sys.maxsize)
    return whole


def to_bytes(update: EncodedUpdate) -> bytes:
    """One part as one buffer (the stream sends its segments as they are)."""
    return b"".join(update.segments)


def decode_update(
    blob: bytes | bytearray | memoryview,
    held: WeightSet | None = None,
    held_version: int | None = None,
    admit: Admit | None = None,
    accept: Callable[[DecodedUpdate], None] | None = None,
) -> DecodedUpdate:
    """Verify and apply an update that is one part (see :class:`~fp8rl.codec.decode.UpdateDecoder`)."""
    decoder = UpdateDecoder(held, held_version, admit)
    decoder.add(blob)
    return decoder.finish(accept)


def read_metadata(blob: bytes | bytearray | memoryview) -> dict[str, str]:
    """The string metadata of a safetensors blob (its JSON header's ``__metadata__``), checked against
    its own digest."""
    return checked_metadata(read_header(blob)[0])
