"""vLLM quantization method ``fp8_block_emulated``: block-FP8 checkpoints on hardware without FP8 GEMMs.

Linear layers create exactly vLLM's block-FP8 parameters — ``weight`` (float8_e4m3fn,
ModelWeightParameter) and ``weight_scale_inv`` (float32 [ceil(N/128), ceil(K/128)],
BlockQuantScaleParameter), ``layer.weight_block_size = [128, 128]`` — so vLLM's own loaders shard fused
q/k/v and gate/up weights and their block scales, and a refit sends the same checkpoint-format tensors
on CPU as on GPU. The linears listed in the config's ``ignored_layers`` (fp8rl.architectures: fused
GEMMs vLLM's block-FP8 cannot serve) stay unquantized, as under vLLM's own ``fp8`` method. Three
differences from vLLM's ``Fp8LinearMethod``:

* a bf16/float32 checkpoint is quantized at first load with :mod:`fp8rl.quant` (the trainer's own
  quantizer, so both sides hold identical codes and scales);
* after loading, the weight is dequantized once to the compute dtype;
* ``apply`` fake-quantizes activations per token in 1x128 groups with vLLM's own arithmetic (that of
  its CUDA per-token-group quantizer), then runs a plain GEMM.

Routed experts (vLLM's ``FusedMoE``: its ``RoutedExperts`` layer) get the same treatment
(:class:`EmulatedBlockFP8MoEMethod`): vLLM's block-FP8 MoE parameters (``w13_weight`` [E, 2I, H] and
``w2_weight`` [E, H, I], float8_e4m3fn, with one float32 ``*_weight_scale_inv`` grid of 128x128 blocks
per expert), loaded by vLLM's expert loader from the per-expert names
``mlp.experts.{e}.{gate,up,down}_proj.weight`` and ``.weight_scale_inv``; vLLM's router runs before the
method on the router linear ``mlp.gate``, which must be in ``ignored_layers`` by its exact name (vLLM
builds it as a ``ReplicatedLinear``).

On CPU, the ``bf16`` recipes' routed experts run vLLM's own unquantized experts (float32-exact), made
refit-safe by :class:`RefitUnquantizedMoEMethod`: vLLM 0.32 prepacks its CPU experts' weights at first
load only, so after an in-place reload they would compute with unpacked weights read as packed.

With ``kv_cache: fp8`` attention layers emulate, the same way, FP8 attention over an FP8 (E4M3) KV cache
as vLLM runs it on Hopper (FlashAttention-3): they take vLLM's per-layer ``q_scale`` / ``k_scale`` /
``v_scale`` from the checkpoint or a refit (by vLLM's rule where one did not come), and round the query,
keys (after RoPE) and values through E4M3 with them as they enter the attention
(:func:`fp8rl.quant.fake_quantize_query`, :func:`~fp8rl.quant.fake_quantize_kv`: vLLM's arithmetic), so
that what is cached and attended with is what FP8 attention would use. vLLM's own cache stays in the
compute dtype: its CPU FP8-cache kernels need AVX-512 or AMX, this emulation runs on any CPU.

The numerics are those of the FP8 recipe, computed in the compute dtype. The scale format (``fp32`` or
``pow2``) and the cache come with the quantization config: ``{"quant_method": NAME, "scale_format": ...,
"kv_cache": "auto" | "fp8"}``, which the engine passes through ``hf_overrides``. Registered in-process by
:func:`register` and, for engine worker processes, through the ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, FusedMoEQuantConfig, RoutedExperts
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.layers.quantization.utils.fp8_utils import (
    create_fp8_scale_parameter,
    create_fp8_weight_parameter,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.parameter import BlockQuantScaleParameter
from vllm.model_executor.utils import is_weights_pre_processed, set_weight_attrs
from vllm.platforms import current_platform

from fp8rl import quant
from fp8rl.quant import SCALE_FORMATS, ScaleFormat

NAME = "fp8_block_emulated"
BLOCK = list(quant.WEIGHT_BLOCK)


class EmulatedBlockFP8Config(QuantizationConfig):
    """Block-FP8 (128x128 weights, dynamic 1x128 activations) for every linear layer but
    ``ignored_layers`` (HF module names; a fused GEMM is skipped when all its parts are listed, as by
    vLLM's own ``fp8`` method), which stay unquantized."""

    def __init__(
        self,
        scale_format: ScaleFormat = "fp32",
        kv_cache: KVCacheDtype = "auto",
        ignored_layers: list[str] | None = None,
        activation_arithmetic: quant.Arithmetic = "vllm",
    ) -> None:
        super().__init__()
        self.weight_block_size = BLOCK
        self.scale_format = scale_format
        self.kv_cache = kv_cache
        self.ignored_layers = ignored_layers or []
        self.activation_arithmetic = activation_arithmetic

    def get_name(self) -> str:  # type: ignore[override]
        return NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @classmethod
    def get_config_filenames(cls) -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EmulatedBlockFP8Config:
        scale_format = config.get("scale_format", "fp32")
        if scale_format not in SCALE_FORMATS:
            raise ValueError(f"{NAME}: scale_format {scale_format!r} is not one of {SCALE_FORMATS}")
        kv_cache = config.get("kv_cache", "auto")
        if kv_cache not in ("auto", "fp8"):
            raise ValueError(f"{NAME}: kv_cache {kv_cache!r} is not auto or fp8")
        ignored = config.get("ignored_layers", [])
        if not (isinstance(ignored, list) and all(isinstance(name, str) for name in ignored)):
            raise ValueError(f"{NAME}: ignored_layers must be a list of module names")
        arithmetic = config.get("activation_arithmetic", "vllm")
        if arithmetic not in ("vllm", "te"):
            raise ValueError(f"{NAME}: activation_arithmetic {arithmetic!r} is not vllm or te")
        return cls(scale_format, kv_cache, ignored, arithmetic)

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        # (As vLLM's fp8 method: HF module names mapped onto the model's own, where a model renames.)
        self.ignored_layers = hf_to_vllm_mapper.apply_list(self.ignored_layers)

    def get_quant_method(self, layer: Any, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            # vLLM's own rule (and Fp8Config's): a fused GEMM is skipped when all its parts are listed.
            if is_layer_skipped(prefix, self.ignored_layers, self.packed_modules_mapping):
                return UnquantizedLinearMethod()
            return EmulatedBlockFP8LinearMethod(self.scale_format, self.activation_arithmetic)
        if isinstance(layer, RoutedExperts):
            # Experts the plan keeps in the compute dtype (an intermediate size off the 128-grid) are
            # listed one by one; vLLM's rule skips the layer when they are. None: vLLM's unquantized
            # experts (on CPU the refit-safe RefitUnquantizedMoEMethod, registered below).
            if is_layer_skipped(prefix, self.ignored_layers, self.packed_modules_mapping):
                return None
            return EmulatedBlockFP8MoEMethod(layer.moe_config, self.scale_format, self.activation_arithmetic)
        if isinstance(layer, Attention) and self.kv_cache == "fp8":
            return EmulatedFP8KVCacheMethod(self)
        return None


KVCacheDtype = Literal["auto", "fp8"]


def quantization_config(
    scale_format: ScaleFormat,
    kv_cache: KVCacheDtype = "auto",
    ignored_layers: Sequence[str] = (),
    activation_arithmetic: quant.Arithmetic = "vllm",
) -> dict[str, Any]:
    """The model config's ``quantization_config`` that selects this method in ``scale_format``, with an
    emulated FP8 KV cache if ``kv_cache`` is ``fp8``, ``ignored_layers`` (HF module names) in the
    compute dtype, and activations quantized with ``activation_arithmetic`` (vLLM's, unless a
    consistency check asks for the trainer's)."""
    return {
        "quant_method": NAME,
        "scale_format": scale_format,
        "kv_cache": kv_cache,
        "ignored_layers": list(ignored_layers),
        "activation_arithmetic": activation_arithmetic,
    }


class EmulatedFP8KVCacheMethod(BaseKVCacheMethod):
    """Loads ``q_scale`` / ``k_scale`` / ``v_scale`` as vLLM's FP8 attention does (vLLM's loaders and
    in-place reload handle them: its parameters), then rounds the query, keys and values through E4M3 with
    them on their way into the attention layer."""

    def process_weights_after_loading(self, layer: Any) -> None:
        if not hasattr(layer, "k_scale"):  # (vLLM's reload calls this only after loading some scales)
            return
        q, k, v = _scales_in_force(float(layer.q_scale), float(layer.k_scale), float(layer.v_scale))
        for buffer, value in ((layer._q_scale, q), (layer._k_scale, k), (layer._v_scale, v)):
            buffer.fill_(value)
        layer._q_scale_float, layer._k_scale_float, layer._v_scale_float = q, k, v
        for name in ("k_scale", "v_scale", "q_scale", "prob_scale"):  # (as vLLM: a reload makes them anew)
            delattr(layer, name)
        if not getattr(layer, "fp8rl_attention_hook", None):
            layer.fp8rl_attention_hook = layer.register_forward_pre_hook(
                _through_fp8_attention, with_kwargs=True
            )


def _scales_in_force(q: float, k: float, v: float) -> tuple[float, float, float]:
    """vLLM's rule (BaseKVCacheMethod) for the scales a checkpoint or refit brought (-1: not brought): k
    and v as given, 1.0 if neither came, the one that came for both if only one did; q as given, else
    1.0. (A replica's schema asks for all three.)"""
    if k <= 0 and v <= 0:
        k = v = 1.0
    elif k <= 0 or v <= 0:
        k = v = max(k, v)
    return (q if q > 0 else 1.0), k, v


_ATTENTION_INPUTS = ("query", "key", "value")


def _through_fp8_attention(
    layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``Attention.forward(query, key, value, ...)``'s inputs, given by position or name, as FP8 attention
    computes with them (a key and value of None, a layer sharing another's cache, stay None)."""

    def rounded(name: str, x: Any) -> Any:
        if x is None:
            return None
        scale = torch.tensor(getattr(layer, f"_{name[0]}_scale_float"), dtype=torch.float32)
        return quant.fake_quantize_query(x, scale) if name == "query" else quant.fake_quantize_kv(x, scale)

    args = tuple(rounded(_ATTENTION_INPUTS[i], x) if i < 3 else x for i, x in enumerate(args))
    kwargs = {n: rounded(n, x) if n in _ATTENTION_INPUTS else x for n, x in kwargs.items()}
    return args, kwargs


class EmulatedBlockFP8LinearMethod(LinearMethodBase):
    def __init__(self, scale_format: ScaleFormat = "fp32", arithmetic: quant.Arithmetic = "vllm") -> None:
        self.scale_format = scale_format
        self.arithmetic = arithmetic

    def create_weights(
        self,
        layer: Any,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        for rows in output_partition_sizes[:-1]:
            if rows % BLOCK[0]:
                # A shard that does not end on a block boundary would share a scale with its neighbour
                # (vLLM's validate_fp8_block_shape; fp8rl.architectures keeps such GEMMs unquantized).
                raise ValueError(
                    f"{NAME}: a fused GEMM's shard of {rows} rows is not a multiple of {BLOCK[0]}; list its "
                    "parts in ignored_layers"
                )
        weight_loader = extra_weight_attrs["weight_loader"]

        def load_weight(
            param: torch.nn.Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any
        ) -> Any:
            if loaded_weight.dtype != quant.FP8_DTYPE:  # a high-precision checkpoint: quantize it here
                loaded_weight, scale_inv = quant.quantize_blockwise(
                    loaded_weight, scale_format=self.scale_format
                )
                weight_loader(layer.weight_scale_inv, scale_inv, *args, **kwargs)
            return weight_loader(param, loaded_weight, *args, **kwargs)

        layer.logical_widths = output_partition_sizes
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = sum(output_partition_sizes)
        layer.orig_dtype = params_dtype
        layer.weight_block_size = BLOCK
        weight = create_fp8_weight_parameter(
            layer.output_size_per_partition, input_size_per_partition, load_weight
        )
        layer.register_parameter("weight", weight)
        # (vLLM annotates the parameter class argument as an instance, hence the ignore.)
        scale = create_fp8_scale_parameter(
            BlockQuantScaleParameter,  # type: ignore[arg-type]
            output_partition_sizes,
            input_size_per_partition,
            BLOCK,
            weight_loader,
        )
        layer.register_parameter("weight_scale_inv", scale)

    def process_weights_after_loading(self, layer: Any) -> None:
        # Dequantize once; the scales stay so that the codes can be recovered exactly (re-quantizing a
        # dequantized block reproduces its codes and scale).
        weight = quant.dequantize_blockwise(
            layer.weight.data, layer.weight_scale_inv.data, dtype=layer.orig_dtype
        )
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        xq = quant.fake_quantize_activation(x, scale_format=self.scale_format, arithmetic=self.arithmetic)
        return F.linear(xq, layer.weight, bias)


MOE_STEMS = ("w13", "w2")
"""vLLM's expert parameters: ``w13`` (gate and up, [E, 2I, H]) and ``w2`` (down, [E, H, I])."""


class EmulatedBlockFP8MoEMethod(FusedMoEMethodBase):
    """Block-FP8 routed experts (vLLM's ``FusedMoE``), as :class:`EmulatedBlockFP8LinearMethod` for
    linears: vLLM's block-FP8 MoE parameters (those of its ``Fp8MoEMethod``), loaded by vLLM's own
    expert weight loader from per-expert checkpoint names (``experts.{e}.{gate,up,down}_proj.weight``
    and ``.weight_scale_inv``); a high-precision checkpoint quantized per expert at first load with
    :mod:`fp8rl.quant`; dequantized once after loading; and in :meth:`apply`, for each expert, its
    tokens' activations fake-quantized 1x128 before the gate/up GEMM and again before down_proj.

    The router runs before this method (vLLM's own, on the high-precision ``mlp.gate``): ``apply``
    receives its top-k weights and expert ids."""

    def __init__(
        self, moe: Any, scale_format: ScaleFormat = "fp32", arithmetic: quant.Arithmetic = "vllm"
    ) -> None:
        super().__init__(moe)
        self.scale_format = scale_format
        self.arithmetic = arithmetic

    def create_weights(
        self,
        layer: Any,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        intermediate = intermediate_size_per_partition
        if intermediate % BLOCK[0]:  # (vLLM's validate_fp8_block_shape_moe: gate and up share w13)
            raise ValueError(
                f"{NAME}: the experts' intermediate size per partition ({intermediate}) is not a multiple "
                f"of {BLOCK[0]}"
            )
        if not self.moe.is_act_and_mul or self.moe.activation != MoEActivation.SILU or self.moe.has_bias:
            raise ValueError(f"{NAME}: only SiLU-gated experts without biases are emulated")
        layer.orig_dtype = params_dtype
        layer.weight_block_size = BLOCK
        shapes = {"w13": (2 * intermediate, hidden_size), "w2": (hidden_size, intermediate)}
        weight_loader = extra_weight_attrs.pop("weight_loader")
        for stem, (rows, columns) in shapes.items():
            weight = torch.nn.Parameter(
                torch.empty(num_experts, rows, columns, dtype=quant.FP8_DTYPE), requires_grad=False
            )
            scale = torch.nn.Parameter(
                torch.ones(num_experts, -(-rows // BLOCK[0]), -(-columns // BLOCK[1]), dtype=torch.float32),
                requires_grad=False,
            )
            layer.register_parameter(f"{stem}_weight", weight)
            layer.register_parameter(f"{stem}_weight_scale_inv", scale)
            loader = self._quantizing_loader(layer, stem, weight_loader)
            set_weight_attrs(weight, {**extra_weight_attrs, "weight_loader": loader})
            # (vLLM's expert loader shards a scale by this attribute, as for Fp8MoEMethod's.)
            set_weight_attrs(
                scale,
                {
                    **extra_weight_attrs,
                    "weight_loader": self._recording_loader(f"{stem}_weight_scale_inv", weight_loader),
                    "quant_method": FusedMoeWeightScaleSupported.BLOCK.value,
                },
            )
        self.num_experts = num_experts
        self.loaded: set[tuple[str, str, int]] = set()

    def _recording_loader(self, name: str, weight_loader: Any) -> Any:
        """vLLM's expert loader for parameter ``name``, noting which expert shard it loaded."""

        def load_expert_tensor(
            param: torch.nn.Parameter,
            loaded_weight: torch.Tensor,
            weight_name: str,
            shard_id: str,
            expert_id: int,
            return_success: bool = False,
        ) -> Any:
            self.loaded.add((name, shard_id, expert_id))
            return weight_loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success)

        return load_expert_tensor

    def _quantizing_loader(self, layer: Any, stem: str, weight_loader: Any) -> Any:
        """vLLM's expert loader for ``{stem}_weight``, quantizing a high-precision expert slice (one
        expert's gate, up or down [N, K]) 128x128 first and loading its scales alongside."""
        load_weight = self._recording_loader(f"{stem}_weight", weight_loader)
        load_scale = self._recording_loader(f"{stem}_weight_scale_inv", weight_loader)

        def load_expert_weight(
            param: torch.nn.Parameter,
            loaded_weight: torch.Tensor,
            weight_name: str,
            shard_id: str,
            expert_id: int,
            return_success: bool = False,
        ) -> Any:
            if loaded_weight.dtype != quant.FP8_DTYPE:
                loaded_weight, scale_inv = quant.quantize_blockwise(
                    loaded_weight, scale_format=self.scale_format
                )
                scale = getattr(layer, f"{stem}_weight_scale_inv")
                load_scale(scale, scale_inv, f"{weight_name}_scale_inv", shard_id, expert_id, True)
            return load_weight(param, loaded_weight, weight_name, shard_id, expert_id, return_success)

        return load_expert_weight

    def _check_loaded(self, layer: Any) -> None:
        """Every expert's codes and scales came in this load. vLLM's in-place reload materializes every
        parameter empty and loads what came, so an expert shard that did not come would compute with
        leftover memory (vime#248: NaN expert scales after a layerwise reload)."""
        shards = {"w13": ("w1", "w3"), "w2": ("w2",)}
        missing = [
            (name, shard, e)
            for stem in MOE_STEMS
            for name in (f"{stem}_weight", f"{stem}_weight_scale_inv")
            for shard in shards[stem]
            for e in range(self.num_experts)
            if (name, shard, e) not in self.loaded
        ]
        self.loaded = set()
        if missing:
            name, shard, expert = missing[0]
            raise ValueError(
                f"{NAME}: {layer.layer_name}: {len(missing)} expert tensors did not load (the first: "
                f"{name} of expert {expert}, shard {shard}); a refit must bring every expert's codes and "
                "scales"
            )

    def process_weights_after_loading(self, layer: Any) -> None:
        self._check_loaded(layer)
        # As for linears: dequantize once, keep the scales (re-quantizing recovers the codes).
        for stem in MOE_STEMS:
            codes = getattr(layer, f"{stem}_weight").data
            scales = getattr(layer, f"{stem}_weight_scale_inv").data
            if not (torch.isfinite(scales).all() and (scales > 0).all()):
                raise ValueError(f"{NAME}: {stem} scales of {layer.layer_name} not all positive and finite")
            weight = torch.stack(
                [
                    quant.dequantize_blockwise(q, s, dtype=layer.orig_dtype)
                    for q, s in zip(codes, scales, strict=True)
                ]
            )
            setattr(layer, f"{stem}_weight", torch.nn.Parameter(weight, requires_grad=False))

    def get_fused_moe_quant_config(self, layer: Any) -> FusedMoEQuantConfig | None:
        return FusedMoEQuantConfig.make()

    def apply(
        self,
        layer: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any,
        shared_experts_input: torch.Tensor | None,
    ) -> torch.Tensor:
        if shared_experts is not None or layer.expert_map is not None:
            raise NotImplementedError(f"{NAME}: shared experts and expert parallelism are not emulated")
        return moe_forward(
            x,
            layer.w13_weight,
            layer.w2_weight,
            topk_weights,
            topk_ids,
            lambda a: quant.fake_quantize_activation(
                a, scale_format=self.scale_format, arithmetic=self.arithmetic
            ),
        )


def moe_forward(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    fake_quantize: Any,
) -> torch.Tensor:
    """Routed SiLU-gated experts: ``x`` [T, H]; ``w13`` [E, 2I, H] (gate rows, then up), ``w2`` [E, H, I]
    (dequantized, ``x``'s dtype); ``topk_weights`` / ``topk_ids`` [T, k]. For each expert in ascending
    order, its tokens' inputs go through ``fake_quantize`` before each GEMM; the outputs are weighted
    (in ``x``'s dtype) and summed per token in that order. Returns [T, H]."""
    out, xq = torch.zeros_like(x), fake_quantize(x)  # (per token: the same codes for any subset of rows)
    for expert in topk_ids.unique().tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gate, up = F.linear(xq[token], w13[expert]).chunk(2, dim=-1)
        y = F.linear(fake_quantize(F.silu(gate) * up), w2[expert])
        out.index_add_(0, token, y * topk_weights[token, slot, None].to(x.dtype))
    return out


class RefitUnquantizedMoEMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized routed experts (what the ``bf16`` recipes serve on CPU), with the expert
    kernel's own weight processing run again whenever vLLM processes the layer again, as its in-place
    reload does at every refit.

    vLLM 0.32's method runs the kernel's processing only at first load (``_setup_kernel`` skips it on a
    weight update: a no-op for most CUDA kernels), but its CPU kernels prepack the weights into
    their grouped-GEMM layout there (``CPUUnquantizedExperts``: ``cpu_prepack_moe_weight``, after
    zero-padding the intermediate size to a multiple of 32). After a refit the layer would hold the new
    weights unpacked and the kernel read them as packed: measured on ``QWEN3_MOE`` in float32, at most
    1.4 of the largest output off a float64 reference after refitting with the very same weights (7e-7
    at load)."""

    def process_weights_after_loading(self, layer: Any) -> None:
        reload = self.moe_kernel is not None  # (set at first load)
        super().process_weights_after_loading(layer)
        if reload and self.moe_kernel is not None and not is_weights_pre_processed():
            # What vLLM's first load runs: zero-pad, then prepack the unpacked weights the reload brought
            # (vLLM then copies the result into the kernel's tensors, as for every reprocessed layer).
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)


def register() -> None:
    """Make ``fp8_block_emulated`` known to vLLM, and on CPU its unquantized experts refit-safe
    (:class:`RefitUnquantizedMoEMethod`, in place of every ``UnquantizedFusedMoEMethod``, by vLLM's
    out-of-tree op registry). Idempotent; also the general-plugin entry point, so worker processes
    register too."""
    if NAME in QUANTIZATION_METHODS:
        return
    register_quantization_config(NAME)(EmulatedBlockFP8Config)
    register_weight_loader_v2_supported_method(EmulatedBlockFP8LinearMethod)
    if current_platform.is_cpu():
        UnquantizedFusedMoEMethod.register_oot(RefitUnquantizedMoEMethod, name="UnquantizedFusedMoEMethod")
