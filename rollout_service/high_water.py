"""A replica's high-water mark: the (epoch, version) of the newest signed update it took, below which
every update is refused, kept in a file (``security.update_high_water_file``) so that a restarted replica
refuses what it refused before (a captured older update, replayed).

The file names the key that signed the updates it counts: a run with new keys starts afresh. Replicas
that share the file (one volume under ``--scale``) keep the highest mark any of them took, which is still
sound: the trainer only ever publishes the newest version of the newest epoch.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from fp8rl.credentials import write_private_atomic
from fp8rl.errors import PreconditionFailed

log = logging.getLogger(__name__)
Mark = tuple[int, int]  # (epoch, version)
NONE: Mark = (-1, -1)


class HighWater:
    def __init__(self, path: Path | None, signer: str) -> None:
        """``path``: the mark's file (None: kept in memory only); ``signer``: the fingerprint of the public
        key updates are verified with (fp8rl.security.signer_id)."""
        self.path, self.signer = path, signer
        self.newest = read_mark(path, signer) if path is not None else NONE

    def check(self, epoch: int, version: int, what: str) -> None:
        """Refuse an update older than the mark (equal passes: the healing cases re-send it)."""
        if (epoch, version) < self.newest:
            kept = f" (kept in {self.path} across restarts)" if self.path is not None else ""
            raise PreconditionFailed(
                f"header.version: {what} of version {version} (epoch {epoch}) refused: older than version "
                f"{self.newest[1]} (epoch {self.newest[0]}), the newest this replica applied{kept}"
            )

    def raise_to(self, epoch: int, version: int) -> None:
        """Raise the mark to (epoch, version) on disk, then here; an OSError leaves both as they were."""
        new = max(self.newest, (epoch, version))
        if self.path is not None:
            with locked(self.path):
                on_disk = read_mark(self.path, self.signer)  # another replica sharing it may be further
                new = max(new, on_disk)
                if new != on_disk:
                    body = {"signer": self.signer, "epoch": new[0], "version": new[1]}
                    write_private_atomic(self.path, json.dumps(body) + "\n")
        self.newest = new


def read_mark(path: Path, signer: str) -> Mark:
    """The mark in ``path`` for updates of ``signer``; none when the file is absent or counts another key."""
    try:
        data = json.loads(path.read_text())
        mark, counted = (int(data["epoch"]), int(data["version"])), str(data["signer"])
    except FileNotFoundError:
        return NONE
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"security.update_high_water_file: {path} is not a high-water mark ({exc!r}); it is written "
            "atomically, so something else wrote it: remove it to start afresh (the replica then takes any "
            "signed update once)"
        ) from None
    if counted != signer:
        log.warning("%s counts updates of another signing key: this replica starts afresh", path)
        return NONE
    return mark


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path``'s lock file (beside it, 0600) while the mark is read and raised."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
