"""The emulated FP8 linear: forward and gradients against float64 references of the same fake-quant
graph, and weight codes identical to the WeightSet's."""

from __future__ import annotations

import copy

import pytest
import torch

from fp8rl import quant
from fp8rl.weights import build_weight_set
from trainer_service.fp8_linear import EmulatedFP8Linear, convert_linears, fp8_linear


def test_forward_and_gradients_match_float64_reference(gen: torch.Generator) -> None:
    x = torch.randn(3, 5, 384, generator=gen, requires_grad=True)
    w = (torch.randn(256, 384, generator=gen) * 0.05).requires_grad_()
    b = torch.randn(256, generator=gen, requires_grad=True)
    y = fp8_linear(x, w, b)
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy)

    xq = quant.fake_quantize_activation(x.detach()).double()
    wq = quant.fake_quantize_weight(w.detach()).double()
    dyq = quant.fake_quantize_activation(dy).double()
    torch.testing.assert_close(y.double(), xq @ wq.t() + b.detach().double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), dyq @ wq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        w.grad.double(), dyq.reshape(-1, 256).t() @ xq.reshape(-1, 384), rtol=1e-5, atol=1e-4
    )
    torch.testing.assert_close(b.grad.double(), dy.double().sum((0, 1)), rtol=1e-5, atol=1e-5)
    # Quantization is active: a plain linear differs.
    assert (y - torch.nn.functional.linear(x, w, b)).abs().max() > 1e-3


def test_gradients_equal_autograd_of_the_fake_quant_graph(gen: torch.Generator) -> None:
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
    torch.testing.assert_close(we.grad.double(), wr.grad, rtol=1e-5, atol=1e-6)


def test_forward_codes_are_the_weight_set_codes(gen: torch.Generator) -> None:
    from fp8rl.tiny import build_model

    model = build_model(seed=int(torch.randint(0, 1000, (1,), generator=gen)), dtype="float32")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert convert_linears(model, "emulated") == 14
    ws = build_weight_set(state, "fp8-block128", hp_dtype=torch.float32)
    linear = model.model.layers[1].mlp.down_proj
    assert isinstance(linear, EmulatedFP8Linear)
    # What the forward multiplies with is dequant(q(W)); its re-quantization gives back the codes.
    used = quant.fake_quantize_weight(linear.weight.detach())
    codes, scales = quant.quantize_blockwise(used)
    assert torch.equal(
        codes.view(torch.uint8), ws.tensors["model.layers.1.mlp.down_proj.weight"].view(torch.uint8)
    )
    assert torch.equal(scales, ws.tensors["model.layers.1.mlp.down_proj.weight_scale_inv"])
    assert not isinstance(model.lm_head, EmulatedFP8Linear)


@pytest.mark.gpu
def test_te_backend_matches_the_emulation(gen: torch.Generator) -> None:
    """Transformer Engine's Float8BlockScaling linear against the exact emulation (CUDA, TE >= 2.3)."""
    pytest.importorskip("transformer_engine.pytorch")
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
    # TE rounds the scaled values with its own kernels; the results agree to FP8 precision.
    torch.testing.assert_close(y_te.float(), y_emulated.float(), rtol=0.1, atol=0.05)
    y_te.sum().backward()
    y_emulated.sum().backward()
    torch.testing.assert_close(
        te_model.layers[0].weight.grad, emulated.layers[0].weight.grad, rtol=0.1, atol=0.05
    )


@pytest.mark.gpu
def test_te_recipe_has_fp32_scales_whatever_the_environment_said() -> None:
    """TE reads NVTE_FP8_BLOCK_SCALING_FP32_SCALES only at import: the recipe object itself must say
    FP32 scales (power_2_scale False, no amax epsilon) for inputs, weights and gradients."""
    pytest.importorskip("transformer_engine.pytorch")
    from trainer_service.fp8_linear import QUANTIZERS, block_scaling_recipe

    for pow2 in (False, True):
        recipe = block_scaling_recipe(pow2)
        for name in QUANTIZERS:
            assert getattr(recipe, name).power_2_scale is pow2 and getattr(recipe, name).amax_epsilon == 0.0
    recipe = block_scaling_recipe()
    assert (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim, recipe.grad_block_scaling_dim) == (
        1,
        2,
        1,
    )
