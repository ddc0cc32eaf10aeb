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
