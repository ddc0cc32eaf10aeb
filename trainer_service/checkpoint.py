"""Atomic, pickle-free checkpoints of the trainer, one layout for any number of ranks, which any
number resumes.

Layout: ``<root>/step-00000042/shards/shard-<rank+1>-model-00001-of-00001.safetensors`` (each rank's
shards of the weights and AdamW state's tensors, written by torch.distributed.checkpoint's
HuggingFaceStorageWriter: every file's header holds its shards' offsets, from which the reader rebuilds
the layout and reshards on load), ``{rng,kv_cache}.safetensors``, ``trainer.json`` (the step, the
service's state and the rest of the learner's: AdamW's param_groups), ``manifest.json``. Every file is
safetensors or JSON: loading one never unpickles (a checkpoint on a shared volume is data, not code).
A checkpoint is written into a staging directory, every file fsynced, ``manifest.json`` (sizes and
digests of the others) last, then renamed into place — so a directory named ``step-*`` is complete, and
one whose manifest does not verify (a torn copy, a bad disk) is skipped on resume. Checkpoints of one
process from before the layout was one (``{model,optimizer}.safetensors``, whole tensors) still resume in
one process; shards in torch's pickled format (``shards/.metadata``, of the versions in between) are
refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from fp8rl.serving import pid_alive

if TYPE_CHECKING:
    from trainer_service.learner import Learner

log = logging.getLogger(__name__)
PREFIX = "step-"
SHARDS = "shards"  # torch.distributed.checkpoint's directory in a checkpoint
SHARDED = ("model", "optimizer")  # the parts of Learner.state_dict() whose tensors live in it
REST = "learner"  # trainer.json's entry for their non-tensors (JSON)


class SaveFailed(Exception):
    """A checkpoint could not be written, whatever the cause: a full disk surfaces as an OSError,
    safetensors' SafetensorError (an Exception) or torch.distributed.checkpoint's CheckpointException (a
    BaseException), depending on which file it hit. Nothing of the checkpoint is left behind."""


def write(root: Path, learner: Learner, meta: Mapping[str, Any], keep: int | None = None) -> Path:
    """Checkpoint ``learner`` as step ``learner.step``, with ``meta`` (its service's state, JSON), every
    rank calling: each writes its shards into one staging directory; rank 0 then seals them with the rest
    and renames it into place (:func:`save`). A failed write leaves nothing behind and raises
    :class:`SaveFailed` (an interrupt or exit propagates as itself)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    ranks, step = learner.ranks, learner.step
    staged = staging(root, step)
    path = root / f"{PREFIX}{step:08d}"
    try:
        if ranks.is_root:
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(parents=True)
        ranks.barrier()
        state = learner.state_dict()
        shards, rest = split({k: state.pop(k) for k in SHARDED if k in state})
        # save_distributed: each rank its own file, its shards' offsets in the header (and no pickled
        # .metadata: the reader rebuilds it from the headers).
        writer = HuggingFaceStorageWriter(str(staged / SHARDS), save_distributed=True)
        with _one_process_quiet():
            dcp.save(_untied(shards, learner), storage_writer=writer, no_dist=not dist.is_initialized())
        ranks.barrier()
        if ranks.is_root:
            tensors = {"rng": _rng_state()}
            if "kv_cache" in state:
                tensors["kv_cache"] = {"scales": state["kv_cache"]}
            saved = "optimizer" in shards
            sealed = {**meta, "step": step, "ranks": ranks.world, "optimizer_saved": saved, REST: rest}
            path = save(root, step, tensors, sealed, keep, staged)
            log.info("checkpoint %s written by %d rank(s)", path, ranks.world)
    except BaseException as exc:
        # (across ranks the group ends too: the next start cleans up after the others)
        shutil.rmtree(staged, ignore_errors=True)
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise SaveFailed(f"checkpoint of step {step} into {root} failed: {cause(exc)}") from exc
    ranks.barrier()
    return path


def cause(exc: BaseException) -> str:
    """One line for what made a save fail: a CheckpointException's first rank's own error, not its
    traceback text."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        exc = inner[0] if isinstance(inner, tuple) else inner
    return f"{type(exc).__name__}: {exc}"


def resume(root: Path | None, learner: Learner) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest complete checkpoint of ``root`` into ``learner``, every rank calling (rank 0
    chooses it for all: every rank must load the same one), resharded to these ranks; return it with its
    meta, or None when there is none."""
    ranks = learner.ranks
    chosen = latest(root) if root is not None and ranks.is_root else None
    named = ranks.from_root(str(chosen or ""))
    if not named:
        return None
    path = Path(named)
    tensors, meta = load(path)
    state = (
        _sharded_state(path, learner, meta)
        if (path / SHARDS).is_dir()
        else _whole_state(path, learner, tensors, meta)
    )
    if "kv_cache" in tensors:
        state["kv_cache"] = tensors["kv_cache"]["scales"]
    elif learner.kv_cache is not None:  # (written under another recipe, or before scales were calibrated)
        log.warning("%s holds no FP8 attention scales: they restart at 1.0", path)
    state["step"] = meta["step"]
    learner.load_state_dict(state)
    torch.set_rng_state(tensors["rng"]["torch"])
    if "cuda" in tensors["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng"]["cuda"])
    return path, meta


