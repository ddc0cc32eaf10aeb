"""The default base model: the tiny arith model, built once and cached under the user's cache dir."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fp8rl"


def default_model(seed: int = 0, say: Callable[[str], None] = print) -> Path:
    """The tiny Qwen2 warm-started on arith (built on first use, about 90 s on 2 cores; then cached)."""
    from fp8rl.tiny import write_tiny_model

    path = cache_dir() / f"tiny-arith-seed{seed}-{builder_digest()}"
    if not (path / "config.json").exists():
        say(f"building the tiny arith base model (a short supervised warm start) into {path}")
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        write_tiny_model(tmp, seed=seed, trained=True)
        os.replace(tmp, path)
    return path


def builder_digest() -> str:
    """Digest of the code that builds the model, so a changed warm start never reuses a stale cache."""
    import fp8rl.arith
    import fp8rl.tiny

    digest = hashlib.sha256()
    for module in (fp8rl.tiny, fp8rl.arith):
        digest.update(Path(str(module.__file__)).read_bytes())
    return digest.hexdigest()[:12]
