"""vLLM 0.32's re-quantization of block-FP8 weights to power-of-two scales, restated from its sources for
tests and for scripts/gpu_proof.py (pure torch: the proof's host has no vLLM).

With ``VLLM_USE_DEEP_GEMM_E8M0=1`` (DeepGEMM on Hopper), vLLM's fp8 method post-processes every loaded
block-FP8 weight, at load and at every refit (``deepgemm_post_process_fp8_weight_block`` ->
``requant_weight_ue8m0_inplace`` in ``model_executor/layers/quantization/utils/fp8_utils.py``):

1. dequantize with the held scales, in float32: ``w = code * scale_inv`` (scales repeated over each
   128x128 block, cropped at the edges);
2. ``per_block_cast_to_fp8(w, [128, 128], use_ue8m0=True)`` (``vllm/utils/deep_gemm.py``): zero-pad to
   whole blocks, ``amax = max(|w| over the block, 1e-4)``, ``sf = amax / 448``, ``sf =
   2^ceil(log2(sf))``, ``code = (w * (1 / sf)).to(float8_e4m3fn)`` (no clamp: ``|w| / sf <= 448``);
3. write codes and ``sf`` back in place.
"""

from __future__ import annotations

import torch

AMAX_FLOOR = 1e-4
E4M3_MAX = 448.0


def requantize_ue8m0(
    codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """What vLLM holds after loading ``codes`` (float8_e4m3fn [N, K]) with ``scale_inv`` (float32
    [ceil(N/bn), ceil(K/bk)]) under DeepGEMM's E8M0 mode: (codes, scale_inv) of the same shapes."""
    (n, k), (bn, bk) = codes.shape, block
    per_element = scale_inv.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    weight = codes.float() * per_element
    return per_block_cast_to_fp8(weight, block)


def per_block_cast_to_fp8(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``per_block_cast_to_fp8(weight, block, use_ue8m0=True)`` for a float32 [N, K] ``weight``."""
    (n, k), (bn, bk) = weight.shape, block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=weight.dtype, device=weight.device)
    padded[:n, :k] = weight
    blocks = padded.view(nb, bn, kb, bk)
    amax = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR)
    sf = torch.pow(2.0, torch.ceil(torch.log2(amax / E4M3_MAX)))
    codes = (blocks * (1.0 / sf)).to(torch.float8_e4m3fn)
    return codes.view(nb * bn, kb * bk)[:n, :k].contiguous(), sf.view(nb, kb)
