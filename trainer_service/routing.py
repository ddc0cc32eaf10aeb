"""The trainer's mixture-of-experts routers: what they choose for a batch, and routing replay.

transformers' top-k routers (``mlp.gate`` of a sparse MoE block, e.g. ``Qwen3MoeTopKRouter``) return
``(router_logits, scores, expert_ids)`` for the block's flattened tokens ([batch x positions] rows, in
order). A forward hook records the ids they chose and, under replay, swaps in the ids the rollout
routed with the router's own weights for them (:func:`fp8rl.routing.replayed_scores`: gradients still
reach the router through its logits). Replay is Miles' R3 ("rollout routing replay"): the trainer's
experts see the tokens the rollout's did, so expert flips between the engines no longer move logprobs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from fp8rl import routing
from trainer_service.fp8_linear import block_experts


def moe_routers(model: torch.nn.Module) -> list[Any]:
    """The router of every MoE layer of ``model``, in layer order (empty for a dense model); ValueError
    for a router that is not a softmax-top-k router fp8rl can replay."""
    modules = dict(model.named_modules())
    routers = []
    for name, _ in block_experts(model):
        router = modules.get(name.removesuffix(".experts") + ".gate")
        if router is None or not all(hasattr(router, a) for a in ("top_k", "norm_topk_prob", "weight")):
            raise ValueError(
                f"{name}: no softmax top-k router beside these experts (its routing is not read)"
            )
        routers.append(router)
    return routers


@contextlib.contextmanager
def routed(routers: list[Any], replay: torch.Tensor | None = None) -> Iterator[list[torch.Tensor | None]]:
    """During the block, each router's own choice for its last forward, [rows, top_k] per layer (None
    until it ran). ``replay`` [batch, positions, layers, top_k]: where it holds ids (not
    :data:`fp8rl.routing.UNKNOWN`) the routers route as it says."""
    chosen: list[torch.Tensor | None] = [None] * len(routers)

    def hook(layer: int, router: Any, args: Any, output: tuple[torch.Tensor, ...]) -> Any:
        logits, _, ids = output
        chosen[layer] = ids.detach()
        if replay is None:
            return None
        forced = replay[:, :, layer].reshape(-1, ids.shape[-1]).to(ids.device)
        ids = torch.where((forced[:, :1] != routing.UNKNOWN), forced, ids)
        return logits, routing.replayed_scores(logits, ids, bool(router.norm_topk_prob)), ids

    handles = [r.register_forward_hook(functools.partial(hook, i)) for i, r in enumerate(routers)]
    try:
        yield chosen
    finally:
        for handle in handles:
            handle.remove()


def own_routing(chosen: list[torch.Tensor | None], batch: int, positions: int) -> torch.Tensor:
    """What :func:`routed` recorded, as [batch, positions, layers, top_k]."""
    if any(c is None for c in chosen):
        raise RuntimeError("an MoE router did not run in the forward")
    return torch.stack([c for c in chosen if c is not None], dim=1).view(batch, positions, len(chosen), -1)
