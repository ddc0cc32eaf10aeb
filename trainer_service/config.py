"""The trainer service's one typed config (YAML + CLI overrides, validated before the model loads)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fp8rl.architectures import FP8Plan
from fp8rl.devices import Device
from fp8rl.models import TINY_ARITH, ModelDir
from fp8rl.precision import PrecisionConfig
from fp8rl.recipes import AdvantageNorm, ImportanceSampling, ISMode, RecipeName, get_recipe
from fp8rl.security import SecurityConfig


class OptimizerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    lr: float = Field(1e-5, gt=0)
    """Peak learning rate of AdamW."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's decay rates of the first and second moments."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay."""
    eps: float = Field(1e-8, gt=0)
    """AdamW's epsilon, added to the second moment's root."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up from lr/warmup_steps to lr over this many TrainSteps."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global grad norm per optimizer step."""


class LossConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    clip_eps: float = Field(0.2, gt=0, lt=1)
    """PPO ratio clip."""
    advantage_norm: AdvantageNorm = "std"
    """Group-centred rewards divided by the group's std (GRPO), its mean (the gradient of log E[r]; for
    non-negative rewards) or nothing (`none`, Dr. GRPO). See fp8rl.grpo.group_advantages."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of a k3 KL penalty to the frozen initial policy; 0 (default) keeps no reference model."""
    is_mode: ISMode | None = None
    """Importance-sampling correction; default: the recipe's (tis for FP8 recipes, none for bf16)."""
    is_cap: float | None = Field(None, gt=0)
    """`tis`: the cap on each token's IS weight; default: the recipe's (docs/importance-sampling.md)."""
    is_low: float | None = Field(None, ge=0)
    """`icepop`, `seq-mask-tis`: weights below it are masked; default: the recipe's; below is_high."""
    is_high: float | None = Field(None, gt=0)
    """`icepop`, `seq-mask-tis`: weights above it are masked; default: the recipe's."""

    def importance_sampling(self, recipe: ImportanceSampling) -> ImportanceSampling:
        """``recipe``'s importance sampling with this config's explicit fields over it; a ValueError
        naming the fields when the bounds that result are out of order."""
        overrides = {"mode": self.is_mode, "cap": self.is_cap, "low": self.is_low, "high": self.is_high}
        merged = recipe.model_dump() | {k: v for k, v in overrides.items() if v is not None}
        if merged["low"] >= merged["high"]:
            raise ValueError(
                f"loss.is_low ({merged['low']}) must be below is_high ({merged['high']}) "
                "(an unset one is the recipe's)"
            )
        return ImportanceSampling.model_validate(merged)


class LearnerConfig(BaseModel):
    """What the learner does with a batch: the part of the trainer's config that a coordinator sets for
    its embedded trainer (coordinator/config.py, section ``learner``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    device: Device = "auto"
    """Where the model trains: `cpu`, `cuda`, or `auto` ($FP8RL_DEVICE if set, else CUDA when there is a
    device; fp8rl/devices.py)."""
    fp8_backend: Literal["auto", "te", "emulated"] = "auto"
    """FP8 linears: Transformer Engine on CUDA (auto: on CUDA it must import), the exact emulation on
    CPU."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per TrainStep (the samples are split evenly)."""
    micro_batch_size: int = Field(8, ge=1)
    """Samples per forward/backward; gradients accumulate over a mini-batch."""
    optimizer: OptimizerConfig = OptimizerConfig()
    loss: LossConfig = LossConfig()
    kv_scales: Literal["calibrated", "unit"] = "calibrated"
    """Under a `-kv` recipe, the scales of the rollout's FP8 attention (query, and the KV cache), shipped
    with every weight update: `calibrated` (each step's amax of Q, K and V / 448,
    trainer_service/kv_cache.py) or `unit` (1.0, vLLM's scale for a checkpoint without any)."""
    emulate_kv_cache: bool = True
    """Under a `-kv` recipe, the trainer attends as the rollout's FP8 attention does (the same rounding of
    Q, K and V, the same scales); off, it attends in high precision and importance sampling alone corrects
    the difference."""
    routing_replay: bool = False
    """Mixture-of-experts models: route every position the rollout computed to the experts the rollout
    routed it to (samples' `routed_experts`), the trainer's router weighing them (R3, routing replay);
    off, the trainer routes itself and only measures how often it disagrees (`routing_mismatch`)."""
    checkpoint_every: int = Field(1, ge=0)
    """With checkpoint_dir: write a checkpoint every N steps, so a restarted trainer loses at most N - 1
    committed steps (0: only on SaveCheckpoint)."""
    keep_checkpoints: int = Field(3, ge=1)
    """Checkpoints kept in checkpoint_dir (the newest); older ones are deleted after each save."""


