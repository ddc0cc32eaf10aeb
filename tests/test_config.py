"""Recipes and the typed, YAML-plus-overrides config loader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from fp8rl.config import ConfigError, config_diff, config_hash, load_config, parse_override
from fp8rl.recipes import RECIPE_NAMES, ImportanceSampling, get_recipe


class Optim(BaseModel):
    lr: float = Field(1e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)


class Example(BaseModel):
    recipe: str = "fp8"
    steps: int = Field(10, ge=1)
    optim: Optim = Optim()


def test_recipes_describe_each_engine() -> None:
    assert RECIPE_NAMES == ("bf16", "fp8-rollout", "fp8", "fp8-kv")
    bf16, fp8_rollout, fp8, fp8_kv = (get_recipe(n) for n in RECIPE_NAMES)
    assert (bf16.rollout_weights, bf16.train_linears, bf16.importance_sampling.mode) == (
        "bf16",
        "bf16",
        "none",
    )
    assert (fp8_rollout.rollout_weights, fp8_rollout.train_linears) == ("fp8-block128", "bf16")
    assert (fp8.rollout_weights, fp8.train_linears, fp8.kv_cache_dtype) == ("fp8-block128", "fp8", "auto")
    assert fp8_kv.kv_cache_dtype == "fp8"
    for r in (fp8_rollout, fp8, fp8_kv):
        assert r.fp8_rollout and r.importance_sampling == ImportanceSampling(mode="tis", cap=2.0)
    with pytest.raises(ValueError, match="unknown recipe 'fp16'"):
        get_recipe("fp16")
    with pytest.raises(ValueError, match="low"):
        ImportanceSampling(mode="icepop", low=2.0, high=1.0)


def test_yaml_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("recipe: bf16\nsteps: 5\noptim:\n  lr: 0.001\n")
    cfg = load_config(
        Example, path, overrides={"steps": 7, "recipe": None}, dotted=["optim.betas=[0.8, 0.9]"]
    )
    assert cfg == Example(recipe="bf16", steps=7, optim=Optim(lr=0.001, betas=(0.8, 0.9)))
    assert load_config(Example) == Example()


def test_bad_values_name_their_fields(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"steps: .*greater than or equal to 1 \(got 0\)"):
        load_config(Example, overrides={"steps": 0})
    with pytest.raises(ConfigError, match=r"optim\.lr"):
        load_config(Example, dotted=["optim.lr=-1"])
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("no-equals-sign")
    (tmp_path / "bad.yaml").write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(Example, tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match=r"missing\.yaml"):
        load_config(Example, tmp_path / "missing.yaml")


def test_hash_and_diff() -> None:
    a, b = Example(), Example(steps=3, optim=Optim(lr=1e-3))
    assert config_hash(a) == config_hash(Example()) != config_hash(b)
    assert config_diff(a.model_dump(), b.model_dump()) == ["optim.lr", "steps"]


@pytest.mark.parametrize("module", ["coordinator.cli", "rollout_service.cli", "trainer_service.cli"])
def test_help_imports_nothing_heavy(module: str) -> None:
    """`--help` (and a config error) answer at once: parsing imports no torch, numpy or codec."""
    code = (
        f"import sys\nfrom {module} import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print([m for m in ('torch', 'numpy', 'safetensors', 'zstandard', 'vllm') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
