"""Atomic, pickle-free checkpoints: safetensors for tensors, JSON for everything else.

Layout: ``<root>/step-00000042/{model,optimizer,rng}.safetensors, trainer.json, manifest.json``. A
checkpoint is written into a temporary directory, every file fsynced, ``manifest.json`` (sizes and
digests of the others) last, then renamed into place — so a directory named ``step-*`` is complete, and
one whose manifest does not verify (a torn copy, a bad disk) is skipped on resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fp8rl.serving import pid_alive

log = logging.getLogger(__name__)
PREFIX = "step-"


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save(
    root: Path,
    step: int,
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    meta: Mapping[str, Any],
    keep: int | None = None,
    staged: Path | None = None,
) -> Path:
    """Write ``tensors`` (file stem -> named tensors) and ``meta`` as checkpoint ``step``, atomically; then
    keep only the newest ``keep`` checkpoints. A failed write (a full disk) leaves nothing behind.
    ``staged``: a staging directory (:func:`staging`) other processes already wrote files into (the
    ranks' shards): it becomes the checkpoint, its files sealed in the manifest with the rest."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = staged or root / f".tmp-{final.name}-{os.getpid()}"
    if staged is None:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(exist_ok=staged is not None)
        for stem, named in tensors.items():
            path = tmp / f"{stem}.safetensors"
            save_file({k: v.detach().cpu().contiguous() for k, v in named.items()}, path)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
        _fsync_write(tmp / "trainer.json", json.dumps(meta, indent=2, sort_keys=True).encode())
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        manifest = {n: {"bytes": (tmp / n).stat().st_size, "sha256": _digest(tmp / n)} for n in files}
        _fsync_write(tmp / "manifest.json", json.dumps(manifest, indent=2).encode())
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = root / f".old-{final.name}-{os.getpid()}"
    if final.exists():  # re-saving a step: the old copy is set aside, not deleted, until the new one is in
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    if keep is not None:
        prune(root, keep, step)
    return final


def staging(root: Path, step: int) -> Path:
    """Where the ranks of a sharded trainer stage checkpoint ``step`` (one name all ranks know; removed
    on start-up by :func:`clean_stale` if a save was interrupted)."""
    return root / f".tmp-{PREFIX}{step:08d}-ranks"


def prune(root: Path, keep: int, newest: int) -> list[Path]:
    """Delete checkpoints past step ``newest`` (a timeline the trainer left: it resumed from an older
    one, so they are torn or abandoned) and all but the ``keep`` newest up to it; returns what went."""
    kept = sorted(p for p in root.glob(f"{PREFIX}*") if p.name <= f"{PREFIX}{newest:08d}")
    gone = [p for p in root.glob(f"{PREFIX}*") if p.name > f"{PREFIX}{newest:08d}"] + kept[
        : max(len(kept) - keep, 0)
    ]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def clean_stale(root: Path) -> list[Path]:
    """Remove what interrupted saves left (``.tmp-*`` and ``.old-*`` of processes that are gone)."""
    removed = []
    for path in [*root.glob(".tmp-*"), *root.glob(".old-*")] if root.is_dir() else []:
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and pid_alive(int(pid)):
            continue  # another live process is writing it
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def verify(path: Path) -> bool:
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        return (
            all(
                (path / name).stat().st_size == entry["bytes"] and _digest(path / name) == entry["sha256"]
                for name, entry in manifest.items()
            )
            and "trainer.json" in manifest
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def latest(root: Path) -> Path | None:
    """The newest checkpoint that verifies; torn or corrupted ones are skipped (and logged)."""
    if not root.is_dir():
        return None
    for path in sorted(root.glob(f"{PREFIX}*"), reverse=True):
        if verify(path):
            return path
        log.warning("skipping incomplete checkpoint %s", path)
    return None


def load(path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    tensors = {p.stem: load_file(p) for p in sorted(path.glob("*.safetensors"))}
    return tensors, json.loads((path / "trainer.json").read_text())


def flatten_optimizer(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``optimizer.state_dict()`` -> (tensors keyed ``<param index>.<field>``, JSON-able rest)."""
    tensors, scalars = {}, {}
    for index, fields in state["state"].items():
        for key, value in fields.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value
            else:
                scalars[f"{index}.{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def unflatten_optimizer(tensors: Mapping[str, torch.Tensor], rest: Mapping[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for flat, value in [*tensors.items(), *rest["scalars"].items()]:
        index, key = flat.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    return {"state": state, "param_groups": rest["param_groups"]}
