"""Exact consistency on the rollout (``precision.consistency: exact``, CPU): vLLM's forward computed with
:mod:`fp8rl.exact`, the arithmetic the trainer's forward computes with, through vLLM's extension points.

* Linear layers, the LM head and routed experts: the quantization method ``fp8rl_exact``
  (:class:`ExactConfig`), under every recipe. It creates vLLM's own parameters (block-FP8 codes and
  scales for the linears and experts the plan runs in FP8, plain weights for the others), so loading
  and refits are those of ``fp8_block_emulated`` and vLLM's unquantized layers; after each load it holds
  the operands of :func:`fp8rl.exact.linear` and computes with them.
* RMSNorm, the rotary embeddings (``default`` and ``llama3``) and SiluAndMul: out-of-tree custom ops
  (vLLM's ``CustomOp.register_oot``) that call :func:`fp8rl.exact.rms_norm`, ``apply_rope`` with
  :func:`~fp8rl.exact.rope_cos_sin`, and ``silu_and_mul``.
* Attention: vLLM's CPU attention backend overridden (``register_backend``) by :class:`ExactAttentionBackend`,
  whose implementation keeps K and V in the paged cache in its own layout and attends every query of
  the batch, prefill or decode, with :func:`fp8rl.exact.attention` over its request's keys.
* Routers: every MoE layer's router is given :func:`fp8rl.exact.route` as its routing function
  (:func:`exact_routing`, through the worker extension).

The registrations are process-wide in vLLM, so they hold only while an engine is built
(:func:`exact_engine`). The logprobs come from vLLM's sampler, unchanged: ``log_softmax`` of each
request's processed logits row, which is a function of that row alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, FusedMoEQuantConfig, RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from fp8rl import exact
from rollout_service.vllm_fp8 import (
    EmulatedBlockFP8Config,
    EmulatedBlockFP8LinearMethod,
    EmulatedBlockFP8MoEMethod,
    EmulatedFP8KVCacheMethod,
    KVCacheDtype,
)

NAME = "fp8rl_exact"
BLOCK_SIZE = 16
"""Tokens per KV cache block: the unit of vLLM's prefix cache, which shares only whole blocks. Its CPU
default (128) is longer than most RL prompts, so the samples of one prompt each computed the whole
prompt; at 16 they share all but its last partial block. A key and value are the same bits wherever
they are computed (exact mode), so a prompt taken from the cache changes no logprob."""


class ExactConfig(EmulatedBlockFP8Config):
    """``fp8rl_exact``: every linear, the LM head and the experts through :mod:`fp8rl.exact`; ``fp8``:
    whether the block linears and experts the plan does not keep in high precision are FP8 (the FP8
    recipes) or all stay in the compute dtype (``bf16``)."""

    def __init__(
        self,
        scale_format: Any = "fp32",
        kv_cache: KVCacheDtype = "auto",
        ignored_layers: list[str] | None = None,
        fp8: bool = True,
    ) -> None:
        super().__init__(scale_format, kv_cache, ignored_layers)
        self.fp8 = fp8

    def get_name(self) -> str:  # type: ignore[override]
        return NAME

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ExactConfig:
        base = EmulatedBlockFP8Config.from_config(config)
        if not isinstance(config.get("fp8", True), bool):
            raise ValueError(f"{NAME}: fp8 must be true or false")
        return cls(base.scale_format, base.kv_cache, base.ignored_layers, bool(config.get("fp8", True)))

    def get_quant_method(self, layer: Any, prefix: str) -> QuantizeMethodBase | None:
        skipped = not self.fp8 or is_layer_skipped(prefix, self.ignored_layers, self.packed_modules_mapping)
        if isinstance(layer, ParallelLMHead):
            return ExactLMHeadMethod()
        if isinstance(layer, LinearBase):
            return ExactLinearMethod() if skipped else ExactBlockFP8LinearMethod(self.scale_format)
        if isinstance(layer, RoutedExperts):
            if skipped:
                return ExactUnquantizedMoEMethod(layer.moe_config)
            return ExactBlockFP8MoEMethod(layer.moe_config, self.scale_format)
        if isinstance(layer, Attention) and self.kv_cache == "fp8":
            return EmulatedFP8KVCacheMethod(self)
        return None


def quantization_config(
    fp8: bool, scale_format: Any, kv_cache: KVCacheDtype = "auto", ignored_layers: list[str] | None = None
) -> dict[str, Any]:
    """The model config's ``quantization_config`` that selects ``fp8rl_exact``."""
    return {
        "quant_method": NAME,
        "fp8": fp8,
        "scale_format": scale_format,
        "kv_cache": kv_cache,
        "ignored_layers": list(ignored_layers or ()),
    }


