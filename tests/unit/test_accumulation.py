"""The FP8 GEMM error bound of fp8rl/accumulation.py against a model of the hardware it describes: a
float64 simulation of an accumulator that keeps 14 significant bits, truncating, per MMA of 32 products,
promoted every 128. The bound must hold for it, must not be vacuous, and must catch a misplaced scale."""

from __future__ import annotations

import pytest
import torch

from fp8rl import accumulation, quant


def truncating_gemm(
    a: torch.Tensor, b: torch.Tensor, bits: int = 14, chunk: int = 128, mma_k: int = 32
) -> torch.Tensor:
    """``a @ b.T`` as the model of fp8rl/accumulation.py computes it: per MMA, the accumulator and the
    products aligned to the largest exponent among them and cut toward zero to ``bits`` significant bits
    (then summed exactly: they share one grid), the chunk's sum promoted into an exact accumulator."""
    a64, b64 = a.double(), b.double()
    out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64)
    for start in range(0, a.shape[1], chunk):
        products = a64[:, None, start : start + chunk] * b64[None, :, start : start + chunk]
        partial = torch.zeros_like(out)
        for g in range(0, products.shape[-1], mma_k):
            values = torch.cat([partial[..., None], products[..., g : g + mma_k]], dim=-1)
            top = values.abs().amax(-1, keepdim=True)
            exponent = torch.floor(torch.log2(torch.where(top > 0, top, 1.0)))
            unit = 2.0 ** (exponent + 1 - bits)
            partial = (torch.trunc(values / unit) * unit).sum(-1)
        out += partial
    return out


def fp8_operands(m: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized FP8 operands: activations over decades per token, weights ~0.02 (blockwise)."""
    x = torch.randn(m, k, generator=gen) * 10.0 ** torch.randint(-2, 3, (m, 1), generator=gen).float()
    w = torch.randn(n, k, generator=gen) * 0.02
    return quant.fake_quantize_activation(x), quant.fake_quantize_weight(w)


@pytest.mark.parametrize("shape", [(32, 128, 512), (17, 130, 300), (8, 256, 1024)])
def test_a_14_bit_accumulator_stays_within_the_bound(
    shape: tuple[int, int, int], gen: torch.Generator
) -> None:
    a, b = fp8_operands(*shape, gen)
    exact = a.double() @ b.double().t()
    bound = accumulation.gemm_error_bound(a, b)
    ratio = (truncating_gemm(a, b) - exact).abs() / bound
    assert ratio.max() <= 1, ratio.max()
    assert ratio.max() > 1e-3, ratio.max()  # (the bound is loose, not vacuous)
    # Exact-FP32 accumulation sits far inside it: FP32's unit roundoff is 2^-24, the model's 2^-13.
    fp32 = sum(a[:, s : s + 128] @ b[:, s : s + 128].t() for s in range(0, shape[2], 128))
    assert ((fp32.double() - exact).abs() <= bound * 2.0**-6).all()
    # And the expectation that each 128-product chunk is exact in float32 (what tests/unit/test_quant_gpu.py
    # assumed, with rtol = atol = 1e-5) fails under the 14-bit model.
    assert ((truncating_gemm(a, b) - exact).abs() > 1e-5 + 1e-5 * exact.abs()).any()


def test_a_misplaced_scale_exceeds_the_bound(gen: torch.Generator) -> None:
    """One 128x128 weight block dequantized with its neighbour's scale: the outputs it feeds move far
    beyond the bound (not the others), so a layout error in a scaled GEMM cannot pass as accumulation
    error."""
    x = torch.randn(16, 512, generator=gen)
    w = torch.randn(256, 512, generator=gen) * 0.02
    w[:, 128:256] *= 3  # (so the two blocks' scales differ)
    a = quant.fake_quantize_activation(x)
    q, s = quant.quantize_blockwise(w)
    b = quant.dequantize_blockwise(q, s)
    s_wrong = s.clone()
    s_wrong[0, 1] = s[0, 0]
    wrong = a.double() @ quant.dequantize_blockwise(q, s_wrong).double().t()
    exceeded = (wrong - a.double() @ b.double().t()).abs() > accumulation.gemm_error_bound(a, b)
    # (An output whose 128 products happen to cancel moves little: nearly all, not all, exceed.)
    assert exceeded[:, :128].float().mean() > 0.9 and not exceeded[:, 128:].any()
