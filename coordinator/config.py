"""The coordinator's one typed config: YAML + CLI overrides, validated before any process starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fp8rl.credentials import check_run_id
from fp8rl.models import ModelDir
from fp8rl.recipes import RecipeName
from fp8rl.security import SecurityConfig
from trainer_service.config import LearnerConfig

# Fields that say where and how long things run, not what the run is: they may differ when a run is
# resumed (raising `steps` extends a run).
RESUMABLE_FIELDS = (
    "redis_url",
    "trainer",
    "rollout",
    "run_dir",
    "progress",
    "steps",
    "tensorboard",
    "wandb_project",
    "security",
    "tls",
    "trainer_procs",
)

# The demo's learner: TrainerConfig's defaults but for these, tuned for the tiny model. Each knob has this
# one demo value (deploy/config/trainer.yaml repeats them for compose, checked by tests/test_compose.py).
# A real model wants far less: lr 1e-6 for a 1B model, set with --lr or in a YAML file.
DEMO_LEARNER: dict[str, Any] = {
    "micro_batch_size": 64,
    "optimizer": {"lr": 1e-4, "warmup_steps": 20},  # warm-up keeps Adam's first, noisy steps small
    # The group's mean, not its std: the gradient of log E[r], which lifts greedy accuracy faster on the
    # demo's 0/1 rewards (GRPO's expected gradient favours prompts the policy already mostly solves).
    "loss": {"advantage_norm": "mean"},
}


def over(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``changes`` laid over ``base``, section by section."""
    merged = dict(base)
    for key, value in changes.items():
        below = merged.get(key)
        merged[key] = over(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
    return merged


class CoordinatorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    recipe: RecipeName = "fp8"
    """Precision recipe for rollout and trainer."""
    model: ModelDir | None = None
    """HF checkpoint directory; default: the tiny arith model shipped with fp8rl (fp8rl/models/tiny-arith)."""
    task: Literal["arith", "arith-chat", "dataset", "jsonl"] = "arith"
    """`arith` (the tiny model's sums), `arith-chat` (the same sums asked in chat form, for instruct
    models) or `dataset` (`jsonl` is the same): records with a prompt and an answer from `dataset`."""
    dataset: Path | None = None
    """Task dataset: a .jsonl or .parquet file, a directory saved by HF datasets (its train split), or
    `gsm8k-sample` (a small GSM8K-layout sample shipped with fp8rl: --prompt-key question)."""
    prompt_key: str = "prompt"
    """Task dataset: the field holding the prompt (text, or a list of {role, content} messages)."""
    answer_key: str = "answer"
    """Task dataset: the field holding the reference answer (GSM8K's `... #### 42` counts as 42)."""
    val_dataset: Path | None = None
    """Task dataset: validate on this file's rows (at most val_size) instead of holding rows out."""
    val_fraction: float | None = Field(None, gt=0, lt=1)
    """Task dataset: hold out this fraction of the rows (seeded) instead of the first val_size."""
    reward: str | None = None
    """`module:function(prompt, completion, answer) -> float` replacing the task's reward."""
    steps: int = Field(60, ge=1)
    """GRPO steps to run (a resumed run continues up to this many)."""
    run_id: str | None = None
    """Names the run; the same id again resumes it (letters, digits, `_`, `.`, `-`; not `.` or `..`).
    Default: a fresh time-stamped id."""
    run_dir: Path | None = None
    """Where metrics, logs, checkpoints and plots go; default runs/<run-id>."""
    seed: int = 0
    prompts_per_step: int = Field(32, ge=1)
    group_size: int = Field(8, ge=1)
    """Samples per prompt (GRPO group)."""
    max_tokens: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    stop: list[str] = ["\n"]
    max_staleness: int = Field(0, ge=0)
    """0: on-policy. S >= 1: generation of step k+1 overlaps training of step k on weights at most S
    versions old; a stored batch staler than S is regenerated."""
    val_every: int = Field(10, ge=0)
    """Validate (greedy, held-out prompts) every N steps, plus before the first and after the last; 0: only
    those two."""
    val_size: int = Field(128, ge=1)
    """Validation problems (the most kept from a held-out split or val_dataset). Held out by count, the
    first val_size rows of a dataset, but never more than half of its rows."""
    mult_prob_warn: float = Field(1.05, gt=1)
    """Warn when token_mult_prob_error exceeds this."""
    max_restarts: int = Field(3, ge=0)
    """Embedded mode: how many times the processes are restarted after a child (redis-server, trainer,
    rollout) died, before the run gives up."""
    compute_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Embedded mode: compute dtype of trainer and rollout. `auto`: bf16 on CUDA, float32 on CPU (bf16
    matmuls are slow on CPUs without AMX, and float32 keeps the comparison of recipes clean)."""
    learner: LearnerConfig = Field(default_factory=lambda: LearnerConfig.model_validate(DEMO_LEARNER))
    """Embedded mode: the trainer's learner (trainer_service/config.py, LearnerConfig); what you set here
    is laid over DEMO_LEARNER, so `learner: {optimizer: {lr: 1e-6}}` changes only the learning rate.
    A distributed trainer is configured on its own command line."""
    redis_url: str | None = None
    """Distributed mode: the Redis holding run state (embedded mode starts a private one)."""
    trainer: str | None = None
    """Distributed mode: host:port of the trainer service."""
    rollout: list[str] = []
    """Distributed mode: host:port of each rollout replica; empty: discover them in Redis."""
    security: SecurityConfig = SecurityConfig()
    """Distributed mode: the coordinator's identity towards trainer and replicas (its token or client
    certificate, the CA it checks them against: fp8rl/security.py)."""
    tls: bool = False
    """Embedded mode: the run's processes talk mutual TLS under a private CA in RUN_DIR/secrets (bearer
    tokens and signed weight updates are always on)."""
    progress: Literal["auto", "rich", "plain"] = "auto"
    """Live display: rich on a terminal, plain lines otherwise."""
    trainer_procs: int = Field(1, ge=1)
    """Embedded mode: trainer ranks (torchrun; one per GPU), the model fully sharded (FSDP2) and checkpoints
    sharded; a run may resume on another number of ranks. 1: one plain process (unless the run's
    checkpoints are sharded already)."""
    kv_cache_gib: float = Field(1.0, gt=0)
    """Embedded rollout: KV-cache space (GiB)."""
    tensorboard: bool = True
    """Write TensorBoard event files to RUN_DIR/tensorboard (`tensorboard --logdir runs/`)."""
    wandb_project: str | None = None
    """Also log to Weights & Biases, in this project (WANDB_MODE=offline works without a network)."""

    @field_validator("dataset", "val_dataset", mode="before")
    @classmethod
    def _shipped_sample(cls, value: Any) -> Any:
        from coordinator.datasets import resolve

        return resolve(Path(value)) if isinstance(value, str | Path) else value

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str | None) -> str | None:
        return None if value is None else check_run_id(value)

    @field_validator("learner", mode="before")
    @classmethod
    def _over_demo(cls, value: Any) -> Any:
        return over(DEMO_LEARNER, value) if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _consistent(self) -> CoordinatorConfig:
        if self.task in ("dataset", "jsonl") and self.dataset is None:
            raise ValueError(
                f"task {self.task} needs dataset (a .jsonl or .parquet file, or a datasets directory)"
            )
        if self.task not in ("dataset", "jsonl") and (self.dataset or self.val_dataset or self.val_fraction):
            raise ValueError("dataset, val_dataset and val_fraction are for task dataset (--task dataset)")
        for path in (self.dataset, self.val_dataset):
            if path is not None and not path.exists():
                raise ValueError(f"dataset {path} does not exist")
        if self.val_fraction is not None and self.val_dataset is not None:
            raise ValueError("give val_fraction or val_dataset, not both")
        if self.model is not None and not (self.model / "config.json").is_file():
            raise ValueError(f"model {self.model} is not an HF checkpoint directory (no config.json)")
        if bool(self.trainer) != bool(self.redis_url):
            raise ValueError("give redis_url and trainer together (distributed mode), or neither (embedded)")
        if self.embedded and self.security != SecurityConfig():
            raise ValueError("security configures a distributed coordinator; an embedded run makes its own")
        if not self.embedded and self.learner != CoordinatorConfig.model_fields["learner"].get_default(
            call_default_factory=True
        ):
            raise ValueError(
                "learner configures the embedded trainer; give a distributed trainer its own config"
            )
        if self.reward is not None and ":" not in self.reward:
            raise ValueError(f"reward {self.reward!r} is not of the form module:function")
        return self

    @property
    def embedded(self) -> bool:
        return self.redis_url is None

    def identity(self) -> dict[str, Any]:
        """What defines the run: compared when a run is resumed."""
        return self.model_dump(mode="json", exclude=set(RESUMABLE_FIELDS))
