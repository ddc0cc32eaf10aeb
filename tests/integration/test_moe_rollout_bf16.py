"""Routed experts (Qwen3-MoE) under the ``bf16`` recipe, in real vLLM on CPU: vLLM's own unquantized
experts, which compute what a float64 reference of their weights computes at load and after every refit
(rollout_service/vllm_fp8.py, RefitUnquantizedMoEMethod: vLLM 0.32 prepacks its CPU experts' weights
at first load only). One engine for the module: the random float32 2-layer Qwen3-MoE of
test_moe_rollout.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.test_moe_rollout import (
    EXPERTS,
    HIDDEN,
    LAYERS,
    ROUTERS,
    _checkpoint,
    _experts,
    _methods,
    assert_routing_recorded,
    expert_name,
    expert_weights,
    moe_engine,
    routed_input,
)


@pytest.fixture(scope="module")
def engine(qwen3_moe_dir: Path) -> Any:
    return moe_engine(qwen3_moe_dir, "bf16")


def _apply(
    worker: Any, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    experts = _experts(worker)[layer]
    with torch.no_grad():
        return experts.quant_method.apply(experts, x, weights, ids, None, None)


def reference_moe(
    tensors: dict[str, torch.Tensor], layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """SiLU-gated experts of HF checkpoint tensors in float64, token by token."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for token, (row, experts) in enumerate(zip(x.double(), ids.tolist(), strict=True)):
        for slot, e in enumerate(experts):
            gate, up, down = (
                tensors[expert_name(layer, e, p)].double() for p in ("gate_proj", "up_proj", "down_proj")
            )
            hidden = torch.nn.functional.silu(gate @ row) * (up @ row)
            out[token] += weights[token, slot].double() * (down @ hidden)
    return out


def assert_experts_compute(engine: Any, tensors: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """Every layer's experts on a random routed input are ``tensors``' SiLU-gated experts within float32
    rounding (measured about 1e-6 of the largest output; unpacked weights read as packed: about 1)."""
    x, weights, ids = routed_input(gen)
    for layer in range(LAYERS):
        got = engine.llm.collective_rpc(_apply, args=(layer, x, weights, ids))[0]
        want = reference_moe(tensors, layer, x, weights, ids)
        error = ((got.double() - want).abs().max() / want.abs().max()).item()
        print(f"layer {layer}: max |vLLM - float64| / max |float64|: {error:.2e}")
        assert got.dtype == torch.float32 and error < 1e-5, (layer, error)


@pytest.mark.slow  # (one engine for the module: about 40 s to start on 2 cores)
def test_unquantized_experts_compute_their_weights_at_load_and_after_refits(
    engine: Any, qwen3_moe_dir: Path, gen: torch.Generator
) -> None:
    base = expert_weights(_checkpoint(qwen3_moe_dir))
    assert_experts_compute(engine, base, gen)
    # The first refit sends version 0's own weights (what a replica gets first); the second new ones.
    for refit in range(2):
        tensors = (
            base if refit == 0 else {n: torch.randn(w.shape, generator=gen) * 0.05 for n, w in base.items()}
        )
        routers = {f"{r}.weight": torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.02 for r in ROUTERS}
        engine.load_weights(tensors | routers)
        assert_experts_compute(engine, tensors, gen)


@pytest.mark.slow  # (one engine for the module: about 40 s to start on 2 cores)
def test_experts_run_vllms_unquantized_method_and_routers_stay_linears(engine: Any) -> None:
    methods = engine.llm.collective_rpc(_methods)[0]
    for layer in range(LAYERS):
        assert methods[f"model.layers.{layer}.mlp.gate"] == "UnquantizedLinearMethod"
        assert methods[f"model.layers.{layer}.mlp.experts.routed_experts"] == "RefitUnquantizedMoEMethod"


@pytest.mark.slow  # (one engine for the module)
def test_routed_experts_are_the_trainers_routing_exactly(engine: Any, qwen3_moe_dir: Path) -> None:
    """float32 in both engines: the rollout routed every position where the trainer's routers route it
    (an off-by-one position, or rows split across the batch's requests wrongly, would differ). The
    engine is refitted to the checkpoint's weights first: other tests leave others in it."""
    engine.load_weights(_checkpoint(qwen3_moe_dir))
    assert assert_routing_recorded(engine, qwen3_moe_dir, fp8=False) == 0
