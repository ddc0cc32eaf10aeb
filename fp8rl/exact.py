"""Exact consistency: the forward arithmetic that the rollout and the trainer both compute, bit for bit.
Pure torch.

Under ``consistency: exact`` every op of a decoder's forward (linears, attention, norms, rotary
embedding, activation, routing) runs through these functions in both engines, and each is written so
that a token's result depends on that token's inputs alone: not on how many rows a call has, how they
are padded or batched, which BLAS kernel a shape selects, the vector width of the CPU, or the thread
count. The means:

* **Reductions are exact.** Operands are integers on a power-of-two grid per row (and per 128-wide
  group along a GEMM's K), small enough that every partial sum is an integer below 2^53: a float64
  dot product of them is exact in any summation order. High-precision operands keep 23 bits of their
  group's largest value (:func:`fixed_point`); FP8 operands are their E4M3 codes, whose products are
  multiples of 2^-18 far below 2^53. What cannot be exact (adding the scaled groups of a GEMM, the value
  classes of attention) is added in one fixed order.
* **Elementwise math is correctly rounded.** Only IEEE +, -, *, / and sqrt and rounding to integers, one
  torch op each (a fused kernel could contract a*b+c into one FMA on some CPUs): exp, log, sin and cos
  are polynomials here (:func:`exp`; float64, or float32 where the result is no wider), since libm's
  and each SIMD width's differ in the last bit.

The price is a little accuracy against plain float32 (a value far below its group's largest keeps
fewer bits; attention weights are multiples of 2^-21 of the largest) and speed (float64 GEMMs per
K-group); both engines pay it, and neither then computes exactly what the default mode does.
Tensors come in the compute dtype (float32 or bfloat16) and results go back to it, rounded once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fp8rl import quant

GROUP = quant.ACTIVATION_GROUP
"""Columns per group of a GEMM's K: FP8's 1x128 tiles, and the high-precision operands' too."""
EXACT_BITS = 53
"""float64's significand: integers up to 2^53 are exact."""
HIGH_PRECISION_BITS = 23
"""Magnitude bits of a high-precision GEMM operand: 128 products of two such integers stay <= 2^53."""
ATTENTION_P_BITS = 21
"""Attention weights as integer multiples of 2^-21 of the row's largest (which is 1)."""
ATTENTION_V_BITS = 22
"""Magnitude bits of a value vector (per key and head)."""
KEY_CHUNK = 1024
"""Keys per exact P·V sum (absolute positions [0, 1024), [1024, 2048), ...; added in order):
2^21 * 2^22 * 1024 = 2^53."""
ROW_BUDGET_BYTES = 256 * 2**20
"""Largest float64 intermediate a call materializes at once; rows beyond it go in chunks (every row
is independent of the others, so chunking changes nothing)."""


# -- powers of two and fixed point --------------------------------------------------------------------


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """``2 ** exponent`` for integer exponents in [-1022, 1023] (int64), float64, exact: built from its
    bits."""
    return ((exponent.long() + 1023) << 52).view(torch.float64)


