"""The one FP8 implementation every engine uses: DeepSeek-V3 style blockwise E4M3 with FP32 scales.

Weights are scaled per 128x128 block, activations (and gradients) per token in groups of 128 along the
last dimension. For every block: ``scale_inv = amax(|block|) / 448`` in float32, ``q = clamp(x /
scale_inv, -448, 448)`` cast to float8_e4m3fn, and ``x ≈ q * scale_inv``. A block whose scale would be
zero (all zeros, or an amax so small that amax/448 underflows) gets ``scale_inv = 1.0``.

Pure torch: nothing here does I/O, so the rollout, the trainer and the tests share it unchanged.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
WEIGHT_BLOCK = (128, 128)
ACTIVATION_GROUP = 128


class NonFiniteError(ValueError):
    """A tensor to quantize holds NaN or inf (FP8 has no scale for it)."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _scale_inv_from_amax(amax: torch.Tensor, what: str) -> torch.Tensor:
    # Finiteness is checked on the block maxima, which NaN and inf propagate to: a fraction of the cost
    # of checking the input.
    if not torch.isfinite(amax).all():
        raise NonFiniteError(f"{what} contains NaN or inf; FP8 quantization needs finite values")
    scale_inv = amax / FP8_MAX
    return torch.where(scale_inv == 0, torch.ones_like(scale_inv), scale_inv)


def _cast(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _zero_padded(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``x`` as float32, zero-padded at the end of each dim to ``shape`` (no copy when nothing to pad)."""
    if tuple(x.shape) == shape:
        return x.float()
    padded = torch.zeros(shape, dtype=torch.float32, device=x.device)
    padded[tuple(slice(0, d) for d in x.shape)] = x
    return padded


def _as_blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A 2-D ``x`` as zero-padded float32 blocks [ceil(N/bn), bn, ceil(K/bk), bk]."""
    (n, k), (bn, bk) = x.shape, block
    nb, kb = _ceil_div(n, bn), _ceil_div(k, bk)
    return _zero_padded(x, (nb * bn, kb * bk)).view(nb, bn, kb, bk)


def _from_blocks(blocks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Inverse of :func:`_as_blocks`: the [N, K] part of the padded blocks."""
    nb, bn, kb, bk = blocks.shape
    return blocks.reshape(nb * bn, kb * bk)[: shape[0], : shape[1]]


def _as_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` [..., K] as zero-padded float32 groups [..., ceil(K/group), group] along the last dim."""
    g = _ceil_div(x.shape[-1], group)
    return _zero_padded(x, (*x.shape[:-1], g * group)).view(*x.shape[:-1], g, group)


def _from_groups(groups: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`_as_groups`: the first ``k`` elements of the flattened groups."""
    return groups.reshape(*groups.shape[:-2], -1)[..., :k]


def quantize_blockwise(
    w: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight [N, K] per block.

    Returns ``q`` (float8_e4m3fn, shape [N, K]) and ``scale_inv`` (float32, shape
    [ceil(N/bn), ceil(K/bk)]). Edge blocks are the partial blocks at the border; padding never
    changes an amax because it is zero.
    """
    if w.ndim != 2:
        raise ValueError(f"quantize_blockwise expects a 2-D tensor, got shape {tuple(w.shape)}")
    blocks = _as_blocks(w, block)
    scale_inv = _scale_inv_from_amax(blocks.abs().amax(dim=(1, 3)), "weight")
    q = _from_blocks(_cast(blocks / scale_inv[:, None, :, None]), w.shape)
    return q.contiguous(), scale_inv


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


def quantize_activation(x: torch.Tensor, group: int = ACTIVATION_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize per token in groups of ``group`` along the last dimension (1 x 128 tiles).

    ``x`` is [..., K]; returns ``q`` float8_e4m3fn [..., K] and ``scale_inv`` float32
    [..., ceil(K/group)]. Used for input activations and for output gradients.
    """
    groups = _as_groups(x, group)
    scale_inv = _scale_inv_from_amax(groups.abs().amax(dim=-1), "activation")
    q = _from_groups(_cast(groups / scale_inv[..., None]), x.shape[-1])
    return q.contiguous(), scale_inv


def dequantize_activation(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    group: int = ACTIVATION_GROUP,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_activation`."""
    groups = _as_groups(q, group) * scale_inv.float()[..., None]
    return _from_groups(groups, q.shape[-1]).to(dtype)


def fake_quantize_weight(w: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK) -> torch.Tensor:
    """Quantize then dequantize a weight; the result has ``w``'s dtype."""
    return dequantize_blockwise(*quantize_blockwise(w, block), block=block, dtype=w.dtype)


def fake_quantize_activation(x: torch.Tensor, group: int = ACTIVATION_GROUP) -> torch.Tensor:
    """Quantize then dequantize per token in 1 x ``group`` tiles; the result has ``x``'s dtype."""
    return dequantize_activation(*quantize_activation(x, group), group=group, dtype=x.dtype)
