"""The emulated FP8 linear: each GEMM's operands quantized as Transformer Engine's Float8BlockScaling
quantizes them, checked against float64 GEMMs over operands quantized tile by tile by the reference of
tests/unit/test_quant.py; weight codes identical to the WeightSet's; with pow2 scales, the trainer's forward
bit-identical to the rollout's."""

from __future__ import annotations

import copy

import pytest
import torch

from fp8rl import quant
from fp8rl.codec.schema import build_weight_set
from tests.unit.test_quant import reference_dequantize, reference_quantize
from trainer_service.fp8_linear import EmulatedFP8Linear, convert_linears, fp8_linear


def spec_quantized(t: torch.Tensor, rows: int, cols: int, scale_format: str = "fp32") -> torch.Tensor:
    """``t`` (2-D) quantized per rows x cols tile with TE's arithmetic, dequantized, in float64."""
    return reference_dequantize(*reference_quantize(t, rows, cols, scale_format), rows, cols).double()


def assert_gemm_close(got: torch.Tensor, want: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``got`` (float32 GEMM) within float32 accumulation error of ``want`` (float64), i.e. a small
    fraction of sum |a||b| per element; one flipped FP8 code would move an element by ~|a||b| / 16."""
    bound = 1e-5 * (a.abs().double() @ b.abs().double())
    assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() / bound).max()


@pytest.mark.parametrize("scale_format", ["fp32", "pow2"])
def test_each_gemm_quantizes_as_transformer_engine(scale_format: str, gen: torch.Generator) -> None:
    """fprop: X 1x128 along K, W 128x128. dgrad: dY 1x128 along N, W 128x128. wgrad: dY and X 128x1,
    i.e. 128 consecutive tokens per feature, re-quantized from high precision. 300 tokens: the last
    columnwise group is partial."""
    x = torch.randn(3, 100, 384, generator=gen, requires_grad=True)
    w = (torch.randn(256, 384, generator=gen) * 0.05).requires_grad_()
    b = torch.randn(256, generator=gen, requires_grad=True)
    y = fp8_linear(x, w, b, scale_format)  # type: ignore[arg-type]
    dy = torch.randn(y.shape, generator=gen) * 10.0 ** torch.randint(-3, 3, (3, 100, 1), generator=gen)
    y.backward(dy)

    x2, dy2 = x.detach().reshape(-1, 384), dy.reshape(-1, 256)
    wq = spec_quantized(w.detach(), 128, 128, scale_format)
    fprop = spec_quantized(x2, 1, 128, scale_format) @ wq.t() + b.detach().double()
    dgrad = spec_quantized(dy2, 1, 128, scale_format) @ wq
    wgrad = spec_quantized(dy2, 128, 1, scale_format).t() @ spec_quantized(x2, 128, 1, scale_format)
    assert_gemm_close(y.reshape(-1, 256) - b.detach(), fprop - b.detach().double(), x2, w.detach().t())
    assert_gemm_close(x.grad.reshape(-1, 384), dgrad, dy2, w.detach())
    assert_gemm_close(w.grad, wgrad, dy2.t(), x2)
    assert_gemm_close(b.grad[None], dy2.double().sum(0)[None], torch.ones(1, 300), dy2)

    # Each quantization is active: a plain linear differs, and so does a wgrad over row-quantized
    # operands (what the emulation computed before it followed TE).
    assert (y - torch.nn.functional.linear(x, w, b)).abs().max() > 1e-3
    # With fp32 scales they differ by ~5% on random inputs. (With pow2 scales, E4M3 rounding is the same
    # under any power-of-two scale, so the layout matters only where small values underflow.)
    if scale_format == "fp32":
        xs, dys = torch.randn(256, 384, generator=gen), torch.randn(256, 256, generator=gen)
        columnwise = spec_quantized(dys, 128, 1).t() @ spec_quantized(xs, 128, 1)
        rowwise = spec_quantized(dys, 1, 128).t() @ spec_quantized(xs, 1, 128)
        assert (rowwise - columnwise).norm() > 0.02 * columnwise.norm()


def test_scales_apply_in_float32_and_the_output_rounds_once(gen: torch.Generator) -> None:
    """As TE's GEMMs do (FP32 scales applied to an FP32 accumulator, the output cast once), the emulation
    multiplies the dequantized operands in float32 under bf16 autocast: casting them to bf16 first, as it
    did, rounds every value a second time (fp32 scales make them 4 + 24 bit products)."""
    x = torch.randn(64, 384, generator=gen, requires_grad=True)
    w = (torch.randn(256, 384, generator=gen) * 0.05).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(x, w)
    dy = torch.randn(64, 256, generator=gen).bfloat16()
    y.backward(dy)
    xq, wq = quant.fake_quantize_activation(x.detach()), quant.fake_quantize_weight(w.detach())
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (xq @ wq.t()).bfloat16())
    assert not torch.equal(y, (xq.bfloat16().float() @ wq.bfloat16().float().t()).bfloat16())
    assert torch.equal(x.grad, (quant.fake_quantize_activation(dy.float()) @ wq).bfloat16().float())
    dw = quant.fake_quantize_columnwise(dy.float()).t() @ quant.fake_quantize_columnwise(x.detach())
    assert w.grad.dtype == torch.float32 and torch.equal(w.grad, dw)


@pytest.fixture
def columnwise(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A 1 for every columnwise quantization (wgrad's operands) from here on."""
    calls: list[int] = []
    spied = quant.fake_quantize_columnwise
    monkeypatch.setattr(quant, "fake_quantize_columnwise", lambda *a, **k: calls.append(1) or spied(*a, **k))
    return calls


def test_scoring_without_grad_is_the_same_forward_and_quantizes_no_wgrad_operand(
    gen: torch.Generator, columnwise: list[int]
) -> None:
    """The learner scores under no_grad: the same outputs, bit for bit, as the training forward (float32
    and under bf16 autocast, partial 1x128 groups), and no columnwise quantization of X (an autograd
    function's needs_input_grad follows requires_grad, not grad mode: a weight that requires grad asked
    for wgrad's operand in a pass that has no backward)."""
    x = torch.randn(3, 50, 320, generator=gen)
    w = (torch.randn(256, 320, generator=gen) * 0.05).requires_grad_()
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            trained = fp8_linear(x, w)
            assert columnwise == [1] and trained.requires_grad
            with torch.no_grad():
                scored = fp8_linear(x, w)
        assert columnwise == [1] and not scored.requires_grad
        assert scored.dtype == trained.dtype and torch.equal(scored, trained.detach())
        columnwise.clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_mode_scoring_is_the_same_forward_too(
    dtype: torch.dtype, gen: torch.Generator, columnwise: list[int]
) -> None:
    """The same for exact mode's linear (its scoring pass runs with more than one mini-batch)."""
    from trainer_service.exact import exact_linear

    x = torch.randn(3, 50, 320, generator=gen)
    w = (torch.randn(256, 320, generator=gen) * 0.05).requires_grad_()
    b = torch.randn(256, generator=gen).requires_grad_()
    trained = exact_linear(x, w, b, "fp32", dtype)
    with torch.no_grad():
        scored = exact_linear(x, w, b, "fp32", dtype)
    assert columnwise == [1] and trained.requires_grad and not scored.requires_grad
    assert scored.dtype == trained.dtype == dtype and torch.equal(scored, trained.detach())


def test_wgrad_groups_follow_the_token_layout(gen: torch.Generator) -> None:
    """wgrad quantizes 128 consecutive tokens of the flattened batch per feature, padding included (TE
    sees the padded batch): the same sequences padded to 16 positions, as the learner pads for TE and for
    the emulation, give another dW than unpadded, although the padding's dY is zero."""
    x = torch.randn(8, 23, 256, generator=gen) * 10.0 ** torch.randint(-2, 3, (8, 23, 1), generator=gen)
    dy = torch.randn(8, 23, 128, generator=gen) * 10.0 ** torch.randint(-2, 3, (8, 23, 1), generator=gen)
    w = torch.randn(128, 256, generator=gen) * 0.05
    grads = []
    for length in (23, 32):  # 184 tokens in two groups, 6 sequences in the first; or 256, 4 in each
        xp = torch.cat([x, torch.randn(8, length - 23, 256, generator=gen)], 1).requires_grad_()
        wp = w.clone().requires_grad_()
        fp8_linear(xp, wp).backward(torch.cat([dy, torch.zeros(8, length - 23, 128)], 1))
        grads.append(wp.grad)
    assert not torch.equal(grads[0], grads[1])
    assert (grads[0] - grads[1]).norm() < 0.1 * grads[0].norm()  # (both FP8 estimates of one dW)


def test_dgrad_equals_autograd_of_the_fake_quant_graph(gen: torch.Generator) -> None:
    """Autograd through fq(x), fq(w) with straight-through quantizers and dY quantized by a hook."""
    x = torch.randn(4, 256, generator=gen, dtype=torch.float64)
    w = torch.randn(128, 256, generator=gen, dtype=torch.float64) * 0.1
    dy = torch.randn(4, 128, generator=gen, dtype=torch.float64)

    def ste(t: torch.Tensor, fq) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return t + (fq(t.detach()) - t.detach())

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = torch.nn.functional.linear(
        ste(xr, quant.fake_quantize_activation), ste(wr, quant.fake_quantize_weight)
    )
    y.register_hook(quant.fake_quantize_activation)
    y.backward(dy)

    xe, we = x.float().requires_grad_(), w.float().requires_grad_()
    fp8_linear(xe, we).backward(dy.float())
    torch.testing.assert_close(xe.grad.double(), xr.grad, rtol=1e-5, atol=1e-6)


def test_pow2_forward_is_bit_identical_to_the_rollouts(gen: torch.Generator) -> None:
    """The rollout emulation multiplies its activations, quantized with vLLM's arithmetic, by the shipped
    weight. With pow2 scales that is the trainer's forward bit for bit; with fp32 scales rounding ties
    make the odd code differ."""
    from rollout_service.vllm_fp8 import EmulatedBlockFP8LinearMethod

    x = torch.randn(64, 384, generator=gen) * 10.0 ** torch.randint(-3, 4, (64, 1), generator=gen)
    w = torch.randn(256, 384, generator=gen) * 0.05
    for scale_format in ("pow2", "fp32"):
        shipped = build_weight_set(
            {"model.layers.0.mlp.up_proj.weight": w},
            f"fp8-block128-{scale_format}".replace("-fp32", ""),
            torch.float32,
        )  # type: ignore[arg-type]
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(
            quant.dequantize_blockwise(
                shipped.tensors["model.layers.0.mlp.up_proj.weight"],
                shipped.tensors["model.layers.0.mlp.up_proj.weight_scale_inv"],
            ),
            requires_grad=False,
        )
        rollout = EmulatedBlockFP8LinearMethod(scale_format).apply(layer, x)  # type: ignore[arg-type]
        trainer = fp8_linear(x, w, None, scale_format)  # type: ignore[arg-type]
        if scale_format == "pow2":
            assert torch.equal(rollout, trainer)
        else:
            torch.testing.assert_close(rollout, trainer, rtol=1e-2, atol=1e-3)


def test_forward_codes_are_the_weight_set_codes(gen: torch.Generator) -> None:
    from fp8rl.tiny import build_model

    model = build_model(seed=int(torch.randint(0, 1000, (1,), generator=gen)), dtype="float32")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert convert_linears(model, "emulated") == 14
    ws = build_weight_set(state, "fp8-block128", hp_dtype=torch.float32)
    linear = model.model.layers[1].mlp.down_proj
    assert isinstance(linear, EmulatedFP8Linear)
    # What the forward multiplies with is exactly the shipped codes times the shipped scales.
    used = quant.fake_quantize_weight(linear.weight.detach())
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(used, quant.dequantize_blockwise(ws.tensors[name], ws.tensors[name + "_scale_inv"]))
    assert not isinstance(model.lm_head, EmulatedFP8Linear)


@pytest.mark.gpu
def test_te_backend_matches_the_emulation(gen: torch.Generator, transformer_engine: object) -> None:
    """Transformer Engine's Float8BlockScaling linear against the exact emulation (CUDA, TE >= 2.3):
    the same FP8 operands (TE's quantizers equal fp8rl.quant: tests/unit/test_quant_gpu.py), the scales
    applied in FP32 by both, so fprop and wgrad differ only by the tensor cores' accumulation."""
    from fp8rl.accumulation import gemm_error_bound
    from trainer_service.fp8_linear import fp8_context

    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    emulated = torch.nn.Module()
    emulated.layers = torch.nn.ModuleList([torch.nn.Linear(512, 256)]).cuda()  # a "block linear"
    te_model = copy.deepcopy(emulated)
    assert convert_linears(emulated, "emulated") == 1 and convert_linears(te_model, "te") == 1
    x = torch.randn(32, 512, device="cuda")
    y_emulated = emulated.layers[0](x)
    with fp8_context("te"):
        y_te = te_model.layers[0](x)
    w = emulated.layers[0].weight.detach()
    xq, wq = quant.fake_quantize_activation(x), quant.fake_quantize_weight(w)
    # (The bias adds in FP32 in both; the emulation's own float32 sums sit far inside the bound.)
    bound = gemm_error_bound(xq, wq).to(x.device)
    assert ((y_te.double() - y_emulated.double()).abs() <= bound).all()
    y_te.sum().backward()
    y_emulated.sum().backward()
    dy = torch.ones(32, 256, device="cuda")  # (exact in FP8: one code per group)
    dyc, xc = quant.fake_quantize_columnwise(dy), quant.fake_quantize_columnwise(x)
    wgrad_bound = gemm_error_bound(dyc.t(), xc.t()).to(x.device)
    wgrad_error = (te_model.layers[0].weight.grad.double() - emulated.layers[0].weight.grad.double()).abs()
    assert (wgrad_error <= wgrad_bound).all()


@pytest.mark.gpu
def test_te_recipe_has_fp32_scales_whatever_the_environment_said(transformer_engine: object) -> None:
    """TE reads NVTE_FP8_BLOCK_SCALING_FP32_SCALES only at import: the recipe object itself must say
    FP32 scales (power_2_scale False, no amax epsilon) for inputs, weights and gradients; under pow2
    the weights' amax is floored at vLLM's 1e-4."""
    from trainer_service.fp8_linear import QUANTIZERS, block_scaling_recipe

    for pow2 in (False, True):
        recipe = block_scaling_recipe(pow2)
        for name in QUANTIZERS:
            floor = 1e-4 if pow2 and name == "fp8_quant_fwd_weight" else 0.0
            assert getattr(recipe, name).power_2_scale is pow2 and getattr(recipe, name).amax_epsilon == floor
    recipe = block_scaling_recipe()
    assert (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim, recipe.grad_block_scaling_dim) == (
        1,
        2,
        1,
    )


def test_auto_backend_never_falls_back_to_the_emulation_on_cuda() -> None:
    from trainer_service.fp8_linear import resolve_backend

    assert resolve_backend("auto", cuda=False) == "emulated"
    assert resolve_backend("emulated", cuda=True) == "emulated"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        with pytest.raises(
            RuntimeError, match=r"Transformer Engine cannot be imported.*fp8_backend: emulated"
        ):
            resolve_backend("auto", cuda=True)
    else:
        assert resolve_backend("auto", cuda=True) == "te"
