"""Recipes and the typed, YAML-plus-overrides config loader."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field

from fp8rl.config import (
    ConfigError,
    add_config_flags,
    config_diff,
    config_from_cli,
    config_hash,
    field_info,
    load_config,
    parse_override,
)
from fp8rl.recipes import RECIPE_NAMES, ImportanceSampling, get_recipe


class Optim(BaseModel):
    lr: float = Field(1e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)


class Example(BaseModel):
    recipe: str = "fp8"
    steps: int = Field(10, ge=1)
    optim: Optim = Optim()


def test_recipes_describe_each_engine() -> None:
    base = ("bf16", "fp8-rollout", "fp8", "fp8-kv")
    assert (*base, "fp8-rollout-pow2", "fp8-pow2", "fp8-kv-pow2") == RECIPE_NAMES
    bf16, fp8_rollout, fp8, fp8_kv = (get_recipe(n) for n in base)
    for name in base[1:]:  # each FP8 recipe has a pow2 twin that differs only in its scale format
        twin = get_recipe(f"{name}-pow2")
        assert (twin.scale_format, get_recipe(name).scale_format) == ("pow2", "fp32")
        assert twin.model_dump(exclude={"name", "rollout_weights"}) == get_recipe(name).model_dump(
            exclude={"name", "rollout_weights"}
        )
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


def test_the_learner_section_lays_what_is_set_over_the_demo_and_reaches_the_trainer(tmp_path: Path) -> None:
    from coordinator.config import DEMO_LEARNER, CoordinatorConfig
    from coordinator.embedded import embedded_trainer
    from trainer_service.config import TrainerConfig

    path = tmp_path / "run.yaml"
    path.write_text("learner:\n  optimizer:\n    lr: 1.0e-6\n  mini_batches: 2\n")
    config = load_config(CoordinatorConfig, path, dotted=["learner.loss.clip_eps=0.1"])
    learner = config.embedded.learner
    assert learner.optimizer.lr == 1e-6 and learner.mini_batches == 2
    assert learner.loss.clip_eps == 0.1
    assert learner.optimizer.warmup_steps == DEMO_LEARNER["optimizer"]["warmup_steps"]  # kept
    assert learner.loss.advantage_norm == "mean" and learner.micro_batch_size == 64
    trainer = embedded_trainer(config, tmp_path, "float32", tmp_path / "run")
    sent = TrainerConfig.model_validate(yaml.safe_load(yaml.safe_dump(trainer.model_dump(mode="json"))))
    assert sent == trainer and sent.optimizer.lr == 1e-6 and sent.port == 0 and sent.resume
    assert sent.checkpoint_dir == tmp_path / "run" / "checkpoints"


def test_the_coordinator_config_is_written_dumped_and_named_by_flat_fields() -> None:
    """The code reads typed slices; users write, dumps hold (a resumed run's identity among them) and
    errors name the flat fields, in one order, as before the slicing."""
    from coordinator.config import FIELDS, CoordinatorConfig

    config = load_config(
        CoordinatorConfig, dotted=["top_k=5", "learner.optimizer.lr=1e-6", "task=arith-chat"]
    )
    assert config.sampling.top_k == 5 and config.task.name == "arith-chat"
    assert config.embedded.learner.optimizer.lr == 1e-6 and config.embedded.learner.micro_batch_size == 64
    assert list(config.model_dump()) == list(FIELDS) and config.model_dump()["top_k"] == 5
    assert (
        CoordinatorConfig.model_validate(config.model_dump())
        == config
        == CoordinatorConfig(**config.model_dump())
    )
    wrong = ["bogus=1", "learner.optimizer.lr=-1", "top_k=-1", "steps=0"]
    with pytest.raises(
        ConfigError, match=r"^invalid config: steps: .+; top_k: .+; learner.optimizer.lr: .+; bogus: "
    ):
        load_config(CoordinatorConfig, dotted=wrong)
    with pytest.raises(ConfigError, match=r"^invalid config: run: Extra inputs are not permitted$"):
        load_config(CoordinatorConfig, dotted=["run.steps=3"])  # the slices are no input


def test_the_learner_section_is_refused_in_distributed_mode() -> None:
    from coordinator.config import CoordinatorConfig

    with pytest.raises(ConfigError, match="learner configures the embedded trainer"):
        load_config(
            CoordinatorConfig,
            dotted=["redis_url=redis://127.0.0.1:1/0", "trainer=127.0.0.1:2", "learner.mini_batches=2"],
        )


def test_importance_sampling_bounds_out_of_order_are_refused_before_any_model_loads() -> None:
    """is_low against is_high once the recipe's values fill the unset one: in the coordinator's learner
    section and in the trainer's own config, at validation, naming the fields."""
    from coordinator.config import CoordinatorConfig
    from trainer_service.config import TrainerConfig

    with pytest.raises(ConfigError, match=r"learner\.loss\.is_low \(3\.0\) must be below is_high \(2\.0\)"):
        load_config(CoordinatorConfig, dotted=["recipe=fp8", "learner.loss.is_low=3"])
    with pytest.raises(ConfigError, match=r"loss\.is_low \(0\.9\) must be below is_high \(0\.8\)"):
        load_config(TrainerConfig, dotted=["loss.is_low=0.9", "loss.is_high=0.8"])
    config = load_config(TrainerConfig, dotted=["recipe=bf16", "loss.is_high=0.8", "loss.is_low=0.1"])
    assert config.loss.importance_sampling(get_recipe("bf16").importance_sampling).high == 0.8


class Nested(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    rate: float = 0.5
    """How fast."""


class Flags(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    mode: Literal["a", "b"] = "a"
    """Which mode."""
    count: int | None = None
    paths: list[str] = []
    verbose: bool = False
    where: Path | None = None
    section: Nested = Nested(rate=0.25)
    table: dict[str, int] = {}


def test_flags_follow_the_model_fields() -> None:
    parser = argparse.ArgumentParser(prog="x")
    flags = add_config_flags(parser, Flags, {"rate": "section.rate"})
    assert flags == {n: n for n in ("mode", "count", "paths", "verbose", "where")} | {"rate": "section.rate"}
    text = " ".join(parser.format_help().split())
    assert "Which mode. Default: 'a'." in text and "How fast. Default: 0.25." in text  # the section's default
    argv = ["--mode", "b", "--count", "3", "--paths", "p", "--paths", "q", "--verbose", "--rate", "2"]
    config = config_from_cli(Flags, "x", parser.parse_args([*argv, "--set", "table.k=1"]), flags)
    assert config == Flags(
        mode="b", count=3, paths=["p", "q"], verbose=True, section=Nested(rate=2), table={"k": 1}
    )
    assert config_from_cli(Flags, "x", parser.parse_args([]), flags) == Flags()
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "c"])


@pytest.mark.parametrize("module", ["coordinator.cli", "rollout_service.cli", "trainer_service.cli"])
def test_every_scalar_config_field_has_a_flag(module: str) -> None:
    from importlib import import_module

    cli = import_module(module)
    _, flags = cli.parse_args(["start"] if module == "coordinator.cli" else ["serve"])
    config_cls = {"coordinator.cli": "CoordinatorConfig", "rollout_service.cli": "RolloutConfig"}.get(
        module, "TrainerConfig"
    )
    config_module = import_module(module.replace(".cli", ".config"))
    cls = getattr(config_module, config_cls)
    # (The coordinator's fields sit in slices, under the flat names of its FIELDS.)
    names = getattr(config_module, "FIELDS", {n: n for n in cls.model_fields})
    fields = {name: field_info(cls, path)[0] for name, path in names.items()}
    scalar = {
        n
        for n, f in fields.items()
        if not (isinstance(f.annotation, type) and issubclass(f.annotation, (BaseModel, dict)))
    }
    assert scalar
    assert scalar <= set(flags)
