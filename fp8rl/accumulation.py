"""How far a real FP8 GEMM may lie from exact arithmetic over the same FP8 operands: the bound that checks
of tensor-core GEMMs against the emulation use (tests/unit/test_quant_gpu.py, scripts/gpu_proof.py).

Products of two E4M3 values are exact (4 x 4 significant bits), so all the error is in the sums.
Hopper's FP8 tensor cores do not add in full FP32: DeepSeek-V3 (arXiv 2412.19437, section 3.3.2)
measured about 14 retained bits. Inside one MMA the products are aligned to the largest exponent among
them and the accumulator, and the bits below the kept ones dropped. Kernels without fast accumulation
(cuBLAS with ``use_fast_accum=False``, CUTLASS's default FP8 kernels, DeepGEMM) and every blockwise-scaled
GEMM (whose scales change every 128 along K) promote: once per 128-wide K chunk they multiply the tensor
core's partial sum by the chunk's scales and add it to an FP32 register, then restart from zero.

The model, for one output element and one K chunk ``c`` of products ``p_i = a_i * b_i`` (dequantized
operands): every number an MMA adds lies within the chunk's largest magnitude ``M_c`` (the largest
``|p_i|`` or partial sum of the chunk), and keeping ``BITS`` significant bits relative to an exponent
``e`` with ``2^e <= M_c`` drops less than ``2^(e + 1 - BITS) <= 2^(1 - BITS) * M_c`` from each. A chunk
of ``n`` products passes ``n`` products and ``ceil(n / MMA_K)`` accumulator values through that
alignment, so

    |error of chunk c|  <=  (n + ceil(n / MMA_K)) * 2^(1 - BITS) * M_c

and the FP32 side (the scale products, the promotion adds, the output's rounding) adds at most
``(chunks + 2) * 2^-24 * sum_i |p_i|``. The sum over chunks of both is the bound. It is a worst case
(all the dropped bits of one sign); random inputs land one to two orders of magnitude below it, but a
wrong scale or a misplaced block moves an output by about its own size, far above it.
"""

from __future__ import annotations

import torch

BITS = 14
"""Significant bits the FP8 tensor cores of Hopper keep while accumulating (DeepSeek-V3's measurement)."""
CHUNK = 128
"""K elements the tensor core sums before the kernel promotes the partial sum to FP32."""
MMA_K = 32
"""K elements of one FP8 MMA instruction on Hopper (wgmma ...k32 for E4M3)."""
FP32_UNIT = 2.0**-24
"""The unit roundoff of float32 (round to nearest)."""


def gemm_error_bound(
    a: torch.Tensor, b: torch.Tensor, bits: int = BITS, chunk: int = CHUNK, mma_k: int = MMA_K
) -> torch.Tensor:
    """The bound above on ``|a @ b.T - exact|`` per output element, for dequantized FP8 operands ``a``
    [M, K] and ``b`` [N, K] (any float dtype; computed in float64); returns float64 [M, N]."""
    a64, b64 = a.double(), b.double()
    k = a64.shape[1]
    bound = torch.zeros(a64.shape[0], b64.shape[0], dtype=torch.float64, device=a64.device)
    total = torch.zeros_like(bound)
    for start in range(0, k, chunk):
        products = a64[:, None, start : start + chunk] * b64[None, :, start : start + chunk]  # [M, N, n]
        n = products.shape[-1]
        largest = torch.maximum(products.abs().amax(-1), products.cumsum(-1).abs().amax(-1))
        bound += (n + -(-n // mma_k)) * 2.0 ** (1 - bits) * largest
        total += products.abs().sum(-1)
    chunks = -(-k // chunk)
    return bound + (chunks + 2) * FP32_UNIT * total


def abs_product_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_i |a_i b_i|`` per output element (float64 [M, N]): the scale of any accumulation error, and
    ``FP32_UNIT`` times it that of an exact-FP32 accumulation."""
    return a.double().abs() @ b.double().abs().t()
