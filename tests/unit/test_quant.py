"""fp8rl.quant against tile-by-tile references written here, bit for bit, on fresh random inputs.

The references compute each engine's documented scale arithmetic with numpy float32 scalars (IEEE
division and reciprocal, one rounding each), independently of the vectorised torch code under test:

* Transformer Engine: ``scale = 448 / amax`` (1 for an all-zero block, FLT_MAX when it overflows; for
  ``pow2`` rounded down to a power of two), ``q = sat(x * scale)``, ``scale_inv = 1 / scale``;
* vLLM (CUDA per-token-group quantizer): ``scale_inv = max(amax, 1e-10) / 448`` (for ``pow2`` rounded
  up to a power of two), ``q = sat(x / scale_inv)``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8rl import quant
from tests import vllm_reference

E4M3 = torch.float8_e4m3fn
F32 = np.float32


def reference_scale(
    amax: np.float32, scale_format: str, arithmetic: str, amax_floor: float = 0.0
) -> tuple[np.float32, np.float32]:
    """(what x is multiplied by, scale_inv) for one tile; ``amax_floor``: TE's ``amax_epsilon``."""
    if arithmetic == "te":
        amax = max(amax, F32(amax_floor))
        scale = F32(1.0) if amax == 0 else F32(448.0) / amax
        if np.isinf(scale):
            scale = np.finfo(F32).max
        if scale_format == "pow2":
            mantissa, exponent = np.frexp(scale)  # scale = mantissa * 2^exponent, mantissa in [0.5, 1)
            scale = F32(np.ldexp(F32(1.0), exponent - 1))
        return scale, F32(1.0) / scale
    scale_inv = max(amax, F32(1e-10)) / F32(448.0)
    if scale_format == "pow2":
        scale_inv = max(scale_inv, F32(1e-10))  # vLLM floors the scale too before rounding it up
        mantissa, exponent = np.frexp(scale_inv)
        scale_inv = scale_inv if mantissa == 0.5 else F32(np.ldexp(F32(1.0), exponent))
    return F32(1.0) / scale_inv, F32(scale_inv)  # (the multiplier is unused for vLLM, which divides)


