"""The precision section (fp8rl/precision.py): the high-precision knobs in the FP8 plan both engines
build, and the settings exact consistency refuses, each named before anything loads."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from fp8rl.architectures import expert_modules, fp8_plan
from fp8rl.precision import PrecisionConfig
from tests.unit.test_architectures import moe_config

DENSE = {
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 6,
}
LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def linears(layer: int, modules: tuple[str, ...] = LAYER + MLP) -> set[str]:
    return {f"model.layers.{layer}.{m}" for m in modules}


def test_first_and_last_layers_stay_high_precision_whole() -> None:
    assert not fp8_plan(DENSE).high_precision
    plan = fp8_plan(DENSE, first_layers=1, last_layers=2)
    assert plan.high_precision == linears(0) | linears(4) | linears(5)
    assert not plan.is_fp8("model.layers.5.mlp.down_proj.weight") and plan.is_fp8(
        "model.layers.1.mlp.up_proj.weight"
    )
    summary = plan.summary()
    assert summary["high_precision_layers"]["mlp.down_proj"] == "layers 0, 4, 5"
    assert "layers 0..0 stay high precision (high_precision_first_layers 1)" in summary["reasons"]
    assert "layers 4..5 stay high precision (high_precision_last_layers 2)" in summary["reasons"]
    assert summary["summary"].startswith("all block linears in FP8 but mlp.down_proj, mlp.gate_proj")
    assert fp8_plan(DENSE, first_layers=9).high_precision == set().union(*(linears(i) for i in range(6)))


def test_a_pattern_keeps_its_fused_group_whole_and_one_that_matches_nothing_is_refused() -> None:
    plan = fp8_plan(DENSE, patterns=[r"model\.layers\.[23]\.mlp\.gate_proj"])
    # gate and up are one GEMM in vLLM: both stay high precision, down_proj does not.
    assert plan.high_precision == linears(2, ("mlp.gate_proj", "mlp.up_proj")) | linears(
        3, ("mlp.gate_proj", "mlp.up_proj")
    )
    plan = fp8_plan(DENSE, patterns=[r".*\.q_proj", r"model\.layers\.0\.self_attn\.o_proj"])
    assert plan.high_precision == set().union(
        *(linears(i, LAYER[:3]) for i in range(6)), linears(0, ("self_attn.o_proj",))
    )
    with pytest.raises(ValueError, match=re.escape("'.*mlp.gate_up' matches no linear")):
        fp8_plan(DENSE, patterns=[".*mlp.gate_up"])


def test_moe_layers_keep_all_their_experts_or_none() -> None:
    plan = fp8_plan(moe_config(), last_layers=1, patterns=[r".*experts\.3\.down_proj"])
    experts = {name for i in range(4) for name in expert_modules(i, 8)}
    routers = {f"model.layers.{i}.mlp.gate" for i in range(4)}
    assert plan.high_precision == experts | routers | linears(3, LAYER)
    assert plan.summary()["high_precision_layers"]["self_attn.o_proj"] == "layer 3"


def write_model(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 256}))
    return tmp_path


def test_the_section_reaches_both_services_plans(tmp_path: Path) -> None:
    from rollout_service.config import RolloutConfig
    from trainer_service.config import TrainerConfig

    model = write_model(tmp_path, DENSE)
    precision = {"high_precision_first_layers": 2, "high_precision_modules": [r".*\.5\.mlp\.down_proj"]}
    trainer = TrainerConfig(model=model, precision=precision)
    rollout = RolloutConfig(model=model, precision=precision)
    assert trainer.fp8_plan == rollout.fp8_plan
    assert trainer.fp8_plan.high_precision == linears(0) | linears(1) | linears(5, ("mlp.down_proj",))
    with pytest.raises(ValidationError, match="matches no linear"):
        RolloutConfig(model=model, precision={"high_precision_modules": ["nothing"]})
    with pytest.raises(ValidationError, match="is not a regular expression"):
        PrecisionConfig(high_precision_modules=["(unclosed"])


def test_exact_consistency_refuses_what_cannot_be_exact(tmp_path: Path) -> None:
    from coordinator.config import CoordinatorConfig
    from trainer_service.config import TrainerConfig

    model = write_model(tmp_path, DENSE)
    exact = {"consistency": "exact"}
    for changes, message in (
        ({"recipe": "fp8-rollout"}, "recipe fp8-rollout trains in high precision"),
        ({"fp8_backend": "te"}, "fp8_backend te"),
        ({"routing_replay": True}, "routing_replay has nothing to replay"),
    ):
        with pytest.raises(ValidationError, match=message):
            TrainerConfig(model=model, precision=exact, **changes)
    TrainerConfig(model=model, precision=exact, recipe="bf16")
    with pytest.raises(ValidationError, match="recipe fp8-rollout trains in high precision"):
        CoordinatorConfig.model_validate({"recipe": "fp8-rollout", "precision": exact})
    config = CoordinatorConfig.model_validate({"recipe": "fp8-kv", "precision": exact})
    assert config.run.precision.consistency == "exact" and "precision" in config.identity()
