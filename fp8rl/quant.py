"""The one FP8 implementation every engine uses: DeepSeek-V3 style blockwise E4M3 with FP32 scales.

Weights are scaled per 128x128 block, activations (and gradients) per token in groups of 128 along the
last dimension. Each engine derives a block's scale from its amax with its own float32 arithmetic, and
the emulations mirror them bit for bit (see the contract's tables in docs/fp8-contract.md):

* ``te`` (Transformer Engine, and every weight code we ship): ``scale = 448 / amax``, ``q =
  sat(x * scale)``, ``scale_inv = 1 / scale``; an all-zero block gets ``scale = 1`` and an amax so small
  that the division overflows gets ``scale = FLT_MAX``.
* ``vllm`` (vLLM's per-token-group activation quantizer on CUDA): ``scale_inv = max(amax, 1e-10) /
  448``, ``q = sat(x / scale_inv)``.

The two differ in the last bit of a scale and, through rounding ties, in about 4 codes per 10 million.
With ``scale_format="pow2"`` (UE8M0, DeepGEMM's and MXFP8's format) every scale is a power of two: TE
rounds ``scale`` down to one, vLLM rounds ``scale_inv`` up to ``2^ceil(log2(scale_inv))``; both give the
same power of two for every finite float32 amax, and scaling by it is exact, so the two engines' codes
agree bit for bit (save for groups whose amax is below 448e-10, where vLLM floors the scale at 1e-10).
vLLM's pow2 rounding here is its register kernel's exact one (bf16/fp16 input, groups of 128, the
Hopper path); its shared-memory kernel computes ``exp2f(ceilf(log2f(s)))``, which can round down when
``s`` lies a few ulps above a power of two.

Under ``pow2`` vLLM also re-quantizes every block-FP8 weight it loads (DeepGEMM's E8M0 mode, at load and
at every refit: ``requant_weight_ue8m0_inplace`` -> ``per_block_cast_to_fp8``, ``sf =
2^ceil(log2(max(amax, 1e-4) / 448))`` from the dequantized block). The pow2 weight codes here are that
re-quantization's fixed point, so vLLM holds exactly the bytes shipped: the block amax is floored at
1e-4 (TE's ``amax_epsilon`` on the weight quantizer, :data:`DEEPGEMM_AMAX_FLOOR`), and a block whose
largest code rounds to 224 (``amax * scale`` in (224, 232]) is shipped with doubled codes and half the
scale, which are the same values.

Pure torch: nothing here does I/O, so the rollout, the trainer and the tests share it unchanged, and it
imports nothing but torch (the GPU proof, scripts/gpu_proof.py, runs it on a host with torch alone).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Literal

import torch

from fp8rl.formats import SCALE_FORMATS as SCALE_FORMATS
from fp8rl.formats import ScaleFormat as ScaleFormat

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
WEIGHT_BLOCK = (128, 128)
ACTIVATION_GROUP = 128
VLLM_AMAX_FLOOR = 1e-10
"""The amax floor (``eps``) of vLLM's per-token-group quantizer."""
DEEPGEMM_AMAX_FLOOR = 1e-4
"""The amax floor of vLLM's re-quantization of block-FP8 weights to power-of-two scales (DeepGEMM's
``per_block_cast_to_fp8``); pow2 weights are quantized with it (in TE: the weight quantizer's
``amax_epsilon``)."""

Arithmetic = Literal["te", "vllm"]

CONTRACT_VERSION = "3"
"""Changes whenever the codes of a given weight change (a cached FP8 checkpoint must then be remade)."""