class TrainerConfig(LearnerConfig):
    """The trainer process: its learner, plus the model, precision, address and checkpoints."""

    model: ModelDir = Field(TINY_ARITH, validate_default=True)
    """HF checkpoint directory of a supported family (docs/architectures.md); default: the shipped tiny
    arith model."""
    recipe: RecipeName = "fp8"
    """Precision recipe: the linears' format in training, the weights it publishes, the IS default."""
    precision: PrecisionConfig = PrecisionConfig()
    """Exact consistency and the high-precision layers (fp8rl/precision.py): the same as the replicas'."""
    rollout_tensor_parallel_size: int = Field(1, ge=1)
    """The replicas' tensor parallel size, which decides the linears vLLM can serve in FP8 (the trainer
    keeps the same ones in high precision: fp8rl.architectures)."""
    host: str = "127.0.0.1"
    """Interface to bind; loopback unless the coordinator runs on another machine (then TLS: security)."""
    port: int = Field(50052, ge=0, le=65535)
    """Port to bind; 0 picks a free one (printed at start-up)."""
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the forward/backward pass; master weights and optimizer state are always float32."""
    checkpoint_dir: Path | None = None
    """Where checkpoints go; none are written without it."""
    resume: bool = False
    """Restore the latest complete checkpoint of checkpoint_dir at start-up."""
    seed: int = 0
    """Seeds torch at start-up."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve Prometheus /metrics on host:metrics_port (0: a free port, printed at start-up); unset: off."""
    health_port: int | None = Field(None, ge=0, le=65535)
    """Also answer gRPC health (alone, in plaintext, no identity asked) on host:health_port, for probes
    that speak no TLS, such as Kubernetes' native gRPC probes (0: a free port, printed at start-up)."""
    security: SecurityConfig = SecurityConfig()
    """TLS, caller identities and roles (fp8rl/security.py); the same identity is shown to replicas, and
    with update_signing_key_file every update is signed."""
    shared_memory_updates: bool = True
    """Hand the parts of each update as shared memory to the replicas on this host and in this network
    namespace that take them (fp8rl/codec/segments.py); gRPC carries the rest, and every byte where a
    replica's inbox is not reachable or the hand-over fails. False: every byte over gRPC."""
    tcp_update_streams: int = Field(4, ge=0, le=64)
    """Connections per replica for the parts that cannot go as shared memory, to the TCP port the replica
    names (fp8rl/codec/tcp_plane.py: beside the gRPC stream, TLS where the trainer's channels have it);
    gRPC carries them where that port is not reachable or a connection fails. 0: over gRPC."""
    weight_transfer: bool = False
    """Send each update as a keyframe over the device plane of the replicas that offer one (their
    `weight_transfer`: fp8rl/codec/device_planes.py), from the trainer's device: NCCL from a GPU, Gloo
    from a CPU; gRPC and its planes carry it where that fails. Unauthenticated bytes (checked by
    fingerprints under the signed plan), as NCCL's are: only on a trusted network."""
    publish_to: list[str] = []
    """host:port of replicas the trainer may publish to besides those that prove they hold the run's
    registration key (their registration_proof); without a key and this list, only loopback replicas."""

    @model_validator(mode="after")
    def _importance_sampling(self) -> TrainerConfig:
        self.loss.importance_sampling(get_recipe(self.recipe).importance_sampling)
        return self

    @model_validator(mode="after")
    def _precision(self) -> TrainerConfig:
        if self.precision.high_precision_modules:  # (a pattern that matches no linear fails here)
            self.fp8_plan  # noqa: B018
        if self.precision.consistency == "exact":
            recipe = get_recipe(self.recipe)
            refused = [
                (
                    recipe.fp8_rollout and recipe.train_linears != "fp8",
                    f"recipe {self.recipe} trains in high precision what the replicas compute in FP8",
                ),
                (
                    self.fp8_backend == "te",
                    "fp8_backend te computes FP8 GEMMs with Transformer Engine's kernels, not the rollout's",
                ),
                (self.routing_replay, "routing_replay has nothing to replay (the routers agree exactly)"),
            ]
            for applies, reason in refused:
                if applies:
                    raise ValueError(f"precision.consistency exact: {reason}")
        return self

    @property
    def fp8_plan(self) -> FP8Plan:
        """Which of the model's linears run in FP8, in this trainer and on its replicas."""
        return self.precision.plan(self.model, self.rollout_tensor_parallel_size)
