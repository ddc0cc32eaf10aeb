"""The emulated FP8 experts of a mixture-of-experts layer (transformers' fused Qwen3-MoE experts): each
expert's gate_up and down GEMMs quantize as a dense FP8 linear of that expert's 2-D weight slice
(checked GEMM by GEMM against float64 over operands quantized by the numpy reference of
tests/unit/test_quant.py), the weight codes the forward uses are the WeightSet's per-expert codes bit for
bit, the router is untouched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fp8rl import quant
from fp8rl.architectures import expert_modules
from fp8rl.codec.schema import build_weight_set
from tests.unit.test_fp8_linear import assert_gemm_close, spec_quantized
from trainer_service import fp8_linear as fp8_module
from trainer_service.fp8_linear import EmulatedFP8Experts, convert_linears

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 384, 256, 4, 2, 300


def moe_model(gen: torch.Generator, hidden: int = HIDDEN) -> Any:
    """A one-layer holder of a Qwen3-MoE sparse block at ``model.layers.0.mlp`` (router + fused experts)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=hidden,
        moe_intermediate_size=INTER,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
    )
    layer = torch.nn.Module()
    layer.mlp = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for name, p in layer.mlp.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.01 if name == "gate.weight" else 0.05))
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([layer])
    return root


def tokens(gen: torch.Generator, hidden: int = HIDDEN) -> torch.Tensor:
    """[1, T, H], token magnitudes over four decades (each token's 1x128 scales differ; wider, the
    router's softmax saturates and routing weights, hence dY, go subnormal)."""
    scale = 10.0 ** torch.randint(-2, 2, (1, TOKENS, 1), generator=gen)
    return (torch.randn(1, TOKENS, hidden, generator=gen) * scale).requires_grad_()