class NonFiniteError(ValueError):
    """A tensor to quantize holds NaN or inf (FP8 has no scale for it)."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


_NONFINITE_PASSES: contextvars.ContextVar[bool] = contextvars.ContextVar("nonfinite_passes", default=False)


@contextlib.contextmanager
def nonfinite_passes() -> Iterator[None]:
    """Within: NaN / inf are quantized to NaN codes rather than refused. A sharded trainer must not raise
    on one rank while the others wait in a collective; the NaN reaches the global gradient norm instead,
    which every rank sees alike."""
    token = _NONFINITE_PASSES.set(True)
    try:
        yield
    finally:
        _NONFINITE_PASSES.reset(token)


def nonfinite_passing() -> bool:
    """Whether :func:`nonfinite_passes` is in force here (an autograd backward saves it from its forward:
    it may run on another thread)."""
    return _NONFINITE_PASSES.get()


def _check_finite(amax: torch.Tensor, what: str) -> None:
    # Checked on the block maxima, which NaN and inf propagate to: a fraction of the cost of checking
    # the input.
    if _NONFINITE_PASSES.get():
        return
    if not torch.isfinite(amax).all():
        raise NonFiniteError(f"{what} contains NaN or inf; FP8 quantization needs finite values")


def round_down_pow2(t: torch.Tensor) -> torch.Tensor:
    """Positive normal float32 values rounded down to powers of two (their mantissa bits cleared)."""
    return (t.view(torch.int32) & 0x7F800000).view(torch.float32)


def round_up_pow2(t: torch.Tensor) -> torch.Tensor:
    """Positive normal float32 values rounded up to powers of two (a power of two stays as it is)."""
    down = round_down_pow2(t)
    return torch.where(down == t, down, down * 2)


def _codes_and_scale_inv(
    blocks: torch.Tensor, amax: torch.Tensor, scale_format: ScaleFormat, arithmetic: Arithmetic
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes of float32 ``blocks`` and their float32 ``scale_inv``, from ``amax`` kept broadcastable
    against ``blocks`` (``keepdim``), with one engine's arithmetic."""
    scaled, scale_inv = _saturated(blocks, amax, scale_format, arithmetic, in_place=False)
    return scaled.to(FP8_DTYPE), scale_inv


