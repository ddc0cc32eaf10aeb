"""How closely the two engines agree (``consistency``), and which linears stay out of FP8 beyond what a
model's shapes require (the standard high-precision knobs): one config section that the trainer, every
replica and the coordinator read alike. Pure Python."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fp8rl.architectures import FP8Plan, fp8_plan, read_config

Consistency = Literal["default", "exact"]
CONSISTENCIES: tuple[Consistency, ...] = get_args(Consistency)


class PrecisionConfig(BaseModel):
    """How closely the two engines agree, and which linears stay out of FP8 beyond what the model's
    shapes require: one section, the same in the trainer, every replica and the coordinator (which
    hands its own to the processes it starts)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    consistency: Consistency = "default"
    """`exact`: the rollout and the trainer compute every token's logprob bit for bit alike
    (fp8rl/exact.py: exact GEMMs, attention, norms and routing in both engines; CPU only; slower), so
    gen_kl_error is 0. `default`: each engine's own fast kernels (docs/fp8-contract.md)."""
    high_precision_first_layers: int = Field(0, ge=0)
    """Keep every linear of the first N decoder layers in the compute dtype in both engines (NeMo RL's
    num_first_layers_in_bf16, Megatron's num_layers_at_start_in_bf16)."""
    high_precision_last_layers: int = Field(0, ge=0)
    """Keep every linear of the last N decoder layers in the compute dtype in both engines (NeMo RL's
    num_last_layers_in_bf16, Megatron's num_layers_at_end_in_bf16)."""
    high_precision_modules: tuple[str, ...] = ()
    """Regular expressions, each matched against whole HF module names (``model.layers.3.mlp.down_proj``,
    ``model.layers.0.mlp.experts.5.up_proj``): the linears they match stay in the compute dtype, with
    the rest of a fused group vLLM computes as one GEMM (verl's ignored_layers, NeMo RL's
    quantization_ignored_layer_kws)."""

    @model_validator(mode="after")
    def _patterns_compile(self) -> PrecisionConfig:
        for pattern in self.high_precision_modules:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(
                    f"high_precision_modules: {pattern!r} is not a regular expression: {exc}"
                ) from None
        return self

    def plan(self, model: Path, tensor_parallel_size: int = 1) -> FP8Plan:
        """Which linears of the checkpoint in ``model`` run in FP8 (fp8rl.architectures' rule, then these
        knobs), on replicas with ``tensor_parallel_size`` ranks and in their trainer."""
        return fp8_plan(
            read_config(model),
            tensor_parallel_size,
            self.high_precision_first_layers,
            self.high_precision_last_layers,
            self.high_precision_modules,
        )