class ExactLinearMethod(UnquantizedLinearMethod):
    """vLLM's unquantized linear (its parameters and loaders), computed by :func:`fp8rl.exact.linear`
    in high precision. Its weight is never prepacked for oneDNN, so refits load into it as into any
    parameter."""

    def process_weights_after_loading(self, layer: Any) -> None:
        layer.fp8rl_exact = exact.GroupedOperand.high_precision(layer.weight.data)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return exact.linear(x, layer.fp8rl_exact, bias, fp8=None)


class ExactBlockFP8LinearMethod(EmulatedBlockFP8LinearMethod):
    """``fp8_block_emulated``'s block-FP8 linear, computed by :func:`fp8rl.exact.linear` from its codes
    and scales (kept as loaded, before the emulation dequantizes them)."""

    def process_weights_after_loading(self, layer: Any) -> None:
        layer.fp8rl_exact = exact.GroupedOperand.fp8_weight(layer.weight.data, layer.weight_scale_inv.data)
        super().process_weights_after_loading(layer)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return exact.linear(x, layer.fp8rl_exact, bias, fp8=self.scale_format)


class ExactLMHeadMethod(UnquantizedEmbeddingMethod):
    """vLLM's LM head (a tied one shares the embedding's weight), computed in high precision by
    :func:`fp8rl.exact.linear`; the input embedding is a lookup and stays vLLM's."""

    def process_weights_after_loading(self, layer: Any) -> None:
        layer.fp8rl_exact = exact.GroupedOperand.high_precision(layer.weight.data)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return exact.linear(x, layer.fp8rl_exact, bias, fp8=None)