def _sharded_state(path: Path, learner: Learner, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The learner's state from ``path``'s shards, loaded in place into its own tensors (so resharded),
    with the rest from ``meta``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    if (path / SHARDS / ".metadata").exists():
        raise RuntimeError(
            f"{path} holds shards in torch's pickled format (written by an earlier version), which are "
            "not loaded: loading them would unpickle. Move it aside to resume an older one, or start afresh"
        )
    state = learner.state_dict(optimizer=meta["optimizer_saved"])
    state.pop("kv_cache", None)
    shards, _ = split({k: state.pop(k) for k in SHARDED if k in state})
    reader = HuggingFaceStorageReader(str(path / SHARDS))
    with _one_process_quiet():
        dcp.load(_untied(shards, learner), storage_reader=reader, no_dist=not dist.is_initialized())
    return state | merged(shards, meta[REST])


def _untied(tensors: Mapping[str, Any], learner: Learner) -> dict[str, Any]:
    """``tensors`` with each tied weight under its first name only (``model.embed_tokens.weight``, not
    again as ``lm_head.weight``): safetensors holds no two views of one tensor, and loading one name
    loads both."""
    params = learner.model.named_parameters
    tied = {n for n, _ in params(remove_duplicate=False)} - {n for n, _ in params()}
    return {**tensors, "model": {k: v for k, v in tensors["model"].items() if k not in tied}}


def split(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Nested ``state`` as its tensors and the rest (what JSON holds: AdamW's param_groups), each nested
    as in ``state``; :func:`merged` joins them again."""
    tensors: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, Mapping):
            inner, other = split(value)
            if inner or not other:
                tensors[key] = inner
            if other:
                rest[key] = other
        else:
            (tensors if isinstance(value, torch.Tensor) else rest)[key] = value
    return tensors, rest


def merged(tensors: Mapping[str, Any], rest: Mapping[str, Any]) -> dict[str, Any]:
    """The nested state :func:`split` parted into ``tensors`` and ``rest``."""
    joined = dict(tensors)
    for key, value in rest.items():
        joined[key] = merged(joined.get(key, {}), value) if isinstance(value, Mapping) else value
    return joined


def _whole_state(
    path: Path, learner: Learner, tensors: Mapping[str, Mapping[str, torch.Tensor]], meta: Mapping[str, Any]
) -> dict[str, Any]:
    """The learner's state from a checkpoint of one process in the older layout (whole tensors, AdamW's
    state by parameter index), shaped as :meth:`Learner.state_dict`'s."""
    if learner.ranks.sharded:
        raise RuntimeError(f"{path} was written by one process of an older version: resume it in one process")
    names = list(learner.master_weights())  # the parameters' order: the optimizer's indices
    state = learner.state_dict(optimizer=False)
    state.pop("kv_cache", None)
    state["model"] = {**state["model"], **tensors["model"]}
    adam = unflatten_optimizer(tensors["optimizer"], meta["optimizer"])
    if adam["state"]:
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in adam["param_groups"]]
        state["optimizer"] = {
            "state": {names[i]: v for i, v in adam["state"].items()},
            "param_groups": groups,
        }
    return state


@contextlib.contextmanager
def _one_process_quiet() -> Iterator[None]:
    """Around torch.distributed.checkpoint in a process without a group: it warns, at every call, that it
    assumes one process, which is what is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _rng_state() -> dict[str, torch.Tensor]:
    """This process's RNG states (rank 0's, in a checkpoint of several)."""
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng


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
    try:
        os.rename(tmp, final)
    except BaseException:
        if old.exists():  # (clean_stale would delete it: the complete copy goes back in place)
            os.rename(old, final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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


def unflatten_optimizer(tensors: Mapping[str, torch.Tensor], rest: Mapping[str, Any]) -> dict[str, Any]:
    """An older checkpoint's AdamW state (tensors keyed ``<param index>.<field>``, the JSON rest) as
    ``optimizer.state_dict()`` had it."""
    state: dict[int, dict[str, Any]] = {}
    for flat, value in [*tensors.items(), *rest["scalars"].items()]:
        index, key = flat.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    return {"state": state, "param_groups": rest["param_groups"]}
