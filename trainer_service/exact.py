"""Exact consistency in the trainer (``precision.consistency: exact``): the HF model's forward computes
with :mod:`fp8rl.exact`, the arithmetic the rollout computes with, and its backward as the plain ops'.

:func:`convert_exact` swaps, in place and keeping every parameter and its name:

* every ``nn.Linear`` (block linears, the routers, ``lm_head``) for :class:`ExactLinear`: FP8 for the
  block linears the plan runs in FP8 under an FP8 recipe (the shipped 128x128 codes, 1x128
  activations), high precision otherwise; its backward is the FP8 emulation's (dY quantized for dgrad,
  X and dY columnwise for wgrad) or the plain GEMMs;
* RMSNorms, the SiLU activations, the embedding and the rotary embedding for their exact twins;
* attention for :func:`attend` (transformers' attention interface), whose backward is sdpa's;
* fused MoE experts and softmax top-k routers for exact ones (the same routing function vLLM's routers
  are given on the rollout).

Each op's gradient is the gradient of its plain float version at the same inputs (:func:`exactly`):
the forward's value is exact, the backward recomputes the float op (attention: sdpa) and
differentiates that, as TorchTitan's deterministic RL does with vLLM's attention. Every module computes
in the compute dtype it is given (the model keeps float32 master weights; nothing runs under autocast).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.nn.functional as F

from fp8rl import exact, quant
from fp8rl.quant import ScaleFormat
from trainer_service.fp8_linear import _FP8LinearFunction, block_experts, block_linears, mixed_class

ATTENTION = "fp8rl_exact"
"""The transformers attention implementation of exact mode."""
ROUTER_ATTRIBUTES = ("top_k", "norm_topk_prob", "weight")
"""What makes an MoE layer's ``mlp.gate`` a softmax top-k router."""


class _Exactly(torch.autograd.Function):
    """``value(*inputs)`` in the forward; in the backward, the gradient of ``surrogate(*inputs)``,
    recomputed with grad at the saved inputs."""

    @staticmethod
    def forward(
        ctx: Any,
        value: Callable[..., torch.Tensor],
        surrogate: Callable[..., torch.Tensor],
        *inputs: torch.Tensor,
    ) -> torch.Tensor:
        ctx.surrogate = surrogate
        ctx.save_for_backward(*inputs)
        return value(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        wanted = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(w) for x, w in zip(ctx.saved_tensors, wanted, strict=True)]
            differentiable = [leaf for leaf, w in zip(leaves, wanted, strict=True) if w]
            grads = iter(torch.autograd.grad(ctx.surrogate(*leaves), differentiable, grad, allow_unused=True))
        return None, None, *(next(grads) if w else None for w in wanted)


def exactly(
    value: Callable[..., torch.Tensor], surrogate: Callable[..., torch.Tensor], *inputs: torch.Tensor
) -> torch.Tensor:
    """``value(*inputs)``, differentiated as ``surrogate(*inputs)`` (the same function in plain float)."""
    return _Exactly.apply(value, surrogate, *inputs)


class WeightCache:
    """A module's weights as exact GEMM operands, made once per version of each weight (a forward under
    no_grad and the one under grad read the same weights; an optimizer step or a load changes the
    tensor's version). Off (``enabled=False``) where weights change behind autograd's back: FSDP
    gathers shards into the same buffer."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._held: dict[int, tuple[Any, exact.GroupedOperand, torch.Tensor]] = {}

    def operands(
        self, weight: torch.Tensor, fp8: ScaleFormat | None, dtype: torch.dtype
    ) -> tuple[exact.GroupedOperand, torch.Tensor]:
        """(the forward's operand, the weight the backward multiplies by: the dequantized FP8 codes,
        or ``weight`` itself in high precision)."""
        key = (weight._version, tuple(weight.shape), weight.stride(), fp8, dtype)
        held = self._held.get(weight.data_ptr()) if self.enabled else None
        if held is not None and held[0] == key:
            return held[1], held[2]
        if fp8 is None:
            made = exact.prepared_weight(weight, fp8=None, dtype=dtype), weight
        else:
            codes, scale_inv = quant.quantize_blockwise(weight.detach().float(), scale_format=fp8)
            made = (
                exact.GroupedOperand.fp8_weight(codes, scale_inv),
                quant.dequantize_blockwise(codes, scale_inv),
            )
        if self.enabled:
            self._held[weight.data_ptr()] = (key, *made)
        return made


class _ExactLinearFunction(torch.autograd.Function):
    """``exact.linear`` forward; backward: the FP8 emulation's GEMMs (:class:`_FP8LinearFunction`) for
    an FP8 linear, the plain ones in the compute dtype for a high-precision one."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        fp8: ScaleFormat | None,
        dtype: torch.dtype,
        cache: WeightCache,
    ) -> torch.Tensor:
        x = x.to(dtype)
        ctx.fp8, ctx.compute, ctx.has_bias = fp8, dtype, bias is not None
        ctx.nonfinite_passes = quant.nonfinite_passing()
        prepared, backward_weight = cache.operands(weight, fp8, dtype)
        if fp8 is None:
            ctx.save_for_backward(x, weight)
        else:
            x_columnwise = x.new_empty(0, dtype=torch.float32)
            if ctx.needs_input_grad[1]:
                x_columnwise = quant.fake_quantize_columnwise(
                    x.float().reshape(-1, x.shape[-1]), scale_format=fp8
                )
            ctx.save_for_backward(x_columnwise, backward_weight)
        return exact.linear(x, prepared, bias, fp8=fp8)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        if ctx.fp8 is not None:
            x_columnwise, wq = ctx.saved_tensors
            with quant.nonfinite_passes() if ctx.nonfinite_passes else contextlib.nullcontext():
                dx, dw, db, _ = _FP8LinearFunction._backward(ctx, dy, x_columnwise, wq, ctx.fp8)
            return dx, dw, db, None, None, None
        x, weight = ctx.saved_tensors
        dy = dy.to(ctx.compute)
        dx = dy @ weight.to(ctx.compute)
        dw = None
        if ctx.needs_input_grad[1]:
            dw = (dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype)
        db = dy.reshape(-1, dy.shape[-1]).sum(0).float() if ctx.has_bias else None
        return dx, dw, db, None, None, None