class _ExactExperts:
    """The ``apply`` of both exact expert methods: the routed experts of a layer, from the operands its
    :meth:`process_weights_after_loading` kept (``layer.fp8rl_exact``: per expert, gate/up then down),
    by :func:`fp8rl.exact.moe`; FP8 in ``exact_format``, or high precision when None."""

    exact_format: Any = None

    def apply(
        self,
        layer: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if shared_experts is not None or layer.expert_map is not None:
            raise NotImplementedError(f"{NAME}: shared experts and expert parallelism are not exact")

        def gemm(expert: int, which: int, rows: torch.Tensor) -> torch.Tensor:
            return exact.linear(rows, layer.fp8rl_exact[which][expert], None, fp8=self.exact_format)

        return exact.moe(x, gemm, topk_weights, topk_ids.long())


class ExactBlockFP8MoEMethod(_ExactExperts, EmulatedBlockFP8MoEMethod):
    """``fp8_block_emulated``'s block-FP8 experts, computed by :func:`fp8rl.exact.moe`."""

    def __init__(self, moe: Any, scale_format: Any) -> None:
        super().__init__(moe, scale_format)
        self.exact_format = scale_format

    def process_weights_after_loading(self, layer: Any) -> None:
        layer.fp8rl_exact = tuple(
            [
                exact.GroupedOperand.fp8_weight(codes, scales)
                for codes, scales in zip(
                    getattr(layer, f"{stem}_weight").data,
                    getattr(layer, f"{stem}_weight_scale_inv").data,
                    strict=True,
                )
            ]
            for stem in ("w13", "w2")
        )
        super().process_weights_after_loading(layer)


class ExactUnquantizedMoEMethod(_ExactExperts, FusedMoEMethodBase):
    """vLLM's unquantized routed experts (its parameters and expert loaders), computed by
    :func:`fp8rl.exact.moe` in high precision; no CPU kernel, so nothing is prepacked."""

    create_weights = UnquantizedFusedMoEMethod.create_weights

    def process_weights_after_loading(self, layer: Any) -> None:
        if self.moe.intermediate_size_per_partition_unpadded != layer.w2_weight.shape[-1]:
            raise ValueError(f"{NAME}: padded expert weights are not supported")
        layer.fp8rl_exact = tuple(
            [exact.GroupedOperand.high_precision(w) for w in getattr(layer, f"{stem}_weight").data]
            for stem in ("w13", "w2")
        )

    def get_fused_moe_quant_config(self, layer: Any) -> FusedMoEQuantConfig | None:
        return FusedMoEQuantConfig.make()


def route(
    hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``custom_routing_function`` signature for :func:`fp8rl.exact.route`."""
    weights, ids = exact.route(gating_output, topk, renormalize)
    return weights, ids.to(torch.int32)


def exact_routing(model: torch.nn.Module) -> int:
    """Give every MoE layer's router :func:`route`; returns how many."""
    from vllm.model_executor.layers.fused_moe import MoERunner
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    routers = [m.router for m in model.modules() if isinstance(m, MoERunner)]
    for router in routers:
        if not isinstance(router, CPURouter) or router.use_grouped_topk or router.scoring_func != "softmax":
            raise ValueError(
                f"{NAME}: only softmax top-k routing on CPU is exact, not {type(router).__name__}"
            )
        router.custom_routing_function = route
    return len(routers)


class ExactRMSNorm(RMSNorm):
    """vLLM's RMSNorm (and its fused residual add) by :func:`fp8rl.exact.rms_norm`."""

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if self.variance_size_override is not None or not self.has_weight:
            raise ValueError(f"{NAME}: RMSNorm over part of the hidden size, or without weight, is not exact")
        if residual is None:
            return exact.rms_norm(x, self.weight.data, self.variance_epsilon)
        x = x + residual
        return exact.rms_norm(x, self.weight.data, self.variance_epsilon), x

    forward_cpu = forward_native


class ExactSiluAndMul(SiluAndMul):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return exact.silu_and_mul(x)

    forward_cpu = forward_native


class _ExactRope:
    """Mixed into vLLM's rotary embeddings: the frequencies of the HF config's ``rope_parameters``
    (:func:`fp8rl.exact.rope_inv_freq`), angles and rotation by :mod:`fp8rl.exact`."""

    head_size: int
    rotary_dim: int
    is_neox_style: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from vllm.config import get_current_vllm_config

        super().__init__(*args, **kwargs)
        if self.rotary_dim != self.head_size or not self.is_neox_style:
            raise ValueError(f"{NAME}: only full-width NeoX-style rotary embeddings are exact")
        config = get_current_vllm_config().model_config.hf_config
        self.fp8rl_inv_freq = exact.rope_inv_freq(self.head_size, config.rope_parameters)

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        positions = positions.flatten()
        cos, sin = exact.rope_cos_sin(positions, self.fp8rl_inv_freq, query.dtype)
        cos, sin = cos[:, None], sin[:, None]

        def rotated(x: torch.Tensor) -> torch.Tensor:
            return exact.apply_rope(x.view(len(positions), -1, self.head_size), cos, sin).reshape(x.shape)

        return rotated(query), None if key is None else rotated(key)

    forward_cpu = forward_native


class ExactRotaryEmbedding(_ExactRope, RotaryEmbedding):
    pass


class ExactLlama3RotaryEmbedding(_ExactRope, Llama3RotaryEmbedding):
    pass


class ExactAttentionImpl(CPUAttentionBackendImpl):
    """Decoder self-attention by :func:`fp8rl.exact.attention`. K and V go into vLLM's paged cache
    ([blocks, kv heads, block size, 2 x head dim]) in this implementation's own layout: a slot's keys in
    the first head-dim columns, its values in the last; each request's keys are read back in position
    order through its block table."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        unsupported = {
            "a sliding window": self.sliding_window != -1,
            "ALiBi": self.alibi_slopes is not None,
            "a logits soft cap": bool(self.logits_soft_cap),
            "attention sinks": self.sinks is not None,
            f"attention type {self.attn_type}": self.attn_type != "decoder",
        }
        found = [what for what, present in unsupported.items() if present]
        if found:
            raise ValueError(f"{NAME}: attention with {', '.join(found)} is not exact")

    def do_kv_cache_update(
        self,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        block_size, d = kv_cache.shape[2], key.shape[-1]
        slots = slot_mapping[: key.shape[0]].long()
        real = slots >= 0
        slots, key, value = slots[real], key[: len(real)][real], value[: len(real)][real]
        blocks, offsets = slots // block_size, slots % block_size
        kv_cache[blocks, :, offsets, :d] = key.to(kv_cache.dtype)
        kv_cache[blocks, :, offsets, d:] = value.to(kv_cache.dtype)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn_metadata is None:  # (warm-up)
            return output
        tokens = attn_metadata.num_actual_tokens
        starts = attn_metadata.query_start_loc.long()
        seq_lens = attn_metadata.seq_lens.long()
        requests = len(seq_lens)
        counts = starts[1 : requests + 1] - starts[:requests]
        block_size, d = kv_cache.shape[2], query.shape[-1]
        longest_query, longest = int(counts.max()), int(seq_lens.max())
        # Each request's keys and values, positions 0 .. seq_len - 1, from its blocks.
        positions = torch.arange(longest, device=query.device)
        table = attn_metadata.block_table[:requests].long()
        columns = (positions // block_size).clamp(max=table.shape[1] - 1)[None].expand(requests, -1)
        cached = kv_cache[table.gather(1, columns), :, (positions % block_size)[None].expand(requests, -1)]
        written = (
            positions[None, :] < seq_lens[:, None]
        )  # (past a request's length: whatever the block holds)
        cached = torch.where(written[:, :, None, None], cached, torch.zeros_like(cached))  # [R, L, KV, 2D]
        keys, values = cached[..., :d].transpose(1, 2), cached[..., d:].transpose(1, 2)
        # Each query: its request and index; its position is seq_len - count + index.
        request_of = torch.repeat_interleave(torch.arange(requests, device=query.device), counts)
        index = torch.arange(tokens, device=query.device) - starts[request_of]
        queries = query.new_zeros(requests, longest_query, *query.shape[1:])
        queries[request_of, index] = query[:tokens]
        position = (seq_lens - counts)[:, None] + torch.arange(longest_query, device=query.device)[None]
        allowed = (positions[None, None, :] <= position[:, :, None]) & written[:, None, :]
        allowed &= torch.arange(longest_query, device=query.device)[None, :, None] < counts[:, None, None]
        attended = exact.attention(
            queries.transpose(1, 2),
            keys.to(query.dtype),
            values.to(query.dtype),
            allowed[:, None],
            self.scale,
        )
        output[:tokens] = attended.transpose(1, 2)[request_of, index].to(output.dtype)
        return output


class ExactAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend (its metadata, cache shape and scheduling) with
    :class:`ExactAttentionImpl` computing."""

    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return ExactAttentionImpl

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(BLOCK_SIZE)]  # (vLLM's CPU kernels want 32; this implementation any size)


_OOT_OPS = {
    "RMSNorm": ExactRMSNorm,
    "SiluAndMul": ExactSiluAndMul,
    "RotaryEmbedding": ExactRotaryEmbedding,
    "Llama3RotaryEmbedding": ExactLlama3RotaryEmbedding,
}


def register() -> None:
    """Make ``fp8rl_exact`` known to vLLM (idempotent)."""
    if NAME not in QUANTIZATION_METHODS:
        register_quantization_config(NAME)(ExactConfig)


@contextlib.contextmanager
def exact_engine() -> Iterator[None]:
    """Within: the vLLM engines built use the exact custom ops and attention (module docstring).
    vLLM resolves both when it builds a model, so an engine built within keeps them, and one built
    after does not."""
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register()
    taken = {name: op_registry_oot.pop(name) for name in _OOT_OPS if name in op_registry_oot}
    for name, op in _OOT_OPS.items():
        op.name = name  # type: ignore[attr-defined]
        op_registry_oot[name] = op
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.{ExactAttentionBackend.__qualname__}")
    selector._cached_get_attn_backend.cache_clear()  # (vLLM caches the class a backend name resolves to)
    try:
        yield
    finally:
        AttentionBackendEnum.CPU_ATTN.clear_override()
        selector._cached_get_attn_backend.cache_clear()
        for name in _OOT_OPS:
            op_registry_oot.pop(name, None)
        op_registry_oot.update(taken)