def reference_quantize(
    x: torch.Tensor,
    rows: int,
    cols: int,
    scale_format: str = "fp32",
    arithmetic: str = "te",
    amax_floor: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each rows x cols tile of a 2-D tensor with one engine's rule, one tile at a time."""
    a = x.float().numpy()
    n, k = a.shape
    nb, kb = math.ceil(n / rows), math.ceil(k / cols)
    scaled = np.empty((n, k), dtype=F32)
    scales = np.empty((nb, kb), dtype=F32)
    with np.errstate(over="ignore", divide="ignore"):
        for i in range(nb):
            for j in range(kb):
                tile = (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
                amax = np.abs(a[tile]).max()
                scale, scales[i, j] = reference_scale(amax, scale_format, arithmetic, amax_floor)
                scaled[tile] = a[tile] * scale if arithmetic == "te" else a[tile] / scales[i, j]
    q = torch.from_numpy(np.clip(scaled, -448.0, 448.0)).to(E4M3)
    return q, torch.from_numpy(scales)


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
def test_dequantized_weight_gives_back_its_codes(shape: tuple[int, int], gen: torch.Generator) -> None:
    """What a replica computes with, dequant(q, s), holds the codes: dividing by the held scales gives
    them back exactly, and so does re-quantizing (whose scales may differ from the held ones by an ulp or
    two, as 1 / (448 / amax) need not round back to the same float)."""
    q, s = quant.quantize_blockwise(random_weight(shape, gen))
    dq = quant.dequantize_blockwise(q, s)
    per_element = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    assert_codes_equal((dq / per_element).to(E4M3), q)
    q2, s2 = quant.quantize_blockwise(dq)
    assert_codes_equal(q2, q)
    assert ((s2 - s).abs() <= s * 2.0**-22).all()  # three roundings: see the activations' round trip


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
    assert_codes_equal(q, q2)
    # The round trip rounds three times (448 * s, 448 / amax, 1 / scale: TE's arithmetic), each within
    # 2**-24 of the value: the scale may move by 1.5 * 2**-23 of itself (seen: seed 3372469919, 17 x 129).
    assert ((s2 - s).abs() <= s * 2.0**-22).all()


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype
    as_int = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(a.view(as_int), b.view(as_int))


def tiles_over_60_decades(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Rows over 60 decades, with a zero row, a subnormal one and one below vLLM's amax floor."""
    x = torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-30, 31, (*shape[:-1], 1), generator=gen)
    flat, k = x.view(-1, shape[-1]), shape[-1]
    flat[0], flat[1], flat[2] = (
        0,
        torch.randn(k, generator=gen) * 1e-41,
        torch.randn(k, generator=gen) * 1e-12,
    )
    return x


@pytest.mark.parametrize("scale_format", ["fp32", "pow2"])
@pytest.mark.parametrize("arithmetic", ["te", "vllm"])
def test_fake_quant_equals_its_dequantized_codes_bit_for_bit(
    scale_format: quant.ScaleFormat, arithmetic: quant.Arithmetic, gen: torch.Generator
) -> None:
    """The fake quantizers (one buffer, in place) give exactly what quantizing and then dequantizing
    gives, for partial tiles, every scale regime, bf16 input, and columnwise tiles (against the
    transposed rowwise ones)."""
    for shape in ((4, 9, 384), (37, 200), (3, 128)):
        x = tiles_over_60_decades(shape, gen)
        for dtype in (torch.float32, torch.bfloat16):
            xd, kept = x.to(dtype), x.to(dtype)
            q, s = quant.quantize_activation(xd, scale_format=scale_format, arithmetic=arithmetic)
            expected = quant.dequantize_activation(q, s, dtype=dtype)
            assert_same_bits(
                quant.fake_quantize_activation(xd, scale_format=scale_format, arithmetic=arithmetic), expected
            )
            if arithmetic == "te" and xd.ndim == 2:
                q, s = quant.quantize_activation(xd.t(), scale_format=scale_format)
                expected = quant.dequantize_activation(q, s, dtype=dtype).t()
                assert_same_bits(quant.fake_quantize_columnwise(xd, scale_format=scale_format), expected)
            assert_same_bits(xd, kept)  # (the input is left as it was: the fake quantizers work on a copy)
    if arithmetic == "vllm":
        return
    w = pow2_test_weight(gen)
    top_code_224 = (slice(384, 512), slice(256, 384))  # (pow2: the fixed point halves its scale)
    w[top_code_224] *= 1.78 / w[top_code_224].abs().max()
    for dtype in (torch.float32, torch.bfloat16):
        q, s = quant.quantize_blockwise(w.to(dtype), scale_format=scale_format)
        expected = quant.dequantize_blockwise(q, s, dtype=dtype)
        assert_same_bits(quant.fake_quantize_weight(w.to(dtype), scale_format=scale_format), expected)
    if scale_format == "pow2":  # (the crafted block was halved: 2^-7 by TE's arithmetic, its codes doubled)
        q, s = quant.quantize_blockwise(w, scale_format=scale_format)
        assert s[3, 2] == 2.0**-8 and q[top_code_224].float().abs().max() == 448
    with quant.nonfinite_passes():  # (NaN and inf make their blocks NaN, of whichever sign bit)
        w[5, 7], w[300, 9] = float("nan"), float("inf")
        q, s = quant.quantize_blockwise(w, scale_format=scale_format)
        fake = quant.fake_quantize_weight(w, scale_format=scale_format)
        torch.testing.assert_close(fake, quant.dequantize_blockwise(q, s), rtol=0, atol=0, equal_nan=True)
        assert fake[:128, :128].isnan().all() and fake[256:384, :128].isnan().all()


FORMATS = ["fp32", "pow2"]


@pytest.mark.parametrize("scale_format", FORMATS)
@pytest.mark.parametrize("arithmetic", ["te", "vllm"])
def test_each_engines_arithmetic_is_reproduced_bit_for_bit(
    scale_format: quant.ScaleFormat, arithmetic: quant.Arithmetic, gen: torch.Generator
) -> None:
    """Activations over 60 decades, with zero, tiny (below vLLM's floor, and subnormal) and huge groups."""
    x = torch.randn(64, 384, generator=gen) * 10.0 ** torch.randint(-30, 31, (64, 1), generator=gen).float()
    x[0] = 0
    x[1, :128] = 1e-39
    x[2, 128:] = torch.randn(256, generator=gen) * 1e-11
    x[3, 0] = 3e38
    q, s = quant.quantize_activation(x, scale_format=scale_format, arithmetic=arithmetic)
    rq, rs = reference_quantize(x, 1, 128, scale_format, arithmetic)
    assert torch.equal(s, rs)
    assert_codes_equal(q, rq)


def test_fp32_weight_codes_follow_transformer_engine(gen: torch.Generator) -> None:
    w = random_weight((300, 260), gen)
    w[:128, :128] = 0
    q, s = quant.quantize_blockwise(w)
    rq, rs = reference_quantize(w, 128, 128, "fp32", "te")
    assert torch.equal(s, rs)
    assert_codes_equal(q, rq)


def pow2_test_weight(gen: torch.Generator) -> torch.Tensor:
    """Blocks over 60 decades (some below vLLM's 1e-4 amax floor), a zero block, a subnormal one."""
    w = torch.randn(640, 520, generator=gen) * 10.0 ** torch.randint(-30, 31, (640, 1), generator=gen).float()
    w[:128, :128] = 0
    w[128:256, :128] = torch.randn(128, 128, generator=gen) * 1e-41
    w[256:384, 128:256] *= 1e-6 / w[256:384, 128:256].abs().max()  # (amax 1e-6)
    return w


def test_pow2_weights_are_te_values_with_the_deepgemm_floor(gen: torch.Generator) -> None:
    """pow2 weights hold TE's values with the weight quantizer's amax_epsilon at vLLM's 1e-4 (what the
    trainer's TE computes with, trainer_service/fp8_linear.py), as codes vLLM keeps unchanged."""
    w = pow2_test_weight(gen)
    q, s = quant.quantize_blockwise(w, scale_format="pow2")
    rq, rs = reference_quantize(w, 128, 128, "pow2", "te", amax_floor=quant.DEEPGEMM_AMAX_FLOOR)
    assert torch.equal(quant.dequantize_blockwise(q, s), reference_dequantize(rq, rs, 128, 128))
    assert (s == rs).any() and ((s == rs) | (s == rs / 2)).all()  # halved: blocks whose top code is 224
    assert (s >= 2.0**-22).all()  # ceil_pow2(1e-4 / 448) = 2^-22, the floor's scale


def test_pow2_weights_are_the_fixed_point_of_vllms_requantization(gen: torch.Generator) -> None:
    """vLLM re-quantizes pow2 block weights at load and every refit (tests/vllm_reference.py): what we
    ship comes back byte for byte. TE's codes without the fixed point would not: one block in ~20 has
    its top code at 224 (vLLM halves the scale and doubles the codes: the same values, other bytes), and
    blocks below the 1e-4 floor get a coarser scale (other values)."""
    w = pow2_test_weight(gen)
    q, s = quant.quantize_blockwise(w, scale_format="pow2")
    q_held, s_held = vllm_reference.requantize_ue8m0(q, s)
    assert torch.equal(s_held, s)
    assert_codes_equal(q_held, q)

    # What the fixed point repairs, on TE's codes without it (floor 0):
    rq, rs = reference_quantize(w, 128, 128, "pow2", "te")
    held_q, held_s = vllm_reference.requantize_ue8m0(rq, rs)
    dq_te, dq_held = (reference_dequantize(*t, 128, 128) for t in ((rq, rs), (held_q, held_s)))
    tiny = torch.tensor(
        [
            [w[i : i + 128, j : j + 128].abs().max() < 1e-4 for j in range(0, 520, 128)]
            for i in range(0, 640, 128)
        ]
    )
    assert ((held_s != rs) == (tiny | (held_s == rs / 2))).all()
    values_differ = (dq_te != dq_held).view(-1)
    assert values_differ.any()  # the sub-floor blocks (not the zero block)

    # With block amaxes spread over octaves, one block in ~20 has its top code at 224 (amax * scale in
    # (224, 232]: log2 of the amax's mantissa above 0.95 under TE's rounded-down scale):
    spread = 2.0 ** (torch.rand(40, 1, 8, 1, generator=gen) * 8)
    normal = (torch.randn(40, 128, 8, 128, generator=gen) * 0.02 * spread).reshape(40 * 128, 8 * 128)
    rq, rs = reference_quantize(normal, 128, 128, "pow2", "te")
    halved = (vllm_reference.requantize_ue8m0(rq, rs)[1] == rs / 2).float().mean().item()
    assert 0.01 < halved < 0.12, halved
    q, s = quant.quantize_blockwise(normal, scale_format="pow2")
    assert_codes_equal(vllm_reference.requantize_ue8m0(q, s)[0], q)


def test_vllms_own_requantization_keeps_pow2_weights_byte_for_byte(gen: torch.Generator) -> None:
    """vLLM's own ``per_block_cast_to_fp8(use_ue8m0=True)`` (where vLLM is installed) on what we ship:
    with pow2 the same bytes; the reference of tests/vllm_reference.py equals it; fp32 weights get
    other values (vLLM re-quantizes only under VLLM_USE_DEEP_GEMM_E8M0=1, which pins pow2)."""
    deep_gemm = pytest.importorskip("vllm.utils.deep_gemm")
    w = pow2_test_weight(gen)
    for scale_format in ("pow2", "fp32"):
        q, s = quant.quantize_blockwise(w, scale_format=scale_format)
        shipped = quant.dequantize_blockwise(q, s)
        with torch.compiler.set_stance("force_eager"):
            q_vllm, s_vllm = deep_gemm.per_block_cast_to_fp8(shipped, [128, 128], use_ue8m0=True)
        q_ref, s_ref = vllm_reference.per_block_cast_to_fp8(shipped)
        assert torch.equal(s_vllm, s_ref)
        assert_codes_equal(q_vllm, q_ref)
        if scale_format == "pow2":
            assert torch.equal(s_vllm, s)
            assert_codes_equal(q_vllm, q)
        else:
            assert not torch.equal(quant.dequantize_blockwise(q_vllm, s_vllm), shipped)


def test_the_two_engines_differ_with_fp32_scales(gen: torch.Generator) -> None:
    """The arithmetic matters: on random inputs rounding ties move about 4 codes in ten million, and
    scales differ by an ulp; on values built to sit on a tie (odd multiples of scale_inv between 16 and
    32, where E4M3 steps by 2) the two engines round apart often."""
    x = torch.randn(80_000, 128, generator=gen) * 10.0 ** torch.randint(-4, 5, (80_000, 1), generator=gen)
    q_te, s_te = quant.quantize_activation(x, arithmetic="te")
    q_vllm, s_vllm = quant.quantize_activation(x, arithmetic="vllm")
    assert (q_te.view(torch.uint8) != q_vllm.view(torch.uint8)).sum().item() < 1e-5 * x.numel()
    assert (s_te != s_vllm).float().mean() > 0.05
    assert ((s_te - s_vllm).abs() <= s_te * 2.0**-23).all()

    amax = torch.rand(2000, 1, generator=gen) * 100 + 0.01
    ties = (torch.randint(8, 16, (2000, 127), generator=gen) * 2 + 1).float() * (amax / 448.0)
    tied = torch.cat([amax, ties], dim=1)
    q_te, _ = quant.quantize_activation(tied, arithmetic="te")
    q_vllm, _ = quant.quantize_activation(tied, arithmetic="vllm")
    assert (q_te.view(torch.uint8) != q_vllm.view(torch.uint8)).float().mean() > 0.01
    rq, _ = reference_quantize(tied, 1, 128, "fp32", "vllm")
    assert_codes_equal(q_vllm, rq)


def test_pow2_scales_agree_across_engines_for_every_mantissa() -> None:
    """Every float32 amax in [2^e, 2^(e+1)) for exponents around 448's: TE's rounded-down scale and
    vLLM's rounded-up scale_inv are the same power of two, so the codes are the same."""
    mantissas = torch.arange(0x3F800000, 0x40000000, dtype=torch.int32).view(torch.float32)
    for exponent in (-24, -9, 0, 8, 9, 60):  # (vLLM floors the scale at 1e-10: amax >= 448e-10 > 2^-25)
        amax = (mantissas * 2.0**exponent)[:, None]
        _, s_te = quant._codes_and_scale_inv(amax, amax, "pow2", "te")
        _, s_vllm = quant._codes_and_scale_inv(amax, amax, "pow2", "vllm")
        assert torch.equal(s_te, s_vllm), exponent
        assert (torch.frexp(s_te).mantissa == 0.5).all()


def test_pow2_activation_codes_are_identical_in_trainer_and_rollout(gen: torch.Generator) -> None:
    x = torch.randn(5000, 384, generator=gen) * 10.0 ** torch.randint(-6, 9, (5000, 1), generator=gen).float()
    x[0] = 0
    q_te, s_te = quant.quantize_activation(x, scale_format="pow2", arithmetic="te")
    q_vllm, s_vllm = quant.quantize_activation(x, scale_format="pow2", arithmetic="vllm")
    assert_codes_equal(q_te, q_vllm)
    assert torch.equal(s_te[1:], s_vllm[1:])  # the all-zero row: TE's scale is 1, vLLM's its floor
    assert torch.equal(quant.dequantize_activation(q_te, s_te), quant.dequantize_activation(q_vllm, s_vllm))


def test_pow2_requires_a_known_format() -> None:
    with pytest.raises(ValueError, match="scale format"):
        quant.quantize_activation(torch.ones(2, 128), scale_format="e8m0")  # type: ignore[arg-type]
