"""The trainer across ranks: one process per device under torchrun, the model fully sharded (FSDP2), one
command stream from rank 0.

Rank 0 serves gRPC. Every call that touches the model is checked there first (bad input never reaches a
collective), then announced to the other ranks as a command — its kind and the request's bytes — so that
every rank runs the same method on the same request and so the same collectives in the same order. A rank
that dies makes the others fail their next collective and exit; one whose host vanishes (its connections
never close) stops beating in torchrun's store, and the others exit once they notice (PEER_LOST_S).
Either way torchrun ends the group, and the run rewinds to the last checkpoint like any trainer restart.

Here only the group and its messages; the sharded model is the learner's (trainer_service/learner.py).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fp8rl.devices import resolve_device
from fp8rl.errors import InvalidRequest, PreconditionFailed

log = logging.getLogger(__name__)

COMMANDS = ("train", "logprobs", "publish", "save", "stop")


@dataclass(frozen=True)
class Ranks:
    """This process's place in the trainer: rank ``rank`` of ``world``. A world of one (a plain process,
    or torchrun with one rank) is the same code path: its collectives return their input and send
    nothing, and its model is not sharded."""

    rank: int = 0
    world: int = 1

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Whether the model is split over ranks (FSDP2), so that every rank takes part in each step."""
        return self.world > 1

    def all_sum(self, value: float) -> float:
        """``value`` summed over ranks (float64)."""
        return _all_sum(value) if self.sharded else value

    def all_max(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``t`` over ranks (a collective every rank calls)."""
        return _all_max(t) if self.sharded else t

    def gather_rows(self, local: torch.Tensor, owners: list[torch.Tensor]) -> torch.Tensor:
        """Rank r computed the rows ``owners[r]`` (``local`` is this rank's, in that order); return every
        row, in order, on every rank (in a world of one, ``owners[0]`` is every row in order: ``local``)."""
        return _gather_rows(local, owners, self.world) if self.sharded else local

    def barrier(self) -> None:
        if self.sharded:
            dist.barrier()

    def from_root(self, text: str) -> str:
        """Rank 0's ``text`` on every rank (what the others pass is ignored)."""
        return _broadcast_text(text if self.is_root else None) if self.sharded else text

    def announce(self, kind: str, payload: bytes) -> None:
        """Rank 0: tell every other rank to run ``kind`` on ``payload`` (a request's bytes); nothing on
        the ranks that follow, who run the command already, nor in a world of one."""
        if self.sharded and self.is_root:
            _announce(kind, payload)


ONE_PROCESS = Ranks()


GROUP_TIMEOUT = datetime.timedelta(days=7)
"""Ranks > 0 wait in a broadcast for rank 0's next command as long as no call comes (a run paused for
hours, a slow rollout phase): the default timeout (10 or 30 minutes) would end an idle group. A rank
that dies still ends the others at once (its connections close, torchrun stops the group)."""


def join_group(device: str = "auto") -> Ranks:
    """Join the process group torchrun set up: nccl on CUDA, gloo on CPU (``device``: the trainer's
    configured device, fp8rl/devices.py)."""
    if not dist.is_initialized():
        cuda = resolve_device(device) == "cuda"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=GROUP_TIMEOUT)
        if dist.get_world_size() > 1:
            global _watcher
            _watcher = threading.Thread(target=_watch_peers, name="peer-watch", daemon=True)
            _watcher.start()
            atexit.register(_stop_watching)  # (a rank that ends without leave_group: a stopped follower)
    return Ranks(dist.get_rank(), dist.get_world_size())


HEARTBEAT_S = 2.0
PEER_LOST_S = 60.0
"""A rank that sees no heartbeat from a peer for this long exits (status 1), and torchrun ends the
group. A peer whose host vanished (a pod killed with its network, a machine lost) closes no connection:
without this a collective would wait GROUP_TIMEOUT for it, and the group would never be replaced."""
LEFT = 1 << 40
"""Added to a rank's beat count as it stops beating (past :func:`leave_group`'s barrier, or at its exit):
its peers stop watching it rather than take a rank that left for a lost one."""
_leaving = threading.Event()
_watcher: threading.Thread | None = None


def _watch_peers() -> None:
    """Every rank beats a counter in torchrun's store (at rank 0's node) and watches the others'."""
    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(datetime.timedelta(seconds=PEER_LOST_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    seen: dict[int, tuple[int, float]] = {}
    answered = True
    while not _leaving.wait(HEARTBEAT_S):
        try:
            store.add(f"fp8rl/alive/{rank}", 1)
            counts = {peer: store.add(f"fp8rl/alive/{peer}", 0) for peer in range(world) if peer != rank}
        except Exception as exc:  # (the store's host is gone: so is rank 0)
            answered = False
            lost = f"torchrun's store is unreachable ({exc})"
        else:
            answered = True
            now = time.monotonic()
            for peer, count in counts.items():
                if seen.get(peer, (None, 0.0))[0] != count:
                    seen[peer] = (count, now)
            stale = [p for p, (count, at) in seen.items() if count < LEFT and now - at > PEER_LOST_S]
            if not stale:
                continue
            lost = f"rank(s) {stale} gave no sign of life for {PEER_LOST_S:.0f}s"
        if not _leaving.is_set():
            log.error("rank %d: %s; leaving the group", rank, lost)
            os._exit(1)
    if answered:  # (else it would wait out the store's timeout again, for peers that end with the store)
        with contextlib.suppress(Exception):
            store.add(f"fp8rl/alive/{rank}", LEFT)


def _stop_watching() -> None:
    """Stop beating, and wait for the watcher's last call to the store. A daemon thread still inside one
    as the interpreter finalizes is unwound through C++ that cannot unwind: the rank aborts (SIGABRT,
    "terminate called without an active exception": in the suite's two-rank tests, with the barrier
    below and no join, a rank whose step had passed)."""
    _leaving.set()  # (the watcher marks its rank LEFT, then stops)
    if _watcher is not None:  # (its last beat and the mark: each bounded by the store's timeout)
        _watcher.join(timeout=2 * PEER_LOST_S + HEARTBEAT_S)


def leave_group() -> None:
    """Leave torchrun's group together: every rank at a barrier (still beating and watching: a peer
    whose host vanishes meanwhile ends this rank as anywhere else), the heartbeat ended, then each
    destroys its own (a rank that destroys gloo's group while a peer still sends to it can abort in C++)."""
    if dist.is_initialized():
        dist.barrier()
        _stop_watching()
        dist.destroy_process_group()


def _device() -> torch.device:
    """Where the group's messages live: the GPU under nccl, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _announce(kind: str, payload: bytes) -> None:
    header = torch.tensor([COMMANDS.index(kind), len(payload)], dtype=torch.int64, device=_device())
    dist.broadcast(header, src=0)
    if payload:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(_device())
        dist.broadcast(data, src=0)


def _broadcast_text(text: str | None) -> str:
    """Rank 0's ``text`` on every rank (the others pass None)."""
    payload = (text or "").encode()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=_device())
    dist.broadcast(size, src=0)
    if not int(size):
        return ""
    if text is not None:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(_device())
    else:
        data = torch.empty(int(size), dtype=torch.uint8, device=_device())
    dist.broadcast(data, src=0)
    return data.cpu().numpy().tobytes().decode()


def next_command() -> tuple[str, bytes]:
    """Ranks > 0: wait for rank 0's next command."""
    header = torch.empty(2, dtype=torch.int64, device=_device())
    dist.broadcast(header, src=0)
    kind, size = COMMANDS[int(header[0])], int(header[1])
    if not size:
        return kind, b""
    data = torch.empty(size, dtype=torch.uint8, device=_device())
    dist.broadcast(data, src=0)
    return kind, data.cpu().numpy().tobytes()


def follow(handlers: dict[str, Callable[[bytes], object]]) -> None:
    """Ranks > 0: run rank 0's commands until it says stop. A domain error (bad input, a refused step) is
    one rank 0 raised too, at the same point (the same method on the same request): logged, and the rank
    goes on. Anything else may have left the ranks out of step, so it ends this process (and torchrun the
    group) rather than leave rank 0 waiting in a collective."""
    while True:
        kind, payload = next_command()
        if kind == "stop":
            return
        try:
            handlers[kind](payload)
        except (InvalidRequest, PreconditionFailed) as exc:
            log.warning("command %s failed on rank %d as on rank 0: %s", kind, dist.get_rank(), exc)


@contextlib.contextmanager
def in_step(ranks: Ranks) -> Iterator[None]:
    """Around rank 0's part of a command: an error other than a domain error may have left the ranks out
    of step, so the process ends and torchrun ends the group (the trainer turns unhealthy and restarts
    from its checkpoint) rather than serve on with ranks waiting in different collectives."""
    try:
        yield
    except (InvalidRequest, PreconditionFailed):
        raise
    except BaseException:
        if not ranks.sharded:
            raise
        log.exception("rank %d failed in a collective step; ending the group", ranks.rank)
        logging.shutdown()
        os._exit(1)


def _gather_rows(local: torch.Tensor, owners: list[torch.Tensor], world: int) -> torch.Tensor:
    """:meth:`Ranks.gather_rows` across processes. Shares may differ in size: they are padded for the
    gather."""
    share = max(len(rows) for rows in owners)
    padded = local.new_zeros((share, *local.shape[1:]))
    padded[: len(local)] = local
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    out = local.new_empty((sum(len(rows) for rows in owners), *local.shape[1:]))
    for rows, part in zip(owners, gathered, strict=True):
        out[rows] = part[: len(rows)]
    return out


def _all_sum(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return float(t.item())


def _all_max(t: torch.Tensor) -> torch.Tensor:
    out = t.detach().to(_device(), copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.to(t.device)
