"""Models shipped with fp8rl, as data: each directory is an HF checkpoint with a ``manifest.json`` that
records how it was built, what it scored and the sha256 of every file. Shipped bytes are the same on
every machine, where a rebuild depends on the CPU's float kernels (see ``fp8rl.tiny``).

Light on purpose (no torch): configs name the default model before anything heavy is imported."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator

from fp8rl.architectures import check_supported, read_config

TINY_ARITH = Path(__file__).resolve().parent / "tiny-arith"
"""The demo's base model: the tiny Qwen2 warm-started on arith (``python -m fp8rl.tiny --trained``)."""

TINY_ARITH_MOE = Path(__file__).resolve().parent / "tiny-arith-moe"
"""Its Qwen3-MoE twin, warm-started the same way (``python -m fp8rl.tiny --trained --moe``): the FP8
study's MoE row in miniature (``coordinator compare --model`` it)."""

MANIFEST = "manifest.json"


class ShippedModelError(ValueError):
    """A shipped model's files are missing or differ from its manifest."""


def file_digests(directory: Path) -> dict[str, str]:
    """sha256 (hex) of every file in ``directory`` but the manifest, by file name."""
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name != MANIFEST
    }


def read_manifest(directory: Path) -> dict[str, Any]:
    return json.loads((directory / MANIFEST).read_text())


def verified(directory: Path = TINY_ARITH) -> Path:
    """``directory``, once its files match the digests of its manifest exactly (no file missing or extra)."""
    if not (directory / MANIFEST).is_file():
        raise ShippedModelError(f"{directory}: no {MANIFEST}; is the checkout complete?")
    expected = read_manifest(directory)["files"]
    found = file_digests(directory)
    wrong = sorted(name for name in expected.keys() | found.keys() if expected.get(name) != found.get(name))
    if wrong:
        raise ShippedModelError(
            f"{directory}: {', '.join(wrong)} differ from {MANIFEST} (a damaged checkout, e.g. a Git LFS "
            "pointer or a line-ending conversion?); restore it with git, or pass --model DIR"
        )
    return directory


def intact(path: Path) -> Path:
    """``path``, verified first when it is a shipped model, and of a supported family when it has a
    config.json (a config validator: an unsupported model is refused before anything loads)."""
    if path.resolve() in (TINY_ARITH, TINY_ARITH_MOE):  # (read at call time: tests stand copies in)
        return verified(path)
    if (path / "config.json").is_file():
        check_supported(read_config(path), str(path))
    return path


ModelDir = Annotated[Path, AfterValidator(intact)]
"""A checkpoint directory in a config: a shipped model is checked against its manifest on load."""
