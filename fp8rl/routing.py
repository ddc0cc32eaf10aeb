"""Routed experts of a mixture-of-experts model, as both engines see them: the wire's packing of expert
ids, how often two routings of the same positions disagree, and the router scores of a replayed routing.

A routing is an integer tensor [positions, moe_layers, top_k] of expert indices; which order the top_k
experts of one decision come in carries no meaning (the engines sort them differently), so decisions are
compared as sets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

UNKNOWN = -1  # a position no routing was received for (padding, a sequence's last token)


def id_bytes(num_experts: int) -> int:
    """Bytes per expert id on the wire: 1 for up to 256 experts, else 2."""
    return 1 if num_experts <= 256 else 2


def pack(ids: np.ndarray | torch.Tensor, num_experts: int) -> bytes:
    """``ids`` [positions, moe_layers, top_k] as little-endian unsigned ints of :func:`id_bytes` each."""
    array = ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    if array.size and (array.min() < 0 or array.max() >= num_experts):
        raise ValueError(f"expert ids outside [0, {num_experts})")
    return array.astype("<u1" if id_bytes(num_experts) == 1 else "<u2").tobytes()


def unpack(data: bytes, width: int, moe_layers: int, top_k: int) -> torch.Tensor:
    """The routing ``data`` packs, [positions, moe_layers, top_k] int64; ValueError when the bytes do not
    make whole positions."""
    if width not in (1, 2):
        raise ValueError(f"id_bytes is {width}, must be 1 or 2")
    per_position = width * moe_layers * top_k
    if per_position == 0 or len(data) % per_position:
        raise ValueError(
            f"{len(data)} bytes of expert ids are not whole positions of {moe_layers} layers x {top_k} "
            f"experts x {width} bytes"
        )
    array = np.frombuffer(data, dtype="<u1" if width == 1 else "<u2").reshape(-1, moe_layers, top_k)
    return torch.from_numpy(array.astype(np.int64))


@dataclass(frozen=True)
class Mismatch:
    """Counts of routing disagreement over a set of positions: decisions are (position, layer) pairs."""

    decisions: int = 0
    differing_decisions: int = 0
    positions: int = 0
    differing_positions: int = 0

    def __add__(self, other: Mismatch) -> Mismatch:
        return Mismatch(
            self.decisions + other.decisions,
            self.differing_decisions + other.differing_decisions,
            self.positions + other.positions,
            self.differing_positions + other.differing_positions,
        )

    def metrics(self) -> dict[str, float]:
        """``routing_mismatch`` (per decision) and ``routing_mismatch_positions``; none without positions."""
        if not self.positions:
            return {}
        return {
            "routing_mismatch": self.differing_decisions / self.decisions,
            "routing_mismatch_positions": self.differing_positions / self.positions,
        }


def mismatch(own: torch.Tensor, other: torch.Tensor, where: torch.Tensor) -> Mismatch:
    """How often ``own`` and ``other`` ([..., moe_layers, top_k]) route a position of ``where`` (bool,
    their leading shape) to different expert sets; positions where ``other`` is :data:`UNKNOWN` do not
    count."""
    where = where & (other[..., 0, 0] != UNKNOWN)
    a, b = own[where].sort(dim=-1).values, other[where].sort(dim=-1).values
    differs = (a != b).any(dim=-1)  # [positions, moe_layers]
    return Mismatch(
        decisions=differs.numel(),
        differing_decisions=int(differs.sum()),
        positions=differs.shape[0],
        differing_positions=int(differs.any(dim=-1).sum()),
    )


def replayed_scores(router_logits: torch.Tensor, ids: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The weights a softmax-top-k router (Qwen3-MoE's, Mixtral's) gives the experts ``ids`` [T, top_k]
    from its ``router_logits`` [T, experts]: their softmax probabilities, renormalized over the top_k when
    ``normalize``; differentiable in the logits, as the router's own scores are. In the logits' dtype."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    scores = probs.gather(-1, ids)
    if normalize:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores.to(router_logits.dtype)