def fixed_point(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., n] as integers ``q`` (float64, |q| <= 2^bits) and one power-of-two ``scale`` per row
    [..., 1] with ``x ≈ q * scale``: ``scale = 2^(e - bits)`` where ``2^(e-1) <= amax < 2^e``, ``q =
    round(x / scale)`` (exact scaling, one rounding). An all-zero row has q = 0, scale 2^-bits."""
    x64 = x.double()
    amax = x64.abs().amax(-1, keepdim=True)
    _, e = torch.frexp(amax)
    e = e.long()
    return torch.round(x64 * pow2(bits - e)), pow2(e - bits)


def _groups(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [..., ceil(K/128), 128], zero-padded."""
    k = x.shape[-1]
    padded = -(-k // GROUP) * GROUP
    if padded != k:
        x = torch.nn.functional.pad(x, (0, padded - k))
    return x.reshape(*x.shape[:-1], padded // GROUP, GROUP)


# -- linear layers ------------------------------------------------------------------------------------


class GroupedOperand:
    """One side of an exact GEMM: ``values`` [rows, G, 128] (float64 integers or E4M3 codes) and
    ``scales`` [rows, G] (float64), ``value * scale`` being the operand."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        self.values, self.scales = values, scales

    @classmethod
    def high_precision(cls, x: torch.Tensor) -> GroupedOperand:
        """A high-precision operand [rows, K]: 23-bit fixed point per row and group."""
        q, scale = fixed_point(_groups(x), HIGH_PRECISION_BITS)
        return cls(q, scale.squeeze(-1))

    @classmethod
    def fp8_activation(cls, x: torch.Tensor, scale_format: quant.ScaleFormat) -> GroupedOperand:
        """An FP8 activation [rows, K]: its 1x128 E4M3 codes and FP32 scales (Transformer Engine's
        arithmetic, as the trainer's emulation)."""
        codes, scale_inv = quant.quantize_activation(x.float(), scale_format=scale_format)
        return cls(_groups(codes.double()), scale_inv.double())

    @classmethod
    def fp8_weight(cls, codes: torch.Tensor, scale_inv: torch.Tensor) -> GroupedOperand:
        """An FP8 weight: codes [N, K] (float8_e4m3fn) and its 128x128 block scales [ceil(N/128),
        ceil(K/128)], one scale per row and group."""
        rows = scale_inv.double().repeat_interleave(quant.WEIGHT_BLOCK[0], dim=0)[: codes.shape[0]]
        return cls(_groups(codes.double()), rows)

    def rows(self, index: slice) -> GroupedOperand:
        return GroupedOperand(self.values[index], self.scales[index])


def matmul(x: GroupedOperand, w: GroupedOperand) -> torch.Tensor:
    """``x @ wᵀ`` [M, N] in float64: each group's dot products exactly (float64 sums of integers below
    2^53), then ``x_scale * w_scale * dot`` added group by group, in order."""
    m, groups, _ = x.values.shape
    n = w.values.shape[0]
    weight = w.values.permute(1, 2, 0)  # [G, 128, N]
    out = torch.empty(m, n, dtype=torch.float64, device=x.values.device)
    chunk = max(1, ROW_BUDGET_BYTES // (8 * groups * max(n, 1)))
    for start in range(0, m, chunk):
        part = x.rows(slice(start, start + chunk))
        dots = torch.bmm(part.values.transpose(0, 1), weight)  # [G, rows, N]: exact
        dots.mul_(part.scales.t()[:, :, None]).mul_(w.scales.t()[:, None, :])
        acc = out[start : start + chunk]
        acc.copy_(dots[0])
        for g in range(1, groups):  # (in order: the same additions for every row, whatever the batch)
            acc.add_(dots[g])
    return out


def linear(
    x: torch.Tensor,
    weight: GroupedOperand,
    bias: torch.Tensor | None = None,
    *,
    fp8: quant.ScaleFormat | None,
) -> torch.Tensor:
    """``x`` [..., K] times the prepared ``weight`` [N, K], plus ``bias``, in ``x``'s dtype: ``x`` as an
    FP8 activation in scale format ``fp8``, or in high precision when ``fp8`` is None. The GEMM is
    rounded once to the dtype, then the bias added in it."""
    rows = x.reshape(-1, x.shape[-1])
    operand = GroupedOperand.high_precision(rows) if fp8 is None else GroupedOperand.fp8_activation(rows, fp8)
    y = matmul(operand, weight).to(x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def prepared_weight(
    weight: torch.Tensor, *, fp8: quant.ScaleFormat | None, dtype: torch.dtype
) -> GroupedOperand:
    """A weight [N, K] as :func:`linear` takes it: the trainer's master weight quantized 128x128 (FP8:
    the codes the weight set ships), or in high precision as the compute dtype holds it."""
    if fp8 is None:
        return GroupedOperand.high_precision(weight.detach().to(dtype))
    return GroupedOperand.fp8_weight(*quant.quantize_blockwise(weight.detach().float(), scale_format=fp8))


# -- elementwise math ---------------------------------------------------------------------------------

_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # (fdlibm's split of ln 2: n * _LN2_HI is exact for |n| < 2^32)
_LN2_LO = 1.90821492927058770002e-10
_PIO2_HI = 1.57079632673412561417e00  # (fdlibm's split of pi/2, 33 + 33 + 53 bits)
_PIO2_MID = 6.07710050630396597660e-11
_PIO2_LO = 2.02226624879595063154e-21
_TWO_OVER_PI = 6.36619772367581382433e-01
_SQRT_HALF = 0.7071067811865476


_EXP = {  # dtype: (clamp range, ln 2 in two parts, degree of the polynomial, exponent bias, bits type)
    torch.float64: ((-708.0, 709.0), (_LN2_HI, _LN2_LO), 13, (1023, 52, torch.int64)),
    # (float32's split of ln 2: 0x3f317200 has 16 bits, so n * hi is exact for |n| < 2^8.)
    torch.float32: ((-87.0, 88.0), (0.693145751953125, 1.428606765330187e-06), 7, (127, 23, torch.int32)),
}


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x of float64 or float32 ``x``, clamped to normal results (float64: [-708, 709]; float32: [-87,
    88]), with correctly rounded ops only: ``2^n * e^r`` for ``n = round(x / ln 2)``, ``e^r`` a Taylor
    polynomial (|r| <= 0.35; degree 13 in float64, 7 in float32: errors below the dtype's ulp)."""
    (low, high), (hi, lo), degree, (bias, shift, bits) = _EXP[x.dtype]
    x = x.clamp(low, high)
    n = torch.round(x * _LOG2E)
    r = (x - n * hi) - n * lo
    p = torch.ones_like(r)
    for k in range(degree, 0, -1):
        p.mul_(r).div_(k).add_(1.0)
    return p.mul_(((n.to(bits) + bias) << shift).view(x.dtype))


def log(x: torch.Tensor) -> torch.Tensor:
    """ln x of positive finite float64 ``x``, correctly rounded ops only: ``e ln 2 + 2 atanh(s)`` with
    ``x = m 2^e``, m in [1/sqrt 2, sqrt 2), ``s = (m - 1) / (m + 1)`` (|s| <= 0.172; terms to s^21)."""
    m, e = torch.frexp(x)
    low = m < _SQRT_HALF
    m = torch.where(low, m * 2.0, m)
    e = torch.where(low, e - 1, e).double()
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    t = torch.zeros_like(s)
    for k in range(21, 2, -2):
        t = (t + 1.0 / k) * s2
    return e * _LN2_HI + (e * _LN2_LO + (s + s * t) * 2.0)


def sincos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin x, cos x) of float64 ``x`` (|x| < 2^30), correctly rounded ops only: reduced by multiples of
    pi/2 (three-part Cody-Waite), then Taylor polynomials on |r| <= pi/4 (errors below 1e-19)."""
    k = torch.round(x * _TWO_OVER_PI)
    r = ((x - k * _PIO2_HI) - k * _PIO2_MID) - k * _PIO2_LO
    r2 = r * r
    s = torch.zeros_like(r)
    for n in range(17, 2, -2):  # sin r = r (1 - r^2/3! (1 - r^2/(4*5) (1 - ...)))
        s = (1.0 - s) * r2 / (n * (n - 1))
    sin_r = r - r * s
    c = torch.zeros_like(r)
    for n in range(18, 1, -2):
        c = (1.0 - c) * r2 / (n * (n - 1))
    cos_r = 1.0 - c
    quadrant = (k.long() % 4).unsqueeze(0)
    sin = torch.stack([sin_r, cos_r, -sin_r, -cos_r]).gather(0, quadrant).squeeze(0)
    cos = torch.stack([cos_r, -sin_r, -cos_r, sin_r]).gather(0, quadrant).squeeze(0)
    return sin, cos


# -- the decoder's ops ---------------------------------------------------------------------------------


def _bits_for(length: int) -> int:
    """Magnitude bits of integers whose squares summed over ``length`` stay <= 2^53."""
    return (EXACT_BITS - math.ceil(math.log2(max(length, 2)))) // 2


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, in ``x``'s dtype: the sum of squares
    exact (fixed point), the rest in float64, rounded once before the weight's multiply (in the dtype)."""
    q, scale = fixed_point(x, _bits_for(x.shape[-1]))
    variance = (q * q).sum(-1, keepdim=True) * (scale * scale) / x.shape[-1]
    normed = (x.double() * (1.0 / torch.sqrt(variance + eps))).to(x.dtype)
    return weight.to(x.dtype) * normed


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x / (1 + e^-x)`` in float32 (float64 for a float64 ``x``), rounded once to ``x``'s dtype."""
    wide = x.double() if x.dtype == torch.float64 else x.float()
    return (wide / (exp(-wide) + 1.0)).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [..., 2d] gate and up: ``silu(gate) * up`` (vLLM's layout)."""
    gate, up = x.chunk(2, dim=-1)
    return silu(gate) * up


def rope_inv_freq(head_dim: int, parameters: Mapping[str, Any]) -> torch.Tensor:
    """The rotary frequencies [head_dim / 2] (float64) of an HF config's ``rope_parameters``: ``default``
    (``base^(-2i/d)``) or ``llama3`` (Llama 3.1's: long wavelengths divided by the factor, a smooth
    blend between). Others are refused: exact mode does not implement them."""
    rope_type = parameters.get("rope_type", "default")
    base = torch.tensor(float(parameters["rope_theta"]), dtype=torch.float64)
    i = torch.arange(0, head_dim, 2, dtype=torch.float64)
    inv_freq = exp(-(i / head_dim) * log(base))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"consistency exact: rope_type {rope_type!r} is not supported (default, llama3)")
    factor = float(parameters["factor"])
    low, high = float(parameters["low_freq_factor"]), float(parameters["high_freq_factor"])
    original = float(parameters["original_max_position_embeddings"])
    wavelen = (2.0 * math.pi) / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1.0 - smooth) * (inv_freq / factor) + smooth * inv_freq
    out = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    middle = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(middle, blended, out)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [*positions.shape, head_dim / 2] of each position's angles, rounded once to ``dtype``."""
    sin, cos = sincos(positions.double()[..., None] * inv_freq)
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [..., head_dim] rotated by half-split (NeoX) pairs: ``(x1 cos - x2 sin, x2 cos + x1 sin)``,
    with ``cos``/``sin`` [..., head_dim / 2] broadcastable; in ``x``'s dtype (transformers'
    ``q * cos + rotate_half(q) * sin`` computes the same roundings)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention, ``query`` [B, H, Lq, D] over ``key``/``value`` [B, KV, Lk, D] (H a multiple of
    KV: query head h reads kv head h // (H / KV)), ``allowed`` [B or 1, 1, Lq, Lk] (bool: which keys each
    query attends to; key j is the token at position j), ``scale`` the softmax scale. Returns [B, H, Lq,
    D] in the query's dtype.

    Scores: the exact dot of fixed-point q and k (23 bits for D <= 128), times their power-of-two
    scales, times ``scale``. Weights: ``e^(s - max)`` as integers of 2^-21 (their sum exact). Output:
    the exact sums of weights times 22-bit fixed-point values, one per value-scale class and key chunk
    (ascending), over the weights' sum. A query with no allowed key gets zeros."""
    b, h, lq, d = query.shape
    per_row = 8 * h * key.shape[2] * (2 + d / max(lq, 1))
    chunk = max(1, int(ROW_BUDGET_BYTES // max(per_row * lq, 1)))
    if b > chunk:  # (rows are independent: a batch in parts computes the same)
        parts = []
        for i in range(0, b, chunk):
            mask = allowed[i : i + chunk] if allowed.shape[0] > 1 else allowed
            parts.append(
                attention(query[i : i + chunk], key[i : i + chunk], value[i : i + chunk], mask, scale)
            )
        return torch.cat(parts)
    kv, lk = key.shape[1], key.shape[2]
    groups = h // kv
    bits = (EXACT_BITS - math.ceil(math.log2(d))) // 2
    qi, qs = fixed_point(query, bits)
    ki, ks = fixed_point(key, bits)
    qi, qs = qi.reshape(b, kv, groups * lq, d), qs.reshape(b, kv, groups * lq, 1)
    dots = qi @ ki.transpose(-1, -2)  # [B, KV, G*Lq, Lk]: exact
    scores = (dots * (qs * ks.transpose(-1, -2))) * scale
    mask = allowed.expand(b, 1, lq, lk).reshape(b, 1, 1, lq, lk).expand(b, kv, groups, lq, lk)
    mask = mask.reshape(b, kv, groups * lq, lk)
    scores = scores.masked_fill(~mask, -math.inf)
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.round(exp((scores - top).float()) * float(2**ATTENTION_P_BITS)).double()
    weights = torch.where(mask, weights, torch.zeros_like(weights))
    total = weights.sum(-1, keepdim=True)  # exact
    vi, vs = fixed_point(value, ATTENTION_V_BITS)  # [B, KV, Lk, D], [B, KV, Lk, 1]
    out = torch.zeros(b, kv, groups * lq, d, dtype=torch.float64, device=query.device)
    for start in range(0, lk, KEY_CHUNK):
        keys = slice(start, start + KEY_CHUNK)
        part_weights, part_values, part_scales = weights[..., keys], vi[:, :, keys], vs[:, :, keys]
        # A class's terms, the others zeroed: on the weights' side where it is the smaller (decoding:
        # a query row or a few against D value columns), else the values'. The same exact sum.
        on_weights = part_weights.shape[-2] < part_values.shape[-1]
        for cls in torch.unique(part_scales).tolist():
            in_class = part_scales == cls  # [B, KV, keys, 1]
            if on_weights:
                total_in_class = torch.where(in_class.transpose(-1, -2), part_weights, 0.0) @ part_values
            else:
                total_in_class = part_weights @ torch.where(in_class, part_values, 0.0)
            out = out + total_in_class * cls  # (an exact integer sum, times a power of 2)
    out = torch.where(total > 0, out / total.clamp(min=1.0), torch.zeros_like(out)) + 0.0
    return out.reshape(b, h, lq, d).to(query.dtype)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A softmax top-k router's choice for ``logits`` [T, E]: the experts of the ``top_k`` largest logits
    (int64 [T, k], largest first) and their weights (float32 [T, k]): each one's softmax over all E
    experts, or with ``renormalize`` over the chosen ones only. Sums run over the columns in order."""
    l64 = logits.double()
    top, ids = l64.topk(top_k, dim=-1)
    largest = top[:, :1]
    terms = exp((top if renormalize else l64) - largest)
    total = terms[:, 0]
    for column in range(1, terms.shape[1]):
        total = total + terms[:, column]
    return (exp(top - largest) / total[:, None]).float(), ids


def moe(
    x: torch.Tensor,
    expert_linear: Callable[[int, int, torch.Tensor], torch.Tensor],
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """Routed SiLU-gated experts on ``x`` [T, H]: for each chosen expert in ascending order, its tokens'
    ``expert_linear(e, 0, x)`` (gate and up, [n, 2I]), SwiGLU, ``expert_linear(e, 1, h)`` (down, [n, H]),
    times the routing weight (``weights``/``ids`` [T, k]), added into the token's row. In ``x``'s dtype."""
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        if expert < 0:
            continue
        tokens, slot = (ids == expert).nonzero(as_tuple=True)
        y = expert_linear(expert, 1, silu_and_mul(expert_linear(expert, 0, x[tokens])))
        out = out.index_add(0, tokens, y * weights[tokens, slot, None].to(x.dtype))
    return out