def _saturated(
    blocks: torch.Tensor,
    amax: torch.Tensor,
    scale_format: ScaleFormat,
    arithmetic: Arithmetic,
    in_place: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``blocks`` scaled onto E4M3's range with one engine's arithmetic and saturated, still float32 (the
    cast to codes is left to the caller), into ``blocks`` itself if ``in_place``; and the float32
    ``scale_inv``."""
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"unknown scale format {scale_format!r}; expected one of {SCALE_FORMATS}")
    if arithmetic == "te":
        # (``FP8_MAX / amax`` would be ``448 * (1 / amax)`` in torch: two roundings.)
        scale = torch.where(amax == 0, 1.0, torch.full_like(amax, FP8_MAX) / amax)
        scale = torch.where(torch.isinf(scale), torch.finfo(torch.float32).max, scale)
        if scale_format == "pow2":
            scale = round_down_pow2(scale)
        scaled = blocks.mul_(scale) if in_place else blocks * scale
        return scaled.clamp_(-FP8_MAX, FP8_MAX), torch.reciprocal(scale)
    if arithmetic == "vllm":
        # (A true division: on CUDA, tensor / Python scalar multiplies by its reciprocal, rounding twice.)
        scale_inv = amax.clamp(min=VLLM_AMAX_FLOOR) / torch.full_like(amax, FP8_MAX)
        if scale_format == "pow2":  # 2^ceil(log2(max(s, 1e-10))), exactly: round down, then up unless exact
            scale_inv = round_up_pow2(scale_inv.clamp(min=VLLM_AMAX_FLOOR))
        scaled = blocks.div_(scale_inv) if in_place else blocks / scale_inv
        return scaled.clamp_(-FP8_MAX, FP8_MAX), scale_inv
    raise ValueError(f"unknown arithmetic {arithmetic!r}; expected te or vllm")


def _fake_quantize_in_place(
    tiles: torch.Tensor,
    dims: int | tuple[int, ...],
    scale_format: ScaleFormat,
    arithmetic: Arithmetic,
    what: str,
    amax_floor: float = 0.0,
) -> torch.Tensor:
    """Float32 ``tiles`` (a tile spans ``dims``) replaced by their dequantized FP8 codes: the values
    quantizing and then dequantizing give, bit for bit, written over the one buffer rather than into
    three new ones (the emulated GEMMs spend most of their time here)."""
    amax = tiles.abs().amax(dim=dims, keepdim=True)
    _check_finite(amax, what)
    if amax_floor:
        amax = amax.clamp(min=amax_floor)
    scaled, scale_inv = _saturated(tiles, amax, scale_format, arithmetic, in_place=True)
    return scaled.copy_(scaled.to(FP8_DTYPE)).mul_(scale_inv)


def _cast(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _zero_padded(x: torch.Tensor, shape: tuple[int, ...], owned: bool = False) -> torch.Tensor:
    """``x`` as float32, zero-padded at the end of each dim to ``shape``: ``x`` itself when float32 with
    nothing to pad, unless ``owned``: then always a fresh copy outside autograd, for the caller to write
    over (the fake quantizers do: their callers' backward is a straight-through estimator)."""
    fits = tuple(x.shape) == shape
    if fits and not owned:
        return x.float()
    padded = (torch.empty if fits else torch.zeros)(shape, dtype=torch.float32, device=x.device)
    padded[tuple(slice(0, d) for d in x.shape)] = x.detach() if owned else x
    return padded


def _as_blocks(x: torch.Tensor, block: tuple[int, int], owned: bool = False) -> torch.Tensor:
    """A 2-D ``x`` as zero-padded float32 blocks [ceil(N/bn), bn, ceil(K/bk), bk] (``owned``: see
    :func:`_zero_padded`)."""
    (n, k), (bn, bk) = x.shape, block
    nb, kb = _ceil_div(n, bn), _ceil_div(k, bk)
    return _zero_padded(x, (nb * bn, kb * bk), owned).view(nb, bn, kb, bk)


def _from_blocks(blocks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Inverse of :func:`_as_blocks`: the [N, K] part of the padded blocks."""
    nb, bn, kb, bk = blocks.shape
    return blocks.reshape(nb * bn, kb * bk)[: shape[0], : shape[1]]


def _as_groups(x: torch.Tensor, group: int, owned: bool = False) -> torch.Tensor:
    """``x`` [..., K] as zero-padded float32 groups [..., ceil(K/group), group] along the last dim
    (``owned``: see :func:`_zero_padded`)."""
    g = _ceil_div(x.shape[-1], group)
    return _zero_padded(x, (*x.shape[:-1], g * group), owned).view(*x.shape[:-1], g, group)


def _from_groups(groups: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`_as_groups`: the first ``k`` elements of the flattened groups."""
    return groups.reshape(*groups.shape[:-2], -1)[..., :k]


def quantize_blockwise(
    w: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK, scale_format: ScaleFormat = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight [N, K] per block, with Transformer Engine's arithmetic.

    Returns ``q`` (float8_e4m3fn, shape [N, K]) and ``scale_inv`` (float32, shape
    [ceil(N/bn), ceil(K/bk)]). Edge blocks are the partial blocks at the border; padding never
    changes an amax because it is zero. These are the values the trainer computes with and the codes
    it ships; under ``pow2`` the amax is floored at :data:`DEEPGEMM_AMAX_FLOOR` and the codes are vLLM's
    fixed point (see the module's docstring).
    """
    if w.ndim != 2:
        raise ValueError(f"quantize_blockwise expects a 2-D tensor, got shape {tuple(w.shape)}")
    blocks = _as_blocks(w, block)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    _check_finite(amax, "weight")
    if scale_format == "pow2":
        amax = amax.clamp(min=DEEPGEMM_AMAX_FLOOR)
    q, scale_inv = _codes_and_scale_inv(blocks, amax, scale_format, "te")
    if scale_format == "pow2":
        q, scale_inv = _deepgemm_fixed_point(q, scale_inv)
    return _from_blocks(q, w.shape).contiguous(), scale_inv[:, 0, :, 0].contiguous()


def _deepgemm_fixed_point(q: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of pow2 codes [nb, bn, kb, bk] and their scale_inv [nb, 1, kb, 1] as vLLM re-quantizes
    them: ``2^ceil(log2(max(top, 1e-4) / 448))`` from the largest dequantized value ``top``. From codes
    made with the floored amax this is ``scale_inv`` itself, or half of it where the largest code is 224
    (the codes then double: exact, the same values)."""
    codes = q.float()
    top = codes.abs().amax(dim=(1, 3), keepdim=True) * scale_inv  # (exact: scale_inv is a power of two)
    floored = top.clamp(min=DEEPGEMM_AMAX_FLOOR)
    held = round_up_pow2(floored / torch.full_like(floored, FP8_MAX))
    return _cast(codes * (scale_inv / held)), held


def dequantize_blockwise(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = WEIGHT_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: ``q * scale_inv`` in float32, then cast to ``dtype``."""
    expected = (_ceil_div(q.shape[0], block[0]), _ceil_div(q.shape[1], block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match weight "
            f"{tuple(q.shape)} with block {block}: expected {expected}"
        )
    blocks = _as_blocks(q, block) * scale_inv.float()[:, None, :, None]
    return _from_blocks(blocks, q.shape).to(dtype)


def quantize_activation(
    x: torch.Tensor,
    group: int = ACTIVATION_GROUP,
    scale_format: ScaleFormat = "fp32",
    arithmetic: Arithmetic = "te",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize per token in groups of ``group`` along the last dimension (1 x 128 tiles).

    ``x`` is [..., K]; returns ``q`` float8_e4m3fn [..., K] and ``scale_inv`` float32
    [..., ceil(K/group)]. Used for input activations and for output gradients; ``arithmetic`` is the
    engine's whose codes to reproduce (``te`` in the trainer, ``vllm`` in the rollout).
    """
    groups = _as_groups(x, group)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    _check_finite(amax, "activation")
    q, scale_inv = _codes_and_scale_inv(groups, amax, scale_format, arithmetic)
    return _from_groups(q, x.shape[-1]).contiguous(), scale_inv.squeeze(-1)


def dequantize_activation(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    group: int = ACTIVATION_GROUP,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_activation`."""
    groups = _as_groups(q, group) * scale_inv.float()[..., None]
    return _from_groups(groups, q.shape[-1]).to(dtype)


def fake_quantize_weight(
    w: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK, scale_format: ScaleFormat = "fp32"
) -> torch.Tensor:
    """Quantize then dequantize a weight; the result has ``w``'s dtype. (Under ``pow2`` the DeepGEMM
    fixed point of :func:`quantize_blockwise` is left out: it changes codes and scales, never a value.)"""
    if w.ndim != 2:
        raise ValueError(f"fake_quantize_weight expects a 2-D tensor, got shape {tuple(w.shape)}")
    blocks = _as_blocks(w, block, owned=True)
    floor = DEEPGEMM_AMAX_FLOOR if scale_format == "pow2" else 0.0
    _fake_quantize_in_place(blocks, (1, 3), scale_format, "te", "weight", floor)
    return _from_blocks(blocks, w.shape).to(w.dtype)


def fake_quantize_activation(
    x: torch.Tensor,
    group: int = ACTIVATION_GROUP,
    scale_format: ScaleFormat = "fp32",
    arithmetic: Arithmetic = "te",
) -> torch.Tensor:
    """Quantize then dequantize per token in 1 x ``group`` tiles; the result has ``x``'s dtype."""
    groups = _as_groups(x, group, owned=True)
    _fake_quantize_in_place(groups, -1, scale_format, arithmetic, "activation")
    return _from_groups(groups, x.shape[-1]).to(x.dtype)


def kv_cache_scale(amax: torch.Tensor, scale_format: ScaleFormat = "fp32") -> torch.Tensor:
    """The per-tensor scale of an FP8 attention input (vLLM's ``q_scale``, ``k_scale``, ``v_scale``;
    float32) that maps ``amax`` onto E4M3's largest value: ``amax / 448``, or under ``pow2`` the power of
    two at or above it (no value then saturates). 1.0, vLLM's scale for a checkpoint without one, where
    ``amax`` is zero or not finite (nothing was measured)."""
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"unknown scale format {scale_format!r}; expected one of {SCALE_FORMATS}")
    amax = amax.float()
    measured = torch.isfinite(amax) & (amax > 0)
    scale = torch.where(measured, amax, FP8_MAX) / torch.full_like(amax, FP8_MAX)
    scale = scale.clamp(min=torch.finfo(torch.float32).tiny)  # (a subnormal amax: still a usable scale)
    return round_up_pow2(scale) if scale_format == "pow2" else scale


def fake_quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What an FP8 (E4M3) KV cache gives back of ``x`` (keys after RoPE, or values): vLLM's cache write
    ``code = sat(x / scale)`` in float32, then the attention's read ``code * scale``; in ``x``'s dtype.
    ``scale``: the layer's float32 scale as a tensor (a true division, as vLLM's kernels do)."""
    scale = scale.float()
    return (_cast(x.float() / scale).float() * scale).to(x.dtype)


def fake_quantize_query(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The query as FP8 attention (FlashAttention-3 over an FP8 KV cache, on Hopper) computes with it:
    vLLM's static per-tensor quantizer ``code = sat(x * (1 / scale))`` in float32, read back as ``code *
    scale``; in ``x``'s dtype. ``scale``: a float32 tensor."""
    scale = scale.float()
    return (_cast(x.float() * torch.reciprocal(scale)).float() * scale).to(x.dtype)


def fake_quantize_columnwise(
    x: torch.Tensor, group: int = ACTIVATION_GROUP, scale_format: ScaleFormat = "fp32"
) -> torch.Tensor:
    """A 2-D ``x`` [M, K] quantized then dequantized in groups of ``group`` consecutive rows per column
    (TE's columnwise 1x128 tiles of the wgrad GEMM: 128 tokens per feature), TE arithmetic. (The tiles
    are read down the columns in place: no transposed copy.)"""
    m, k = x.shape
    g = _ceil_div(m, group)
    groups = _zero_padded(x, (g * group, k), owned=True).view(g, group, k)
    _fake_quantize_in_place(groups, 1, scale_format, "te", "activation")
    return groups.view(g * group, k)[:m].to(x.dtype)