def exact_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    fp8: ScaleFormat | None,
    dtype: torch.dtype,
    cache: WeightCache | None = None,
) -> torch.Tensor:
    """``x @ weightᵀ + bias`` through :func:`fp8rl.exact.linear` (FP8 in scale format ``fp8``, or high
    precision when None), in ``dtype``; differentiable in ``x``, ``weight`` and ``bias``. ``cache``:
    where the weight's operands are kept between calls. Under no_grad the forward alone (as
    :func:`trainer_service.fp8_linear.fp8_linear`: no wgrad operand for a backward that never runs)."""
    cache = cache or WeightCache(enabled=False)
    if not torch.is_grad_enabled():
        prepared, _ = cache.operands(weight, fp8, dtype)
        return exact.linear(x.to(dtype), prepared, bias, fp8=fp8)
    return _ExactLinearFunction.apply(x, weight, bias, fp8, dtype, cache)


class ExactLinear(torch.nn.Linear):
    """An ``nn.Linear`` computed by :func:`exact_linear`."""

    exact_fp8: ScaleFormat | None = None
    exact_dtype: torch.dtype = torch.float32
    exact_cache: WeightCache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exact_linear(x, self.weight, self.bias, self.exact_fp8, self.exact_dtype, self.exact_cache)


class ExactRMSNorm(torch.nn.Module):
    """transformers' RMSNorm (``weight``, ``variance_epsilon``) by :func:`fp8rl.exact.rms_norm`."""

    weight: torch.nn.Parameter
    variance_epsilon: float
    exact_dtype: torch.dtype = torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = float(self.variance_epsilon)
        return exactly(
            lambda h, w: exact.rms_norm(h, w, eps),
            lambda h, w: (
                w.to(h.dtype)
                * (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
            ),
            x.to(self.exact_dtype),
            self.weight,
        )


class ExactSiLU(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exactly(exact.silu, F.silu, x)


class ExactEmbedding(torch.nn.Embedding):
    """The token embedding, read in the compute dtype."""

    exact_dtype: torch.dtype = torch.float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight.to(self.exact_dtype), self.padding_idx)


class ExactRotaryEmbedding(torch.nn.Module):
    """transformers' rotary embedding module (``forward(x, position_ids) -> (cos, sin)``, each [B, L,
    head_dim] with the halves repeated), from :func:`fp8rl.exact.rope_cos_sin`."""

    inv_freq: torch.Tensor

    def __init__(self, config: Any) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.register_buffer(
            "inv_freq", exact.rope_inv_freq(head_dim, config.rope_parameters), persistent=False
        )

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = exact.rope_cos_sin(position_ids, self.inv_freq, x.dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def _sdpa(allowed: torch.Tensor, scale: float) -> Callable[..., torch.Tensor]:
    def attend_plainly(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)

    return attend_plainly


def attend(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function: ``query`` [B, H, L, D], ``key``/``value`` [B, KV, L, D] (after
    RoPE), ``attention_mask`` the boolean [B, 1, L, L] of :func:`_mask` -> [B, L, H, D]."""
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    length, keys = query.shape[2], key.shape[2]
    allowed = attention_mask
    if allowed is None:
        allowed = torch.ones(length, keys, dtype=torch.bool, device=query.device).tril(keys - length)[
            None, None
        ]
    out = exactly(
        lambda q, k, v: exact.attention(q, k, v, allowed, scale), _sdpa(allowed, scale), query, key, value
    )
    return out.transpose(1, 2).contiguous(), None


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' sdpa mask (boolean, True where a query attends), always made (never left to
    ``is_causal``)."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, attend)
    AttentionMaskInterface.register(ATTENTION, _mask)


class ExactRouter(torch.nn.Module):
    """transformers' softmax top-k router (``weight`` [E, H], ``top_k``, ``norm_topk_prob``): exact
    logits, then :func:`fp8rl.exact.route` (vLLM's routers are given the same function). Returns
    ``(logits, weights, experts)`` as transformers' does."""

    weight: torch.nn.Parameter
    top_k: int
    norm_topk_prob: bool
    exact_dtype: torch.dtype = torch.float32
    exact_cache: WeightCache

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = hidden.reshape(-1, hidden.shape[-1])
        logits = exact_linear(hidden, self.weight, None, None, self.exact_dtype, self.exact_cache)
        renormalize = bool(self.norm_topk_prob)
        ids = exact.route(logits.detach(), self.top_k, renormalize)[1]

        def weighed_plainly(scores: torch.Tensor) -> torch.Tensor:
            probs = torch.softmax(scores.double(), dim=-1).gather(-1, ids)
            return (probs / probs.sum(-1, keepdim=True) if renormalize else probs).float()

        weights = exactly(lambda s: exact.route(s, self.top_k, renormalize)[0], weighed_plainly, logits)
        return logits, weights, ids


class ExactExperts(torch.nn.Module):
    """Mixed into transformers' fused experts class: :func:`fp8rl.exact.moe`, each expert's gate/up and
    down an :func:`exact_linear` of its slice of the fused parameter."""

    gate_up_proj: torch.nn.Parameter
    down_proj: torch.nn.Parameter
    exact_fp8: ScaleFormat | None = None
    exact_dtype: torch.dtype = torch.float32
    exact_cache: WeightCache

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        def gemm(expert: int, which: int, x: torch.Tensor) -> torch.Tensor:
            weight = (self.gate_up_proj if which == 0 else self.down_proj)[expert]
            return exact_linear(x, weight, None, self.exact_fp8, self.exact_dtype, self.exact_cache)

        return exact.moe(hidden.to(self.exact_dtype), gemm, top_k_weights, top_k_index)


def _swap(module: torch.nn.Module, cls: type, **attributes: Any) -> None:
    module.__class__ = cls
    for name, value in attributes.items():
        setattr(module, name, value)


def convert_exact(
    model: torch.nn.Module,
    fp8: ScaleFormat | None,
    high_precision: Collection[str],
    dtype: torch.dtype,
    cache_weights: bool = True,
) -> None:
    """Make ``model`` compute exact mode's forward in ``dtype`` (module docstring): FP8 linears in scale
    format ``fp8`` (None: no FP8 anywhere), but the block linears and experts named in
    ``high_precision``. ``cache_weights``: keep each weight's operands until it changes (not for a
    model FSDP will shard)."""
    fp8_linears = {name for name, _ in block_linears(model) if fp8 is not None and name not in high_precision}
    experts = dict(block_experts(model))
    for name, module in list(model.named_modules()):
        kind = type(module).__name__
        if isinstance(module, torch.nn.Linear):
            _swap(module, ExactLinear, exact_fp8=fp8 if name in fp8_linears else None)
        elif isinstance(module, torch.nn.Embedding):
            _swap(module, ExactEmbedding)
        elif kind.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            _swap(module, ExactRMSNorm)
        elif kind.endswith("RotaryEmbedding"):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, ExactRotaryEmbedding(model.config))
        elif name in experts:
            in_fp8 = fp8 is not None and not any(n.startswith(f"{name}.") for n in high_precision)
            _swap(module, mixed_class(ExactExperts, type(module)), exact_fp8=fp8 if in_fp8 else None)
        elif name.endswith(".gate") and all(
            hasattr(module, a) for a in ("top_k", "norm_topk_prob", "weight")
        ):
            _swap(module, mixed_class(ExactRouter, type(module)))
        if type(getattr(module, "act_fn", None)).__name__ in ("SiLUActivation", "SiLU"):
            module.act_fn = ExactSiLU()
        if isinstance(module, (ExactLinear, ExactEmbedding, ExactRMSNorm, ExactExperts, ExactRouter)):
            module.exact_dtype = dtype
        if isinstance(module, (ExactLinear, ExactExperts, ExactRouter)):
            module.exact_cache = WeightCache(enabled=cache_weights)
    register_attention()
    model.set_attn_implementation(ATTENTION)  # type: ignore[operator]
