"""fp8rl.quant against a block-by-block reference written here, bit for bit, on fresh random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl import quant

E4M3 = torch.float8_e4m3fn


def reference_quantize(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each rows x cols tile of a 2-D tensor with the contract's rule, one tile at a time."""
    x = x.float()
    n, k = x.shape
    nb, kb = math.ceil(n / rows), math.ceil(k / cols)
    q = torch.empty(n, k, dtype=E4M3)
    scales = torch.empty(nb, kb, dtype=torch.float32)
    for i in range(nb):
        for j in range(kb):
            tile = x[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]
            scale = tile.abs().max() / torch.tensor(448.0, dtype=torch.float32)
            if scale == 0:
                scale = torch.tensor(1.0)
            scales[i, j] = scale
            q[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols] = torch.clamp(tile / scale, -448, 448).to(
                E4M3
            )
    return q, scales


def reference_dequantize(q: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
            out[tile] = q[tile].float() * scales[i, j]
    return out


def assert_codes_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype == E4M3
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (
        f"{(a.view(torch.uint8) != b.view(torch.uint8)).sum().item()} codes differ"
    )


SHAPES = [(1, 300), (300, 1), (1, 1), (128, 128), (129, 257), (256, 512), (200, 100), (384, 130)]


def random_weight(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """Normal values whose magnitude varies per row band, so blocks get different scales."""
    w = torch.randn(shape, generator=gen)
    band = 10.0 ** torch.randint(-3, 4, (shape[0], 1), generator=gen).float()
    return w * band


@pytest.mark.parametrize("shape", SHAPES)
def test_weight_quantization_matches_reference(shape: tuple[int, int], gen: torch.Generator) -> None:
    w = random_weight(shape, gen)
    q, s = quant.quantize_blockwise(w)
    rq, rs = reference_quantize(w, 128, 128)
    assert q.shape == w.shape and s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert s.dtype == torch.float32
    assert torch.equal(s, rs)
    assert_codes_equal(q, rq)
    assert torch.equal(quant.dequantize_blockwise(q, s), reference_dequantize(rq, rs, 128, 128))


@pytest.mark.parametrize("magnitude", [1e-30, 1e30, 1e-8, 1.0])
def test_extreme_magnitudes_and_zero_blocks(magnitude: float, gen: torch.Generator) -> None:
    w = torch.randn(260, 300, generator=gen) * magnitude
    w[:128, 128:256] = 0  # one all-zero block
    w[200:, :5] = 0  # a partly zero edge block
    q, s = quant.quantize_blockwise(w)
    rq, rs = reference_quantize(w, 128, 128)
    assert torch.equal(s, rs)
    assert_codes_equal(q, rq)
    assert s[0, 1] == 1.0 and (q[:128, 128:256].float() == 0).all()


def test_bf16_input_quantizes_its_float32_value(gen: torch.Generator) -> None:
    w = torch.randn(130, 260, generator=gen).bfloat16()
    q, s = quant.quantize_blockwise(w)
    rq, rs = reference_quantize(w.float(), 128, 128)
    assert torch.equal(s, rs)
    assert_codes_equal(q, rq)


@pytest.mark.parametrize("shape", SHAPES)
def test_requantizing_dequantized_weight_is_identity(shape: tuple[int, int], gen: torch.Generator) -> None:
    q, s = quant.quantize_blockwise(random_weight(shape, gen))
    q2, s2 = quant.quantize_blockwise(quant.dequantize_blockwise(q, s))
    assert torch.equal(s, s2)
    assert_codes_equal(q, q2)


@pytest.mark.parametrize("shape", SHAPES)
def test_rounding_error_bound_per_element(shape: tuple[int, int], gen: torch.Generator) -> None:
    w = random_weight(shape, gen)
    q, s = quant.quantize_blockwise(w)
    err = (w - quant.dequantize_blockwise(q, s)).abs()
    scale = s.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[: shape[0], : shape[1]]
    normal = w.abs() / scale >= 2.0**-6  # E4M3's smallest normal
    # E4M3 keeps 3 mantissa bits: round-to-nearest errs by at most half a unit in the last place,
    # 2^-4 relative in the normal range and half the subnormal step (2^-10 * scale) below it. The
    # factor (1 + 2^-20) absorbs the float32 rounding of the division and of the dequantizing product.
    slack = 1 + 2.0**-20
    assert (err[normal] <= 2.0**-4 * w.abs()[normal] * slack).all()
    assert (err[~normal] <= 2.0**-10 * scale[~normal] * slack).all()


def test_non_finite_and_bad_shapes_raise() -> None:
    for bad in (float("nan"), float("inf"), -float("inf")):
        w = torch.ones(4, 4)
        w[1, 2] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            quant.quantize_blockwise(w)
        with pytest.raises(ValueError, match="NaN or inf"):
            quant.quantize_activation(w)
    with pytest.raises(ValueError, match="2-D"):
        quant.quantize_blockwise(torch.ones(2, 3, 4))
    q, s = quant.quantize_blockwise(torch.ones(130, 130))
    with pytest.raises(ValueError, match="scale_inv shape"):
        quant.dequantize_blockwise(q, s[:1])


@pytest.mark.parametrize("shape", [(1, 128), (3, 7, 300), (5, 1), (2, 2, 2, 256), (17, 129)])
def test_activation_quantization_matches_reference(shape: tuple[int, ...], gen: torch.Generator) -> None:
    x = (
        torch.randn(shape, generator=gen)
        * 10.0 ** torch.randint(-4, 5, (*shape[:-1], 1), generator=gen).float()
    )
    q, s = quant.quantize_activation(x)
    rows = x.reshape(-1, shape[-1])
    rq, rs = reference_quantize(rows, 1, 128)  # 1 x 128 tiles: per token, groups of 128 along K
    assert s.shape == (*shape[:-1], math.ceil(shape[-1] / 128))
    assert torch.equal(s.reshape(rs.shape), rs)
    assert_codes_equal(q.reshape(rq.shape), rq)
    dq = quant.dequantize_activation(q, s)
    assert torch.equal(dq.reshape(rows.shape), reference_dequantize(rq, rs, 1, 128))
    q2, s2 = quant.quantize_activation(quant.dequantize_activation(q, s))
    assert torch.equal(s, s2)
    assert_codes_equal(q, q2)


def test_fake_quant_keeps_dtype_and_equals_dequantized_codes(gen: torch.Generator) -> None:
    w = torch.randn(256, 384, generator=gen)
    expected = quant.dequantize_blockwise(*quant.quantize_blockwise(w))
    assert torch.equal(quant.fake_quantize_weight(w), expected)
    assert quant.fake_quantize_weight(w.bfloat16()).dtype == torch.bfloat16
    x = torch.randn(4, 9, 384, generator=gen)
    assert torch.equal(
        quant.fake_quantize_activation(x), quant.dequantize_activation(*quant.quantize_activation(x))
    )
    assert quant.fake_quantize_activation(x.bfloat16()).dtype == torch.bfloat16
