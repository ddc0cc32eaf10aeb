"""The default base model: the tiny arith model, built once and cached under the user's cache dir."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fp8rl"


def default_model(seed: int = 0) -> Path:
    from fp8rl.tiny import write_tiny_model

    path = cache_dir() / f"tiny-seed{seed}"
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        write_tiny_model(tmp, seed=seed)
        os.replace(tmp, path)
    return path