def recording(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every fp8_linear call of the experts: its operands and output (gradients retained)."""
    calls: list[dict[str, Any]] = []
    original = fp8_module.fp8_linear

    def record(
        x: torch.Tensor, weight: torch.Tensor, bias: Any = None, scale_format: Any = "fp32"
    ) -> torch.Tensor:
        x.retain_grad()
        y = original(x, weight, bias, scale_format)
        y.retain_grad()
        calls.append({"x": x, "w": weight, "y": y})
        return y

    monkeypatch.setattr(fp8_module, "fp8_linear", record)
    return calls


@pytest.mark.parametrize("scale_format", ["fp32", "pow2"])
def test_each_expert_gemm_quantizes_as_a_dense_fp8_linear(
    scale_format: str, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fprop X 1x128 / W 128x128 per expert, dgrad dY 1x128, wgrad dY and X columnwise over the expert's
    tokens in sequence order; the outputs combined with the router's weights as transformers does."""
    model = moe_model(gen)
    mlp = model.model.layers[0].mlp
    assert convert_linears(model, "emulated", scale_format) == 3 * EXPERTS  # type: ignore[arg-type]
    assert isinstance(mlp.experts, EmulatedFP8Experts)
    calls = recording(monkeypatch)
    x = tokens(gen)
    out = mlp(x)
    dout = torch.randn(out.shape, generator=gen)
    out.backward(dout)

    flat = x.detach()[0]
    _, weights, chosen = mlp.gate(flat)
    hit = sorted(set(chosen.flatten().tolist()))
    assert len(calls) == 2 * len(hit)
    worst = {"fprop": 0.0, "dgrad": 0.0, "wgrad": 0.0}
    want = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64)
    for i, expert in enumerate(hit):
        gate_up, down = calls[2 * i], calls[2 * i + 1]
        token_ids = torch.where((chosen == expert).any(-1))[0]
        assert torch.equal(gate_up["x"].detach(), flat[token_ids])  # (sequence order)
        for call, param in ((gate_up, mlp.experts.gate_up_proj), (down, mlp.experts.down_proj)):
            w, xc, yc = param.detach()[expert], call["x"].detach(), call["y"].detach()
            assert call["w"].data_ptr() == param[expert].data_ptr() and call["w"].shape == w.shape
            wq = spec_quantized(w, 128, 128, scale_format)
            dy, dw = call["y"].grad, param.grad
            assert dw is not None
            fprop = spec_quantized(xc, 1, 128, scale_format) @ wq.t()
            dgrad = spec_quantized(dy, 1, 128, scale_format) @ wq
            wgrad = spec_quantized(dy, 128, 1, scale_format).t() @ spec_quantized(xc, 128, 1, scale_format)
            assert_gemm_close(yc, fprop, xc, w.t())
            assert_gemm_close(call["x"].grad, dgrad, dy, w)
            assert_gemm_close(dw[expert], wgrad, dy.t(), xc)
            for key, got, ref in (
                ("fprop", yc, fprop),
                ("dgrad", call["x"].grad, dgrad),
                ("wgrad", dw[expert], wgrad),
            ):
                worst[key] = max(worst[key], float(((got.double() - ref).abs() / ref.abs().max()).max()))
        slot = (chosen[token_ids] == expert).float().argmax(-1)
        want[token_ids] += down["y"].detach().double() * weights[token_ids, slot, None].double()
    print(f"{scale_format}: max |emulation - float64| / max|float64| per GEMM kind: {worst}")
    torch.testing.assert_close(out.detach()[0].double(), want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    # The quantization is active: transformers' own experts give another output.
    plain = moe_model(torch.Generator().manual_seed(0))
    plain.load_state_dict(model.state_dict())
    assert (plain.model.layers[0].mlp(x.detach()) - out.detach()).abs().max() > 1e-3 * out.abs().max()


@pytest.mark.parametrize("scale_format", ["fp32", "pow2"])
def test_the_forward_computes_with_the_shipped_per_expert_codes(
    scale_format: str, gen: torch.Generator
) -> None:
    """gate_up_proj[e]'s 128x128 blocks (I a multiple of 128) are exactly those of the gate and up weights
    the WeightSet ships for expert e: codes and scales bit for bit, edge blocks (H = 320) included."""
    model = moe_model(gen, hidden=320)
    experts = model.model.layers[0].mlp.experts
    fmt = "fp8-block128-pow2" if scale_format == "pow2" else "fp8-block128"
    ws = build_weight_set(model.state_dict(), fmt, torch.float32).tensors  # type: ignore[arg-type]
    for e in range(EXPERTS):
        prefix = f"model.layers.0.mlp.experts.{e}"
        codes, scales = quant.quantize_blockwise(experts.gate_up_proj.detach()[e], scale_format=scale_format)  # type: ignore[arg-type]
        wire_codes = torch.cat([ws[f"{prefix}.{g}.weight"] for g in ("gate_proj", "up_proj")]).view(
            torch.uint8
        )
        assert torch.equal(codes.view(torch.uint8), wire_codes)
        assert torch.equal(
            scales, torch.cat([ws[f"{prefix}.{g}.weight_scale_inv"] for g in ("gate_proj", "up_proj")])
        )
        used = quant.fake_quantize_weight(experts.down_proj.detach()[e], scale_format=scale_format)  # type: ignore[arg-type]
        name = f"{prefix}.down_proj.weight"
        assert torch.equal(used, quant.dequantize_blockwise(ws[name], ws[name + "_scale_inv"]))


def test_the_router_is_not_converted_and_its_output_is_unchanged(gen: torch.Generator) -> None:
    model = moe_model(gen)
    router = model.model.layers[0].mlp.gate
    x = tokens(gen).detach()[0]
    before = router(x)
    router_class = type(router)
    convert_linears(model, "emulated")
    assert type(router) is router_class
    for got, want in zip(router(x), before, strict=True):
        assert torch.equal(got, want)


def test_experts_the_plan_keeps_stay_transformers_own(gen: torch.Generator) -> None:
    """All of a layer's experts in high precision (bit-identical output) or none; TE refused."""
    model = moe_model(gen)
    mlp = model.model.layers[0].mlp
    x = tokens(gen).detach()
    before = mlp(x)
    kept = set(expert_modules(0, EXPERTS))
    assert convert_linears(model, "emulated", high_precision=kept) == 0
    assert not isinstance(mlp.experts, EmulatedFP8Experts)
    assert torch.equal(mlp(x), before)
    with pytest.raises(ValueError, match="all or none"):
        convert_linears(model, "emulated", high_precision=kept - {"model.layers.0.mlp.experts.2.up_proj"})
    with pytest.raises(NotImplementedError, match="fp8_backend: emulated"):
        convert_linears(model, "te")


def test_the_high_precision_set_is_the_checkpoint_transformers_saves(tmp_path: Path) -> None:
    """The per-expert split (gate = rows [0, I), up = rows [I, 2I)) is transformers' own: under a
    high-precision format the set has exactly the names and values of ``save_pretrained``'s checkpoint,
    the per-expert layout vLLM loads at version 0."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_experts=3,
        num_experts_per_tok=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=2,
        vocab_size=64,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    sent = build_weight_set(dict(model.named_parameters()), "bf16", torch.float32).tensors
    assert "model.layers.1.mlp.experts.2.up_proj.weight" in saved
    assert set(sent) == set(saved)
    assert all(torch.equal(sent[name], saved[name]) for name in saved)


def test_a_router_that_is_a_linear_is_never_converted() -> None:
    """Qwen2-MoE's shared-expert gate is an ``nn.Linear``: by its exact name it stays as it is, while
    the shared expert's own ``gate_proj`` (a prefix match would catch it) is an FP8 linear."""
    mlp = torch.nn.Module()
    mlp.shared_expert_gate = torch.nn.Linear(256, 1, bias=False)
    mlp.shared_expert = torch.nn.Module()
    mlp.shared_expert.gate_proj = torch.nn.Linear(256, 256, bias=False)
    layer = torch.nn.Module()
    layer.mlp = mlp
    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList([layer])
    assert convert_linears(root, "emulated") == 1
    assert type(mlp.shared_expert_gate) is torch.nn.Linear
    assert isinstance(mlp.shared_expert.gate_proj, fp8_module.EmulatedFP8Linear)
