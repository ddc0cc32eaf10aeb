"""The model families fp8rl supports, and which of a model's linear layers run in FP8. Pure Python.

Both engines decide from the checkpoint's ``config.json`` with :func:`fp8_plan`, so the trainer's FP8
linears, the weights on the wire and the rollout's quantization agree layer for layer.

The rule comes from vLLM's block-FP8 GEMMs (``validate_fp8_block_shape``): vLLM fuses q/k/v into one
GEMM and gate/up into another, and a 128x128 weight block cannot straddle two shards, so in a fused GEMM
every shard but the last must have a multiple of 128 rows; with tensor parallelism every shard's rows
per rank, and the input columns per rank of a row-parallel GEMM (o_proj, down_proj), too. A fused group
that breaks the rule stays in the compute dtype in both engines (all its shards: vLLM quantizes a fused
GEMM whole or not at all), named in vLLM's ``ignored_layers``; every other linear inside the blocks is
FP8, edge blocks included.

Mixture-of-experts layers (``qwen3_moe``): every expert's gate, up and down GEMMs are FP8 when the
expert intermediate size per rank is a multiple of 128 (vLLM's ``validate_fp8_block_shape_moe``: its
fused w13 stacks each expert's gate and up, and shards them by rows across ranks), otherwise every
expert of every MoE layer stays in the compute dtype. The router (``mlp.gate``) always does, named
exactly: routing decisions are never made from quantized weights, in either engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK = 128

FAMILIES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
"""``model_type`` -> the HF class both engines load (tied or untied embeddings, GQA, Qwen3's q/k norms,
Qwen3's mixture of experts)."""

MOE_FAMILIES = frozenset({"qwen3_moe"})
"""Families whose decoder layers may hold a sparse MoE block (``mlp.gate`` + ``mlp.experts``)."""

ROUTER = "mlp.gate"
"""The router of an MoE layer (module name within the layer): always high precision, by exact name."""

ROUTERS = (ROUTER, "mlp.shared_expert_gate")
"""Module names within a layer that gate experts (Qwen2-MoE's shared-expert gate too): never FP8 in
either engine, whatever the plan says, matched by exact name (``mlp.gate_proj`` is not ``mlp.gate``)."""


def is_router(module: str) -> bool:
    """True for a router's module name (``model.layers.3.mlp.gate``; not ``...mlp.gate_proj``)."""
    return module.endswith(tuple(f".{r}" for r in ROUTERS))


EXPERTS = "mlp.experts"
EXPERT_GEMMS = ("gate_proj", "up_proj", "down_proj")
"""The per-expert linears of an MoE layer as checkpoints (and vLLM's loader) name them:
``mlp.experts.{e}.gate_proj`` ... (transformers fuses them into 3-D ``gate_up_proj`` / ``down_proj``)."""

FUSED_GEMMS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
"""vLLM's fused GEMMs of a decoder layer, and the HF linears they are made of (in vLLM's order)."""


class UnsupportedArchitecture(ValueError):
    """A checkpoint of a family the engines are not declared and tested for."""


def read_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def check_supported(config: dict[str, Any], where: str = "model") -> str:
    """The family (``model_type``) of a checkpoint's config, or :class:`UnsupportedArchitecture`."""
    family = config.get("model_type")
    if family not in FAMILIES:
        raise UnsupportedArchitecture(
            f"{where}: model_type {family!r} ({', '.join(config.get('architectures') or ['?'])}) is not "
            f"supported; supported: {', '.join(sorted(FAMILIES))} (docs/architectures.md)"
        )
    return str(family)


@dataclass(frozen=True)
class FP8Plan:
    """Which linears of the decoder layers run in FP8. ``high_precision``: HF module names kept in the
    compute dtype, with ``reasons`` (one line per fused group and layer-independent cause)."""

    high_precision: frozenset[str]
    reasons: tuple[str, ...]
    layers: int

    def is_fp8(self, weight_name: str) -> bool:
        """For a block linear's weight (``model.layers.N.<module>.weight``): does it ship and run in FP8?"""
        return weight_name.removesuffix(".weight") not in self.high_precision

    def summary(self) -> dict[str, Any]:
        """What a run records: the modules kept in high precision (per layer, as patterns, experts as
        ``mlp.experts.*.gate_proj``), the layers each is kept in, and why; ``summary`` in one line."""
        layers_of: dict[str, set[int]] = {}
        for m in self.high_precision:
            _, _, index, rest = m.split(".", 3)
            layers_of.setdefault(re.sub(r"^mlp\.experts\.\d+\.", "mlp.experts.*.", rest), set()).add(
                int(index)
            )
        where = {
            module: "every layer" if len(found) == self.layers else _layer_list(sorted(found))
            for module, found in sorted(layers_of.items())
        }
        by_place: dict[str, list[str]] = {}
        for module, place in where.items():
            by_place.setdefault(place, []).append(module)
        line = "all block linears in FP8"
        if by_place:
            line += " but " + "; ".join(f"{', '.join(m)} ({place})" for place, m in by_place.items())
        return {
            "summary": line,
            "high_precision_per_layer": sorted(layers_of),
            "high_precision_layers": where,
            "reasons": list(self.reasons),
            "layers": self.layers,
        }


def _layer_list(layers: list[int]) -> str:
    return ("layer " if len(layers) == 1 else "layers ") + ", ".join(map(str, layers))


def _shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(rows, columns) of each linear of one decoder layer, by its module name within the layer."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    return {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def num_experts(config: dict[str, Any]) -> int:
    """Experts per MoE layer: ``num_experts`` (Qwen's checkpoints) or ``num_local_experts`` (what
    transformers 5.x writes for the same attribute)."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def moe_layers(config: dict[str, Any]) -> list[int]:
    """The decoder layers that hold a sparse MoE block, as transformers builds them: all but
    ``mlp_only_layers``, every ``decoder_sparse_step``-th (1: all), none without experts; the others have
    a dense MLP of ``intermediate_size``."""
    if config.get("model_type") not in MOE_FAMILIES or not num_experts(config):
        return []
    dense = set(config.get("mlp_only_layers") or ())
    step = int(config.get("decoder_sparse_step") or 1)
    return [i for i in range(int(config["num_hidden_layers"])) if i not in dense and (i + 1) % step == 0]


def expert_modules(layer: int, experts: int) -> list[str]:
    """The per-expert module names of MoE layer ``layer`` (``model.layers.3.mlp.experts.0.gate_proj``, ...),
    as on the wire and in vLLM's ``ignored_layers``."""
    return [f"model.layers.{layer}.{EXPERTS}.{e}.{g}" for e in range(experts) for g in EXPERT_GEMMS]


def _moe_high_precision(config: dict[str, Any], tp: int) -> tuple[set[str], list[str]]:
    """The routers, and the experts when their intermediate size per rank is off the 128-grid."""
    layers = moe_layers(config)
    if not layers:
        return set(), []
    kept = {f"model.layers.{i}.{ROUTER}" for i in layers}
    reasons = [f"{ROUTER} (the router) stays high precision in every MoE layer"]
    inter = int(config["moe_intermediate_size"])
    if (inter // tp) % BLOCK or inter % tp:
        for i in layers:
            kept.update(expert_modules(i, num_experts(config)))
        reasons.append(
            f"{EXPERTS} stay high precision: moe_intermediate_size {inter // tp} per rank, not a multiple "
            f"of {BLOCK}"
        )
    return kept, reasons


def fp8_plan(
    config: dict[str, Any],
    tensor_parallel_size: int = 1,
    first_layers: int = 0,
    last_layers: int = 0,
    patterns: Sequence[str] = (),
) -> FP8Plan:
    """The FP8 layers of a supported checkpoint's config under vLLM's block-FP8 rule (module docstring),
    for replicas with ``tensor_parallel_size`` ranks; besides, every linear of the ``first_layers``
    first and ``last_layers`` last decoder layers, and those whose module name fully matches one of
    ``patterns`` (regular expressions; with the rest of their fused group, or of their layer's experts),
    stay in the compute dtype. A pattern that matches no linear is a ValueError."""
    check_supported(config)
    tp = tensor_parallel_size
    shapes = _shapes(config)
    kept: set[str] = set()
    reasons: list[str] = []
    for fused, parts in FUSED_GEMMS.items():
        # Every shard but the last must end on a block boundary; with tp > 1 each rank's part of each.
        checked = parts if tp > 1 else parts[:-1]
        bad = [(p, shapes[p][0]) for p in checked if (shapes[p][0] // tp) % BLOCK or shapes[p][0] % tp]
        if bad:
            kept.update(parts)
            rows = ", ".join(f"{p.split('.')[-1]} {r // tp} rows" for p, r in bad)
            reasons.append(f"{fused} stays high precision: {rows} per rank, not a multiple of {BLOCK}")
    if tp > 1:
        for module in ROW_PARALLEL:
            columns = shapes[module][1]
            if (columns // tp) % BLOCK or columns % tp:
                kept.add(module)
                reasons.append(f"{module} stays high precision: {columns // tp} input columns per rank")
    layers = int(config["num_hidden_layers"])
    sparse = set(moe_layers(config))  # (their mlp is the router and experts, not the dense linears)
    names = {
        f"model.layers.{i}.{m}"
        for i in range(layers)
        for m in kept
        if not (i in sparse and m.startswith("mlp."))
    }
    if sparse and len(sparse) == layers:  # no dense MLP anywhere: its rule says nothing
        reasons = [r for r in reasons if not r.startswith("mlp.")]
    moe_kept, moe_reasons = _moe_high_precision(config, tp)
    chosen, chosen_reasons = _chosen_high_precision(config, first_layers, last_layers, patterns)
    return FP8Plan(
        frozenset(names | moe_kept | chosen), tuple(reasons + moe_reasons + chosen_reasons), layers
    )


def fp8_share(config: dict[str, Any], plan: FP8Plan) -> float:
    """The fraction of the block linears' weights (so of their GEMM work per token, with every expert
    counted) that ``plan`` runs in FP8."""
    shapes = _shapes(config)
    hidden, inter = int(config["hidden_size"]), int(config.get("moe_intermediate_size") or 0)

    def size(name: str) -> int:
        if ".experts." in name:
            return hidden * inter
        rows, columns = shapes[name.split(".", 3)[3]]
        return rows * columns

    sizes = {
        name: size(name)
        for i in range(int(config["num_hidden_layers"]))
        for group in layer_linears(config, i)
        for name in group
    }
    fp8 = sum(n for name, n in sizes.items() if name not in plan.high_precision)
    return fp8 / sum(sizes.values())


def layer_linears(config: dict[str, Any], layer: int) -> list[list[str]]:
    """The linears of decoder layer ``layer`` (HF module names), in the groups vLLM computes as one GEMM
    each: q/k/v, o_proj, gate/up, down_proj; in an MoE layer all its experts' linears are one group
    (vLLM quantizes a fused MoE layer whole) and the router is none (never FP8)."""
    prefix = f"model.layers.{layer}"
    groups = [[f"{prefix}.{p}" for p in FUSED_GEMMS["self_attn.qkv_proj"]], [f"{prefix}.self_attn.o_proj"]]
    if layer in moe_layers(config):
        return [*groups, expert_modules(layer, num_experts(config))]
    mlp = [[f"{prefix}.{p}" for p in FUSED_GEMMS["mlp.gate_up_proj"]], [f"{prefix}.mlp.down_proj"]]
    return groups + mlp


def _chosen_high_precision(
    config: dict[str, Any], first: int, last: int, patterns: Sequence[str]
) -> tuple[set[str], list[str]]:
    """The linears a run chose to keep in high precision (:func:`fp8_plan`'s knobs), with reasons."""
    layers = int(config["num_hidden_layers"])
    whole = set(range(min(first, layers))) | set(range(max(layers - last, 0), layers))
    kept = {name for i in whole for group in layer_linears(config, i) for name in group}
    reasons = []
    if first:
        reasons.append(
            f"layers 0..{min(first, layers) - 1} stay high precision (high_precision_first_layers {first})"
        )
    if last:
        start = max(layers - last, 0)
        reasons.append(
            f"layers {start}..{layers - 1} stay high precision (high_precision_last_layers {last})"
        )
    for pattern in patterns:
        matched = [
            group
            for i in range(layers)
            for group in layer_linears(config, i)
            if any(re.fullmatch(pattern, name) for name in group)
        ]
        if not matched:
            raise ValueError(f"high_precision_modules: {pattern!r} matches no linear of this model")
        kept.update(name for group in matched for name in group)
        reasons.append(f"{pattern!r} stays high precision: {len(matched)} GEMM(s), their fused groups whole")
    return kept, reasons


def vllm_ignored_layers(plan: FP8Plan) -> list[str]:
    """``ignored_layers`` of vLLM's quantization config: the unfused HF module names (vLLM maps a fused
    GEMM's prefix onto its parts and skips it only if all of them are listed), the routers
    (``model.layers.N.mlp.gate``) and, where experts stay high precision, every expert's module names."""
    return sorted(plan.high_precision)
