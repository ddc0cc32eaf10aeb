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


# glibc's malloc as a service's steps want it (read at a process's start, so set for the processes this
# one starts): large allocations in transparent huge pages; no chunk mapped apart, which free() unmaps
# and the next step faults in afresh, zeroed by the kernel; and the heap's free top kept, not trimmed.
GLIBC_TUNABLES_WANTED = {
    "glibc.malloc.hugetlb": "1",
    "glibc.malloc.mmap_max": "0",
    "glibc.malloc.trim_threshold": str(1 << 40),
}


def tune_memory() -> None:
    """Back large allocations with transparent huge pages (2 MiB; madvise, which Linux honours by
    default) and keep freed memory for reuse, unless told otherwise: torch's CPU tensors of 2 MiB or more
    from now on (``$THP_MEM_ALLOC_ENABLE``, read at torch's first large allocation), and every malloc of
    the processes this one starts (:data:`GLIBC_TUNABLES_WANTED`, each unless ``$GLIBC_TUNABLES`` names
    it already).

    Without huge pages every large tensor or buffer is a fresh mapping faulted in 4 KiB at a time: the
    test suite spent about a fifth of its CPU in the kernel, and one exact-consistency case took 3.7 M
    page faults (1.3 M with torch's alone). Without the kept memory a trainer's step, whose tensors come
    back at the same sizes every step, spent a fifth of its time in the kernel zeroing pages it had
    freed the step before (``clear_page_erms`` in perf, SmolLM2 under the study). A process keeps its
    peak: what its steps touch again anyway. Call it first thing in a process."""
    os.environ.setdefault(HUGE_PAGES_ENV, "1")
    tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t]
    named = {t.split("=", 1)[0] for t in tunables}
    tunables += [f"{name}={value}" for name, value in GLIBC_TUNABLES_WANTED.items() if name not in named]
    os.environ["GLIBC_TUNABLES"] = ":".join(tunables)
