"""FP8 linear layers for training, behind one interface (:func:`convert_linears`).

* ``emulated`` (anywhere): an autograd function that fake-quantizes the weight (128x128 blocks) and the
  input (1x128 per token) in the forward pass and the output gradient (1x128 per token) in the backward
  pass, all with :mod:`fp8rl.quant`. The weight codes are exactly those the WeightSet ships, so under the
  ``fp8`` recipe trainer and rollout compute with bit-identical FP8 weights.
* ``te`` (CUDA with Transformer Engine >= 2.3): ``te.Linear`` under the ``Float8BlockScaling`` recipe with
  FP32 scales, set on the recipe object (:func:`block_scaling_recipe`).

Only linears inside the transformer blocks are converted; embeddings, lm_head, norms and attention stay
in the compute dtype. Parameter names do not change.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.nn.functional as F

from fp8rl import quant

Backend = Literal["emulated", "te"]


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        device = x.device.type
        compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        xq = quant.fake_quantize_activation(x.float()).to(compute)
        wq = quant.fake_quantize_weight(weight.detach().float()).to(compute)
        ctx.save_for_backward(xq, wq)
        ctx.has_bias = bias is not None
        return F.linear(xq, wq, None if bias is None else bias.to(compute))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        xq, wq = ctx.saved_tensors
        # The straight-through estimator for the fake quantizers; dY is quantized like an activation.
        dyq = quant.fake_quantize_activation(dy.float()).to(wq.dtype)
        dx = dyq @ wq
        dw = dyq.reshape(-1, dyq.shape[-1]).t() @ xq.reshape(-1, xq.shape[-1])
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
        return dx, dw.float(), db


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = dq(q(x)) · dq(q(W))ᵀ + b`` with blockwise-FP8 fake quantization (and FP8 dY in backward)."""
    return _FP8LinearFunction.apply(x, weight, bias)


class EmulatedFP8Linear(torch.nn.Linear):
    """An ``nn.Linear`` whose matmul runs through :func:`fp8_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias)


def block_linears(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Linear]]:
    """The linear layers inside the transformer blocks (the ones the FP8 recipe quantizes)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}.":
            yield name, module


def resolve_backend(requested: str) -> Backend:
    """``auto`` -> ``te`` on CUDA when Transformer Engine imports, else ``emulated``."""
    if requested in ("emulated", "te"):
        return requested  # type: ignore[return-value]
    if torch.cuda.is_available():
        with contextlib.suppress(ImportError):
            import transformer_engine.pytorch  # noqa: F401

            return "te"
    return "emulated"


def convert_linears(model: torch.nn.Module, backend: Backend) -> int:
    """Swap every block linear for its FP8 version in place; returns how many were converted."""
    converted = list(block_linears(model))
    for _, linear in converted:
        if backend == "emulated":
            linear.__class__ = EmulatedFP8Linear
        else:
            _to_te_linear(model, linear)
    return len(converted)


def _to_te_linear(model: torch.nn.Module, linear: torch.nn.Linear) -> None:
    import transformer_engine.pytorch as te

    if linear.in_features % 16 or linear.out_features % 16:  # TE's FP8 GEMMs need K, N % 16 == 0
        raise ValueError(
            f"a {linear.in_features}x{linear.out_features} linear cannot run in Transformer Engine FP8 "
            "(both dimensions must be multiples of 16); use fp8_backend: emulated"
        )

    replacement = te.Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        params_dtype=linear.weight.dtype,
        device=linear.weight.device,
    )
    with torch.no_grad():
        replacement.weight.copy_(linear.weight)
        if linear.bias is not None:
            replacement.bias.copy_(linear.bias)
    parent_name, _, child = next(n for n, m in model.named_modules() if m is linear).rpartition(".")
    setattr(model.get_submodule(parent_name), child, replacement)


QUANTIZERS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")


@functools.cache
def block_scaling_recipe(power_2_scales: bool = False) -> Any:
    """TE's ``Float8BlockScaling`` (X and dY 1x128, W 128x128, E4M3) with its scale format set on the
    recipe object: FP32 scales (the study's and vLLM's) unless ``power_2_scales``.

    TE reads ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` once, into class defaults, when its recipe module is
    imported; setting the variable any later changes nothing, so the quantizer parameters are replaced
    here and checked on the object in force.
    """
    from transformer_engine.common.recipe import Float8BlockScaling, QParams

    recipe = Float8BlockScaling()
    for name in QUANTIZERS:
        setattr(recipe, name, QParams(power_2_scale=power_2_scales, amax_epsilon=0.0))
    in_force = {name: getattr(recipe, name).power_2_scale for name in QUANTIZERS}
    if set(in_force.values()) != {power_2_scales}:
        raise RuntimeError(f"Transformer Engine kept other scale formats than asked: {in_force}")
    return recipe


def fp8_context(backend: Backend | None) -> contextlib.AbstractContextManager[Any]:
    """The context the forward (and backward) pass runs in: TE's FP8 autocast with the blockwise
    FP32-scaled recipe for ``te``; nothing otherwise (the emulated layers quantize themselves)."""
    if backend != "te":
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te

    recipe = block_scaling_recipe()
    if hasattr(te, "autocast"):  # TE >= 2.8; fp8_autocast is deprecated there
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)
