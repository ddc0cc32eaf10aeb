"""Which device a process computes on: a config field (``device``) of the trainer and of the rollout,
resolved in one place, so that nothing takes CUDA merely because it is there.

``auto`` means ``$FP8RL_DEVICE`` where it is set (the test suite sets ``cpu`` for itself and the
processes it starts: its CPU tests then run the same on a CUDA host), else ``cuda`` where torch sees a
CUDA device, else ``cpu``.
"""

from __future__ import annotations

import os
from typing import Literal, get_args

Device = Literal["auto", "cpu", "cuda"]
DEVICES: tuple[Device, ...] = get_args(Device)
DEVICE_ENV = "FP8RL_DEVICE"
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"


def resolve_device(requested: str = "auto") -> Literal["cpu", "cuda"]:
    """``cpu`` or ``cuda`` for a configured ``device``; ``cuda`` where torch sees none is an error."""
    import torch

    if requested == "auto":
        requested = os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")
    if requested not in ("cpu", "cuda"):
        raise ValueError(f"device {requested!r}: expected one of {', '.join(DEVICES)} (${DEVICE_ENV} too)")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    return "cuda" if requested == "cuda" else "cpu"


def prefer_huge_pages() -> None:
    """Back large allocations with transparent huge pages (2 MiB; madvise, which Linux honours by
    default) unless told otherwise: torch's CPU tensors of 2 MiB or more from now on
    (``$THP_MEM_ALLOC_ENABLE``, read at torch's first large allocation), and every malloc of the
    processes this one starts (glibc's ``glibc.malloc.hugetlb=1`` tunable, read at a process's start).

    Without them every large tensor or buffer is a fresh mapping faulted in 4 KiB at a time: the test
    suite spent about a fifth of its CPU in the kernel, and one exact-consistency case took 3.7 M page
    faults (1.3 M with torch's alone). Call it first thing in a process."""
    os.environ.setdefault(HUGE_PAGES_ENV, "1")
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" not in tunables:
        os.environ["GLIBC_TUNABLES"] = ":".join(filter(None, (tunables, "glibc.malloc.hugetlb=1")))
