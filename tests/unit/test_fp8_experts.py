"""The emulated FP8 experts of a mixture-of-experts layer (transformers' fused Qwen3-MoE experts): each
expert's gate_up and down GEMMs quantize as a dense FP8 linear of that expert's 2-D weight slice
(checked GEMM by GEMM against float64 over operands quantized by the numpy reference of
tests/unit/test_quant.py), the weight codes the forward uses are the WeightSet's per-expert codes bit for
bit, the router is untouched. Under ``te`` (te.GroupedLinear over the fused parameters' expert slices):
the routing, padding and combining around the grouped GEMM, with the emulation in TE's place, give the
emulated experts' results; what is refused, and why; and, on CUDA, TE's experts against the emulated
ones."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from fp8rl import quant
from fp8rl.architectures import expert_modules
from fp8rl.codec.schema import build_weight_set
from tests.unit.test_fp8_linear import assert_gemm_close, spec_quantized
from trainer_service import fp8_linear as fp8_module
from trainer_service.fp8_linear import (
    TE_ROW_MULTIPLE,
    EmulatedFP8Experts,
    TEFP8Experts,
    convert_linears,
    expert_rows,
    fp8_linear,
    te_experts_refusal,
)

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
    assert convert_linears(model, "te", high_precision=kept) == 0  # (no Transformer Engine needed)
    assert not isinstance(mlp.experts, TEFP8Experts)


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


def test_expert_rows_group_each_experts_tokens_in_sequence_order_then_padding() -> None:
    """Rows expert by expert, each expert's tokens ascending (the emulation's order, hence its wgrad
    groups), padded with the zero row T to multiples of 16; an expert nobody chose has 0 rows; a slot
    marked E (transformers' dropped slot) is skipped."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    experts, t, k = 6, 75, 2
    index = torch.stack([torch.randperm(experts - 1, generator=g)[:k] for _ in range(t)])  # expert 5: none
    index[3, 1] = experts
    rows, slots, splits = expert_rows(index, experts, TE_ROW_MULTIPLE)
    assert len(splits) == experts and sum(splits) == len(rows) == len(slots)
    assert all(n % TE_ROW_MULTIPLE == 0 for n in splits) and splits[-1] == 0
    start = 0
    for e, n in enumerate(splits):
        want = torch.where((index == e).any(-1))[0]
        block, block_slots = rows[start : start + n], slots[start : start + n]
        assert n == -(-len(want) // TE_ROW_MULTIPLE) * TE_ROW_MULTIPLE
        assert torch.equal(block[: len(want)], want)
        assert torch.equal(index[want, block_slots[: len(want)]], torch.full_like(want, e))
        assert (block[len(want) :] == t).all() and (block_slots[len(want) :] == 0).all()
        start += n
    assert 3 in rows[:start].tolist()  # (token 3 still reaches its other expert)
    empty = expert_rows(torch.full((4, k), experts), experts, TE_ROW_MULTIPLE)
    assert len(empty[0]) == 0 and empty[2] == [0] * experts


def test_what_transformer_engine_cannot_run_is_refused_with_the_reason() -> None:
    assert te_experts_refusal("2.7.0+e9a5fa4e", 2048, 768) is None
    assert te_experts_refusal("2.3.0.dev0", 4096, 1536) is None
    assert te_experts_refusal("2.10.1", 384, 256) is None
    for old in ("2.2.1", "1.13.0", "unknown"):
        assert "older than 2.3 (no Float8BlockScaling)" in str(te_experts_refusal(old, 2048, 768))
    assert "multiples of 16" in str(te_experts_refusal("2.7.0", 2048, 200))
    assert "multiples of 16" in str(te_experts_refusal("2.7.0", 520, 256))


def test_without_transformer_engine_te_experts_are_refused_naming_the_layer(gen: torch.Generator) -> None:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("Transformer Engine imports here")
    model = moe_model(gen)
    experts_class = type(model.model.layers[0].mlp.experts)
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.experts: .*does not import.*use fp8_backend: emulated"
    ):
        convert_linears(model, "te")
    assert type(model.model.layers[0].mlp.experts) is experts_class  # (nothing converted)


class EmulatedGroupedLinear(torch.nn.Module):
    """te.GroupedLinear's interface (weights ``weight0``..``weightE-1``, ``forward(inp, m_splits)``:
    each split of ``inp`` times its weight), computed by the emulation; its parameters on the meta
    device, as the trainer builds TE's."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, scale_format: Any) -> None:
        super().__init__()
        for i in range(num_gemms):
            weight = torch.empty(out_features, in_features, device="meta")
            self.register_parameter(f"weight{i}", torch.nn.Parameter(weight))
        self.scale_format = scale_format

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        splits = enumerate(inp.split(m_splits))
        return torch.cat(
            [fp8_linear(x, getattr(self, f"weight{i}"), None, self.scale_format) for i, x in splits if len(x)]
        )


@pytest.mark.parametrize("scale_format", ["fp32", "pow2"])
def test_te_experts_route_pad_and_combine_as_the_emulated_experts(
    scale_format: str, gen: torch.Generator
) -> None:
    """TEFP8Experts with the emulation in te.GroupedLinear's place: the output, the input's and both fused
    parameters' gradients are the emulated experts' (the zero rows that pad each expert to 16 change no
    scale and add nothing; the fused parameters' expert slices are the grouped GEMM's weights, and their
    gradients reach the fused parameters), and the model's parameters stay transformers' own, so only
    the grouped GEMM itself is left to TE."""
    model = moe_model(gen)
    emulated = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    convert_linears(emulated, "emulated", scale_format)  # type: ignore[arg-type]
    experts = model.model.layers[0].mlp.experts
    experts.__class__ = fp8_module.mixed_class(TEFP8Experts, type(experts))
    experts.te_gemms = (
        EmulatedGroupedLinear(EXPERTS, HIDDEN, 2 * INTER, scale_format),
        EmulatedGroupedLinear(EXPERTS, INTER, HIDDEN, scale_format),
    )
    x = tokens(gen)
    dout = torch.randn(x.shape, generator=gen)
    results = []
    for m in (emulated, model):
        xi = x.detach().clone().requires_grad_()
        out = m.model.layers[0].mlp(xi)
        out.backward(dout)
        mlp = m.model.layers[0].mlp
        results.append([out, xi.grad, mlp.experts.gate_up_proj.grad, mlp.experts.down_proj.grad])
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    assert [n for n, _ in model.named_parameters()] == names
    assert all(
        p.is_meta for gemm in experts.te_gemms for p in gemm.parameters()
    )  # (put back after each call)


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("scale_format", ["fp32", "pow2"])
def test_te_experts_match_the_emulated_experts(
    scale_format: str,
    autocast: bool,
    gen: torch.Generator,
    transformer_engine: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """te.GroupedLinear over the fused parameters' expert slices (CUDA, TE >= 2.3) against the emulated
    experts, the same routed tokens and weights: the model's parameters are still transformers' fused
    ones; TE's weight quantizer gives each expert slice the shipped per-expert codes; each expert's
    gate_up GEMM (identical FP8 operands) lies within the accumulation bound of fp8rl/accumulation.py
    (plus one bf16 rounding of each output under autocast); the output and the gradients of the input
    and both fused parameters within 1e-2 relative (where the two GEMMs' sums differ, the next GEMM's
    input can round to a neighbouring FP8 code), and far from transformers' unquantized experts."""
    from fp8rl.accumulation import gemm_error_bound
    from trainer_service.fp8_linear import fp8_context, te_quantizer

    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    fmt: Any = scale_format
    plain = moe_model(gen).cuda()
    emulated, te_model = copy.deepcopy(plain), copy.deepcopy(plain)
    names = [n for n, _ in plain.named_parameters()]
    assert convert_linears(emulated, "emulated", fmt) == convert_linears(te_model, "te", fmt) == 3 * EXPERTS
    experts = {"emulated": emulated.model.layers[0].mlp.experts, "te": te_model.model.layers[0].mlp.experts}
    assert isinstance(experts["te"], TEFP8Experts)
    assert [n for n, _ in te_model.named_parameters()] == names  # (nothing of TE's joined the model)

    weight_format: Any = "fp8-block128-pow2" if fmt == "pow2" else "fp8-block128"
    shipped = build_weight_set(te_model.state_dict(), weight_format, torch.float32).tensors
    for e in range(EXPERTS):
        prefix = f"model.layers.0.mlp.experts.{e}"
        for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            got = te_quantizer(2, True, fmt)(getattr(experts["te"], fused).detach()[e])
            want = torch.cat(
                [
                    quant.dequantize_blockwise(
                        shipped[f"{prefix}.{p}.weight"], shipped[f"{prefix}.{p}.weight_scale_inv"]
                    )
                    for p in parts
                ]
            )
            assert torch.equal(got.dequantize(dtype=torch.float32).cpu(), want), (e, fused)

    flat = tokens(gen).detach()[0].cuda()
    with torch.no_grad():
        _, weights, chosen = plain.model.layers[0].mlp.gate(flat)
    calls = recording(monkeypatch)
    grouped: list[torch.Tensor] = []
    original = TEFP8Experts.grouped_gemm

    def record(
        self: Any, which: int, weight: torch.Tensor, x: torch.Tensor, splits: list[int]
    ) -> torch.Tensor:
        y = original(self, which, weight, x, splits)
        grouped.append(y.detach())
        return y

    monkeypatch.setattr(TEFP8Experts, "grouped_gemm", record)
    x = {k: flat.clone().requires_grad_() for k in experts}
    out = {}
    dout = torch.randn(flat.shape, generator=gen).cuda()
    for k, module in experts.items():
        with (
            torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast),
            fp8_context("te" if k == "te" else "emulated", fmt),
        ):
            out[k] = module(x[k], chosen, weights)
        out[k].backward(dout)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        unquantized = plain.model.layers[0].mlp.experts(flat, chosen, weights)

    _, _, splits = expert_rows(chosen, EXPERTS, TE_ROW_MULTIPLE)
    hit = sorted(set(chosen.flatten().tolist()))
    starts = [sum(splits[:e]) for e in range(EXPERTS)]
    for i, e in enumerate(hit):
        emulated_y = calls[2 * i]["y"].detach()
        te_y = grouped[0][starts[e] : starts[e] + len(emulated_y)]
        xq = quant.fake_quantize_activation(flat[torch.where((chosen == e).any(-1))[0]], scale_format=fmt)
        wq = quant.fake_quantize_weight(experts["te"].gate_up_proj.detach()[e], scale_format=fmt)
        bound = gemm_error_bound(xq, wq)
        if autocast:
            bound = bound + 2.0**-8 * torch.maximum(te_y.abs(), emulated_y.abs()).double()
        error = (te_y.double() - emulated_y.double()).abs()
        assert (error <= bound).all(), (e, (error / bound).max().item())

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.detach().double(), b.detach().double()
        return ((a - b).norm() / b.norm()).item()

    pairs = {
        "output": (out["te"], out["emulated"]),
        "input grad": (x["te"].grad, x["emulated"].grad),
        "gate_up_proj grad": (experts["te"].gate_up_proj.grad, experts["emulated"].gate_up_proj.grad),
        "down_proj grad": (experts["te"].down_proj.grad, experts["emulated"].down_proj.grad),
    }
    differences = {k: relative(*pair) for k, pair in pairs.items()}  # type: ignore[arg-type]
    print(f"{scale_format} autocast={autocast}: TE against the emulation, relative: {differences}")
    assert all(d < 1e-2 for d in differences.values()), differences
    assert relative(out["emulated"], unquantized) > 1e-3
