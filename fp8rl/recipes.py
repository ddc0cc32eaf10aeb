"""The precision recipes of the FP8 RL study, as typed configs every process reads.

| recipe        | rollout weights | KV cache | trainer linears | IS correction |
| ------------- | --------------- | -------- | --------------- | ------------- |
| `bf16`        | bf16            | bf16     | bf16            | none          |
| `fp8-rollout` | FP8 block 128   | bf16     | bf16            | tis, cap 2    |
| `fp8`         | FP8 block 128   | bf16     | FP8 block 128   | tis, cap 2    |
| `fp8-kv`      | FP8 block 128   | FP8      | FP8 block 128   | tis, cap 2    |

Every FP8 recipe uses FP32 scales (the study's); its `-pow2` twin (`fp8-pow2`, ...) uses power-of-two
(UE8M0) scales in every engine, the format DeepGEMM and MXFP8 hardware want.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

# (Defined below both this module and fp8rl.quant, which imports torch alone; re-exported here.)
from fp8rl.formats import SCALE_FORMATS as SCALE_FORMATS
from fp8rl.formats import ScaleFormat as ScaleFormat

WeightFormat = Literal["bf16", "fp8-block128", "fp8-block128-pow2"]
"""How a rollout holds its weights: bf16 tensors, or FP8 E4M3 128x128 blocks with FP32 (or power-of-two)
scales."""
WEIGHT_FORMATS: tuple[WeightFormat, ...] = get_args(WeightFormat)


RecipeName = Literal["bf16", "fp8-rollout", "fp8", "fp8-kv", "fp8-rollout-pow2", "fp8-pow2", "fp8-kv-pow2"]
RECIPE_NAMES: tuple[RecipeName, ...] = get_args(RecipeName)
ISMode = Literal["none", "tis", "icepop", "seq-mask-tis"]
AdvantageNorm = Literal["std", "mean", "none"]  # see fp8rl.grpo.group_advantages


def is_fp8(weight_format: WeightFormat) -> bool:
    return weight_format != "bf16"


def weight_scale_format(weight_format: WeightFormat) -> ScaleFormat:
    return "pow2" if weight_format.endswith("-pow2") else "fp32"


def fp8_weight_format(scale_format: ScaleFormat) -> WeightFormat:
    return "fp8-block128-pow2" if scale_format == "pow2" else "fp8-block128"


class ImportanceSampling(BaseModel):
    """Correction of the rollout/trainer mismatch with w = exp(prev_logprob - gen_logprob)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: ISMode = "none"
    """`tis` clamps w to [0, cap]; `icepop` zeroes tokens with w outside [low, high]; `seq-mask-tis`
    drops sequences whose geometric-mean w lies outside [low, high] and keeps the others' raw w (NeMo
    RL's definition); `none` uses w = 1."""
    cap: float = Field(2.0, gt=0)
    """Upper clamp of `tis`."""
    low: float = Field(0.5, ge=0)
    """Lower bound of `icepop` and `seq-mask-tis`."""
    high: float = Field(2.0, gt=0)
    """Upper bound of `icepop` and `seq-mask-tis`."""

    @model_validator(mode="after")
    def _bounds_ordered(self) -> ImportanceSampling:
        if self.low >= self.high:
            raise ValueError(f"importance sampling low ({self.low}) must be below high ({self.high})")
        return self


class Recipe(BaseModel):
    """What each engine runs under one recipe."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: RecipeName
    rollout_weights: WeightFormat
    """Format of the WeightSet the trainer publishes and the rollout serves."""
    kv_cache_dtype: Literal["auto", "fp8"]
    """vLLM `kv_cache_dtype`: `auto` follows the model dtype."""
    train_linears: Literal["bf16", "fp8"]
    """Precision of the linear layers inside the trainer's transformer blocks."""
    importance_sampling: ImportanceSampling

    @property
    def fp8_rollout(self) -> bool:
        return is_fp8(self.rollout_weights)

    @property
    def scale_format(self) -> ScaleFormat:
        """The format of every FP8 scale under this recipe: weights, activations and gradients."""
        return weight_scale_format(self.rollout_weights)


_TIS = ImportanceSampling(mode="tis", cap=2.0)

RECIPES: dict[RecipeName, Recipe] = {
    "bf16": Recipe(
        name="bf16",
        rollout_weights="bf16",
        kv_cache_dtype="auto",
        train_linears="bf16",
        importance_sampling=ImportanceSampling(mode="none"),
    ),
    "fp8-rollout": Recipe(
        name="fp8-rollout",
        rollout_weights="fp8-block128",
        kv_cache_dtype="auto",
        train_linears="bf16",
        importance_sampling=_TIS,
    ),
    "fp8": Recipe(
        name="fp8",
        rollout_weights="fp8-block128",
        kv_cache_dtype="auto",
        train_linears="fp8",
        importance_sampling=_TIS,
    ),
    "fp8-kv": Recipe(
        name="fp8-kv",
        rollout_weights="fp8-block128",
        kv_cache_dtype="fp8",
        train_linears="fp8",
        importance_sampling=_TIS,
    ),
}
RECIPES.update(
    {
        f"{name}-pow2": recipe.model_copy(  # type: ignore[misc]
            update={"name": f"{name}-pow2", "rollout_weights": "fp8-block128-pow2"}
        )
        for name, recipe in list(RECIPES.items())
        if recipe.fp8_rollout
    }
)


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]  # type: ignore[index]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPE_NAMES)}") from None
