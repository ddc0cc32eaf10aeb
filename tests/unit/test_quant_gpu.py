"""FP8 numerics on FP8 hardware: our codes on CUDA equal those on CPU, and a real FP8 GEMM over them
(torch._scaled_mm, one 128-wide K slice at a time) lies within the tensor cores' accumulation bound
(fp8rl/accumulation.py) of the float64 product of the dequantized operands. Run on a CUDA host with
scripts/gpu_checks.sh (or, with torch alone, scripts/gpu_proof.py: docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch

from fp8rl import quant
from fp8rl.accumulation import gemm_error_bound

pytestmark = pytest.mark.gpu


def test_cuda_codes_equal_cpu_codes(gen: torch.Generator) -> None:
    w = torch.randn(384, 640, generator=gen)
    for fmt in quant.SCALE_FORMATS:
        q_cpu, s_cpu = quant.quantize_blockwise(w, scale_format=fmt)
        q_gpu, s_gpu = quant.quantize_blockwise(w.cuda(), scale_format=fmt)
        assert torch.equal(s_gpu.cpu(), s_cpu), fmt
        assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8)), fmt
    x = torch.randn(7, 640, generator=gen) * 10.0 ** torch.randint(-6, 7, (7, 1), generator=gen)
    for arithmetic in ("te", "vllm"):  # each engine's arithmetic, each scale format: CUDA = CPU
        for fmt in quant.SCALE_FORMATS:
            qa, sa = quant.quantize_activation(x.cuda(), scale_format=fmt, arithmetic=arithmetic)  # type: ignore[arg-type]
            qa_cpu, sa_cpu = quant.quantize_activation(x, scale_format=fmt, arithmetic=arithmetic)  # type: ignore[arg-type]
            assert torch.equal(sa.cpu(), sa_cpu), (arithmetic, fmt)
            assert torch.equal(qa.cpu().view(torch.uint8), qa_cpu.view(torch.uint8)), (arithmetic, fmt)


def test_a_weight_set_built_on_the_gpu_is_the_cpu_set(gen: torch.Generator) -> None:
    """The publisher quantizes master weights where they live: a CUDA model's set is byte for byte the
    set of the same weights on CPU."""
    from fp8rl.codec.schema import build_weight_set

    state = {
        "model.layers.0.mlp.down_proj.weight": torch.randn(300, 520, generator=gen) * 0.02,
        "model.layers.0.input_layernorm.weight": torch.randn(520, generator=gen),
        "lm_head.weight": torch.randn(64, 520, generator=gen),
    }
    for fmt in ("fp8-block128", "fp8-block128-pow2", "bf16"):
        on_cpu = build_weight_set(state, fmt)  # type: ignore[arg-type]
        on_gpu = build_weight_set({n: t.cuda() for n, t in state.items()}, fmt)  # type: ignore[arg-type]
        assert all(t.device.type == "cpu" for t in on_gpu.tensors.values())
        assert on_gpu.digest == on_cpu.digest, fmt


def test_scaled_mm_over_our_codes_matches_float64(gen: torch.Generator) -> None:
    m, n, k = 64, 256, 512
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.02
    qx, sx = (t.cuda() for t in quant.quantize_activation(x))  # [m, k], [m, k/128]
    qw, sw = (t.cuda() for t in quant.quantize_blockwise(w))  # [n, k], [n/128, k/128]
    one = torch.ones((), device="cuda")
    out = torch.zeros(m, n, device="cuda", dtype=torch.float64)
    for j in range(k // 128):
        cols = slice(j * 128, (j + 1) * 128)
        partial = torch._scaled_mm(
            qx[:, cols].contiguous(),
            qw[:, cols].contiguous().t(),
            scale_a=one,
            scale_b=one,
            out_dtype=torch.float32,
        )
        row_scale = sx[:, j : j + 1].double()
        col_scale = sw[:, j].double().repeat_interleave(128)[None, :n]
        out += partial.double() * row_scale * col_scale
    a = quant.dequantize_activation(qx.cpu(), sx.cpu())
    b = quant.dequantize_blockwise(qw.cpu(), sw.cpu())
    # Not exact in float32: Hopper's FP8 tensor cores keep ~14 bits while they add (DeepSeek-V3), even
    # without fast accumulation; the bound is that model's worst case (fp8rl/accumulation.py).
    error = (out.cpu() - a.double() @ b.double().t()).abs()
    assert (error <= gemm_error_bound(a, b)).all(), (error / gemm_error_bound(a, b)).max()


@pytest.mark.parametrize("scale_format", ["fp32", "pow2"])
def test_transformer_engine_quantizers_give_the_emulations_values(
    scale_format: quant.ScaleFormat, gen: torch.Generator, transformer_engine: object
) -> None:
    """TE's own Float8BlockQuantizer (1x128 rowwise, 1x128 columnwise, 128x128) against fp8rl.quant in
    TE's arithmetic, value for value."""
    from trainer_service.fp8_linear import te_quantizer

    x = (torch.randn(256, 384, generator=gen) * 10.0 ** torch.randint(-3, 4, (256, 1), generator=gen)).cuda()

    def te(dim: int, rowwise: bool) -> torch.Tensor:
        return te_quantizer(dim, rowwise, scale_format)(x).dequantize(dtype=torch.float32)

    assert torch.equal(te(1, True), quant.fake_quantize_activation(x, scale_format=scale_format))
    assert torch.equal(te(2, True), quant.fake_quantize_weight(x, scale_format=scale_format))
    assert torch.equal(te(1, False), quant.fake_quantize_columnwise(x, scale_format=scale_format))
