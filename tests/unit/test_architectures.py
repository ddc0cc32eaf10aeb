"""fp8rl.architectures on mixture-of-experts configs: the routers always high precision by exact name,
the experts FP8 exactly when their intermediate size per rank is on the 128-grid, dense MLP layers
where the config says so."""

from __future__ import annotations

from typing import Any

import pytest

from fp8rl.architectures import check_supported, expert_modules, fp8_plan, moe_layers, vllm_ignored_layers
from fp8rl.codec.schema import is_block_linear, is_fp8_linear


def moe_config(**overrides: Any) -> dict[str, Any]:
    """Qwen3-30B-A3B's shape at test size: hidden 512, 8 experts of 256, top-2."""
    config: dict[str, Any] = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 512,
        "intermediate_size": 1536,
        "moe_intermediate_size": 256,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_hidden_layers": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    return config | overrides


def test_qwen3_moe_is_supported_and_only_its_routers_stay_high_precision() -> None:
    assert check_supported(moe_config()) == "qwen3_moe"
    plan = fp8_plan(moe_config())
    assert plan.high_precision == {f"model.layers.{i}.mlp.gate" for i in range(4)}
    assert vllm_ignored_layers(plan) == sorted(f"model.layers.{i}.mlp.gate" for i in range(4))
    assert plan.summary()["high_precision_per_layer"] == ["mlp.gate"]
    assert plan.is_fp8("model.layers.0.mlp.experts.7.gate_proj.weight")
    assert not plan.is_fp8("model.layers.3.mlp.gate.weight")


def test_the_router_is_matched_by_exact_name_never_as_a_substring() -> None:
    """``mlp.gate`` is a prefix of ``mlp.gate_proj`` and ``mlp.experts.gate_up_proj``: neither is a router."""
    plan = fp8_plan(moe_config())
    for name in (
        "model.layers.0.mlp.gate_proj.weight",  # a dense layer's
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
    ):
        assert plan.is_fp8(name)
        assert is_fp8_linear(name, 2, plan.high_precision)
    # The router is never a block linear, even for a caller that passes no plan; nor Qwen2-MoE's
    # shared-expert gate.
    for router in ("model.layers.0.mlp.gate.weight", "model.layers.5.mlp.shared_expert_gate.weight"):
        assert not is_block_linear(router, 2) and not is_fp8_linear(router, 2)
    assert is_block_linear("model.layers.0.mlp.shared_expert.gate_proj.weight", 2)


@pytest.mark.parametrize(
    ("inter", "tp", "fp8"),
    [(256, 1, True), (256, 2, True), (256, 4, False), (768, 4, False), (768, 2, True), (192, 1, False)],
)
def test_experts_are_fp8_when_their_intermediate_size_per_rank_is_on_the_grid(
    inter: int, tp: int, fp8: bool
) -> None:
    """vLLM's rule (``validate_fp8_block_shape_moe``); Qwen3-30B-A3B (768) is FP8 on 1 or 2 ranks, not 4."""
    plan = fp8_plan(moe_config(moe_intermediate_size=inter), tensor_parallel_size=tp)
    experts = {n for i in range(4) for n in expert_modules(i, 8)}
    assert (experts & plan.high_precision) == (set() if fp8 else experts)
    assert any("mlp.experts stay high precision" in r for r in plan.reasons) is not fp8
    if not fp8:
        assert "mlp.experts.*.gate_proj" in plan.summary()["high_precision_per_layer"]
        assert set(vllm_ignored_layers(plan)) >= experts


def test_dense_mlp_layers_follow_mlp_only_layers_and_decoder_sparse_step() -> None:
    assert moe_layers(moe_config(mlp_only_layers=[0, 3])) == [1, 2]
    assert moe_layers(moe_config(decoder_sparse_step=2)) == [1, 3]
    assert moe_layers(moe_config(num_experts=0)) == []
    assert moe_layers({**moe_config(num_experts=None), "num_local_experts": 8}) == [
        0,
        1,
        2,
        3,
    ]  # (transformers 5's name)
    # A dense MLP of 576 rows breaks the fused gate_up rule only in the dense layers.
    plan = fp8_plan(moe_config(mlp_only_layers=[1], intermediate_size=576))
    assert plan.high_precision == {f"model.layers.{i}.mlp.gate" for i in (0, 2, 3)} | {
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
    }
    # Every layer sparse: the dense rule has nothing to say.
    assert not any("gate_up_proj" in r for r in fp8_plan(moe_config(intermediate_size=576)).reasons)


def test_dense_families_are_unchanged() -> None:
    dense = {
        k: v for k, v in moe_config(model_type="qwen3", intermediate_size=1536).items() if "expert" not in k
    }
    assert fp8_plan(dense).high_precision == frozenset()
