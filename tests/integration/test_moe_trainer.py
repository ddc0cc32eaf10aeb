"""The trainer on a Qwen3-MoE checkpoint (random init, SmolLM2's tokenizer, tests/families.py) under the
``fp8`` recipe: one GRPO step runs with every routed expert's GEMMs through the emulated FP8 path, the
router in high precision, and the published set carries the experts per expert under vLLM's names."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fp8rl import quant
from fp8rl.recipes import get_recipe
from fp8rl.sampling import SamplingSettings
from tests.support import trainer_config
from trainer_service import fp8_linear as fp8_module
from trainer_service.fp8_linear import EmulatedFP8Experts
from trainer_service.learner import Learner, SampleData
from trainer_service.publisher import Publisher

EXPERTS, LAYERS = 8, 2


def samples(gen: torch.Generator, count: int = 6) -> list[SampleData]:
    out = []
    for i in range(count):
        prompt = torch.randint(4, 49152, (int(torch.randint(3, 12, (1,), generator=gen)),), generator=gen)
        completion = torch.randint(4, 49152, (int(torch.randint(4, 20, (1,), generator=gen)),), generator=gen)
        logprobs = -torch.rand(len(completion), generator=gen) * 6 - 8  # (about a random model's)
        out.append(
            SampleData(prompt.tolist(), completion.tolist(), logprobs.tolist(), float(i % 2), f"g{i // 3}")
        )
    return out


def test_a_grpo_step_runs_every_expert_gemm_in_fp8(
    qwen3_moe_dir: Path, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = trainer_config(
        qwen3_moe_dir,
        "fp8",
        device="cpu",
        fp8_backend="emulated",
        micro_batch_size=3,
    )
    plan = config.fp8_plan
    assert plan.high_precision == {f"model.layers.{i}.mlp.gate" for i in range(LAYERS)}
    learner = Learner(config, get_recipe("fp8"))
    layers: Any = learner.model.model.layers
    experts = {
        id(p): i
        for i, layer in enumerate(layers)
        for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj)
    }
    assert all(isinstance(layer.mlp.experts, EmulatedFP8Experts) for layer in layers)
    assert not any(isinstance(layer.mlp.gate, torch.nn.Linear) for layer in layers)  # (never converted)

    # Every expert GEMM through fp8_linear: as many calls on expert weights as (router call, expert hit)
    # pairs, two each (gate_up, down).
    counted = {"expert_gemms": 0, "dense_gemms": 0, "hits": 0}
    original = fp8_module.fp8_linear

    def counting(x: torch.Tensor, weight: torch.Tensor, *args: Any) -> torch.Tensor:
        counted["expert_gemms" if id(weight._base) in experts else "dense_gemms"] += 1
        return original(x, weight, *args)

    def routed(module: Any, inputs: Any, output: tuple[torch.Tensor, ...]) -> None:
        counted["hits"] += len(set(output[2].flatten().tolist()))

    monkeypatch.setattr(fp8_module, "fp8_linear", counting)
    for layer in layers:
        layer.mlp.gate.register_forward_hook(routed)
    before = {k: v.clone() for k, v in learner.master_weights().items()}
    metrics = learner.train(samples(gen), SamplingSettings(temperature=1.0))
    print({k: metrics[k] for k in ("loss", "grad_norm", "token_mult_prob_error") if k in metrics}, counted)
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    assert counted["hits"] > 0 and counted["expert_gemms"] == 2 * counted["hits"]
    assert counted["dense_gemms"] > 0  # (q/k/v/o)
    after = learner.master_weights()
    for name in (
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.experts.down_proj",
        "model.layers.0.mlp.gate.weight",
    ):
        assert after[name].shape == before[name].shape and not torch.equal(after[name], before[name]), name

    # The publisher's set: experts per expert under vLLM's names, the codes the trainer computes with.
    built = Publisher("fp8-block128", torch.float32, "fp8", high_precision=plan.high_precision).build(
        learner.published_weights()
    )
    assert built is not None
    sent = built.tensors
    assert not any(".experts.gate_up_proj" in n or ".experts.down_proj" in n for n in sent)
    assert sent["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    gate_up = after["model.layers.1.mlp.experts.gate_up_proj"]
    for e in range(EXPERTS):
        prefix = f"model.layers.1.mlp.experts.{e}"
        wire = torch.cat(
            [
                quant.dequantize_blockwise(
                    sent[f"{prefix}.{g}.weight"], sent[f"{prefix}.{g}.weight_scale_inv"]
                )
                for g in ("gate_proj", "up_proj")
            ]
        )
        assert sent[f"{prefix}.gate_proj.weight"].dtype == torch.float8_e4m3fn
        assert sent[f"{prefix}.down_proj.weight_scale_inv"].shape == (4, 2)  # [512/128, 256/128]
        assert torch.equal(wire, quant.fake_quantize_weight(gate_up[e]))


def own_routing_of(learner: Learner, batch: list[SampleData]) -> list[torch.Tensor]:
    """What the learner's routers choose for every position each sample computes, in the forward the step
    scores routing with: the batch collated as the learner collates it, in one micro-batch, under its FP8
    context. (Each sample alone is another GEMM shape: float32 rounding then flips a near-tie now and
    then, 1 position in 124 once.)"""
    from trainer_service.fp8_linear import fp8_context
    from trainer_service.routing import own_routing, routed

    assert len(batch) <= learner.config.micro_batch_size
    collated = learner.collate(batch)
    with (
        torch.no_grad(),
        learner.autocast(),
        fp8_context(learner.backend, learner.recipe.scale_format),
        routed(learner.routers) as chosen,
    ):
        learner.model(input_ids=collated.input_ids, attention_mask=collated.attention_mask)
    own = own_routing(chosen, *collated.input_ids.shape)
    return [own[i, : len(s.prompt) + len(s.completion) - 1] for i, s in enumerate(batch)]


def test_a_step_measures_routing_mismatch_under_replay(qwen3_moe_dir: Path, gen: torch.Generator) -> None:
    """Samples routed as the trainer routes them: no mismatch; routed elsewhere: nearly all differ (two
    of eight experts: a random pair is the trainer's one time in 28), measured on the routers' own
    choice although replay routes the step as the samples say. (Without replay: tests/e2e/test_moe_run.py.)"""
    import dataclasses

    config = trainer_config(qwen3_moe_dir, "fp8", device="cpu", routing_replay=True)
    learner = Learner(config, get_recipe("fp8"))
    batch = samples(gen, count=4)
    own = own_routing_of(learner, batch)
    agreeing = [dataclasses.replace(s, routed_experts=r) for s, r in zip(batch, own, strict=True)]
    metrics = learner.train(agreeing, SamplingSettings(temperature=1.0))
    assert metrics["routing_mismatch"] == 0 and metrics["routing_mismatch_positions"] == 0

    shuffled = [(r + torch.randint(1, EXPERTS, (*r.shape[:2], 1), generator=gen)) % EXPERTS for r in own]
    moved = [dataclasses.replace(s, routed_experts=r) for s, r in zip(batch, shuffled, strict=True)]
    metrics = learner.train(moved, SamplingSettings(temperature=1.0))
    print(
        {k: metrics[k] for k in ("routing_mismatch", "routing_mismatch_positions", "token_mult_prob_error")}
    )
    assert metrics["routing_mismatch"] > 0.8 and metrics["routing_mismatch_positions"] > 0.8
    assert math.isfinite(metrics["loss"])
