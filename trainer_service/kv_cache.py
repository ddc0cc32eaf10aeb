"""FP8 attention in the trainer: what the rollout's FP8 KV cache does to keys and values, and its scales.

Under a ``-kv`` recipe the rollout keeps K (after RoPE) and V in E4M3, one float32 scale per layer each
(vLLM's ``k_scale`` / ``v_scale``), and on Hopper FlashAttention-3 reads them with the query in E4M3 too
(``q_scale``): every token it sampled attended through that rounding. The trainer attends the same way,
with the same scales (:func:`fp8rl.quant.fake_quantize_kv` and :func:`~fp8rl.quant.fake_quantize_query`
with those of the weight version it holds), so that both engines compute one function; gradients pass
straight through the rounding, as through the FP8 linears'.

It also calibrates the next version's scales, as NeMo RL does: the amax of Q, K and V (after RoPE) over
the real (not padding) tokens of the step's sequences, / 448 (:func:`fp8rl.quant.kv_cache_scale`),
measured while the step scores them. They ship with the next weight update as
``model.layers.N.self_attn.{q,k,v}_scale``, the names vLLM's loaders take (every update: a refit without
``q_scale`` resets vLLM's to 1.0). Version 0 has 1.0, vLLM's scale for a checkpoint that has none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fp8rl import quant
from fp8rl.codec.schema import ATTENTION_SCALES, attention_scale_names
from fp8rl.quant import ScaleFormat

ATTENTION = "fp8rl_fp8_kv_sdpa"
"""The transformers attention implementation that attends through the emulated cache (then sdpa)."""


def scale_names(attention_modules: list[str]) -> list[str]:
    """The checkpoint names of the scales of attention modules (``model.layers.0.self_attn``, ...): layer
    by layer, q, k, v (the order of :meth:`KVCache.tensors`)."""
    return [name for module in attention_modules for name in attention_scale_names(module)]


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """An HF decoder's attention modules (those with a ``layer_idx`` and q/k/v projections: Qwen2, Qwen3,
    Llama), in layer order, under their names."""
    found = [
        (name, m)
        for name, m in model.named_modules()
        if hasattr(m, "layer_idx") and all(hasattr(m, p) for p in ("q_proj", "k_proj", "v_proj"))
    ]
    if [int(m.layer_idx) for _, m in found] != list(range(len(found))) or not found:
        raise ValueError("an FP8 KV cache needs a decoder whose attention layers have q/k/v projections")
    return found


class _Rounded(torch.autograd.Function):
    """An attention input as FP8 attention computes with it; the gradient passes straight through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, query: bool) -> torch.Tensor:
        return quant.fake_quantize_query(x, scale) if query else quant.fake_quantize_kv(x, scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class KVCache:
    """The scales of the held weight version, the amax recorded towards the next, and the attention
    function that uses both. ``calibrate=False`` keeps every scale at 1.0; ``emulate=False`` attends in
    high precision (only importance sampling then corrects the rollout's FP8 attention)."""

    def __init__(
        self,
        model: torch.nn.Module,
        scale_format: ScaleFormat,
        calibrate: bool = True,
        emulate: bool = True,
        device: torch.device | None = None,
        attention: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    ) -> None:
        """For ``model``'s attention layers (:func:`attention_modules`); :meth:`install` routes them here.
        ``attention``: the transformers attention function that attends once Q, K and V are rounded
        (default: sdpa; exact mode's under ``consistency: exact``)."""
        self.modules = [name for name, _ in attention_modules(model)]
        self.attention = attention
        self.scale_format, self.calibrated, self.emulated = scale_format, calibrate, emulate
        shape = (len(self.modules), len(ATTENTION_SCALES))
        self.scales = torch.ones(shape, dtype=torch.float32, device=device)  # [layer, q k v] of this version
        self.amax = torch.zeros(shape, dtype=torch.float32, device=device)  # recorded towards the next
        self._tokens: torch.Tensor | None = None  # the batch's attention mask [B, L] while recording

    def install(self, model: torch.nn.Module) -> None:
        """Route the attention of ``model`` (this cache's model, or a copy of it; sdpa) through here."""
        _register()
        modules = attention_modules(model)
        if [name for name, _ in modules] != self.modules:
            raise ValueError("install: the model's attention layers are not those this cache was made for")
        for _, module in modules:
            setattr(module, "fp8rl_kv_cache", self)  # noqa: B010 (a plain attribute: not typed on Module)
        model.set_attn_implementation(ATTENTION)  # type: ignore[operator]

    @contextlib.contextmanager
    def recording(self, attention_mask: torch.Tensor) -> Iterator[None]:
        """Within: forward passes over a batch with this mask [B, L] add its real tokens' Q, K and V to the
        amax."""
        self._tokens = attention_mask.bool()
        try:
            yield
        finally:
            self._tokens = None

    def calibrate(self, reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """The next version's scales from the amax recorded (``reduce_max``: its maximum over ranks, a
        collective every rank calls); a scale with nothing measured (no token, or not finite) stays as it
        was. Recording starts afresh."""
        amax = self.amax if reduce_max is None else reduce_max(self.amax)
        if self.calibrated:
            measured = torch.isfinite(amax) & (amax > 0)
            self.scales = torch.where(measured, quant.kv_cache_scale(amax, self.scale_format), self.scales)
        self.amax.zero_()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The scales under the names vLLM loads them by (float32 scalars, on the host)."""
        values = self.scales.detach().cpu().reshape(-1)
        return {name: values[i].clone() for i, name in enumerate(scale_names(self.modules))}

    def load(self, scales: torch.Tensor) -> None:
        """Take ``scales`` [layers, 3] (float32, positive: q, k, v per layer) as this version's."""
        if scales.shape != self.scales.shape or not bool((scales > 0).all()):
            raise ValueError(f"KV-cache scales of shape {tuple(self.scales.shape)}, positive, expected")
        self.scales = scales.to(self.scales.device, torch.float32).clone()

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``query``, ``key``, ``value``: [B, heads, L, head dim], after RoPE (what the rollout caches)."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        layer = int(module.layer_idx)  # type: ignore[arg-type]
        if self._tokens is not None:
            with torch.no_grad():
                real = self._tokens[:, None, :, None]
                for i, x in enumerate((query, key, value)):
                    amax = x.detach().abs().masked_fill(~real, 0).amax().float()
                    self.amax[layer, i] = torch.maximum(self.amax[layer, i], amax)
        if self.emulated:
            query, key, value = (
                _Rounded.apply(x, self.scales[layer, i], i == 0) for i, x in enumerate((query, key, value))
            )
        attention = self.attention or sdpa_attention_forward
        return attention(module, query, key, value, attention_mask, **kwargs)


def _attend(module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention function transformers calls: the module's cache (:meth:`KVCache.install`) attends."""
    cache: KVCache = module.fp8rl_kv_cache  # type: ignore[assignment]
    return cache.attend(module, *args, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _attend)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
