"""The coordinator's one typed config: YAML + CLI overrides, validated before any process starts.

The code reads it in typed slices (``config.sampling.top_k``); users write it by the flat names of
:data:`FIELDS` (``--top-k``, ``top_k:`` in YAML, ``--set top_k=5``), and it is dumped, compared when a run
resumes, and named in its errors by those names too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import InitErrorDetails

from fp8rl.credentials import check_run_id
from fp8rl.models import ModelDir
from fp8rl.precision import PrecisionConfig
from fp8rl.recipes import RecipeName, get_recipe
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
    "launcher",
    "ray",
)

# The demo's learner: TrainerConfig's defaults but for these, tuned for the tiny model. Each knob has this
# one demo value (deploy/config/trainer.yaml repeats them for compose, checked by tests/e2e/test_compose.py).
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


class _Slice(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class RunConfig(_Slice):
    """What the run is, how long it goes and where its files are."""

    recipe: RecipeName = "fp8"
    """Precision recipe for rollout and trainer."""
    precision: PrecisionConfig = PrecisionConfig()
    """Exact consistency and the layers kept in high precision, for trainer and replicas alike
    (fp8rl/precision.py; `--consistency exact`, `--high-precision-first-layers N`, ...)."""
    model: ModelDir | None = None
    """HF checkpoint directory; default: the tiny arith model shipped with fp8rl (fp8rl/models/tiny-arith)."""
    steps: int = Field(60, ge=1)
    """GRPO steps to run (a resumed run continues up to this many)."""
    run_id: str | None = None
    """Names the run; the same id again resumes it (letters, digits, `_`, `.`, `-`; not `.` or `..`).
    Default: a fresh time-stamped id."""
    run_dir: Path | None = None
    """Where metrics, logs, checkpoints and plots go; default runs/<run-id>."""
    seed: int = 0
    """Seeds the prompts' order, the validation split and the embedded trainer."""
    max_staleness: int = Field(0, ge=0)
    """0: on-policy. S >= 1: generation of step k+1 overlaps training of step k on weights at most S
    versions old; a stored batch staler than S is regenerated."""
    val_every: int = Field(10, ge=0)
    """Validate (greedy, held-out prompts) every N steps, plus before the first and after the last; 0: only
    those two."""

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str | None) -> str | None:
        return None if value is None else check_run_id(value)

    def check(self) -> None:
        if self.model is not None and not (self.model / "config.json").is_file():
            raise ValueError(f"model {self.model} is not an HF checkpoint directory (no config.json)")
        recipe = get_recipe(self.recipe)
        if self.precision.consistency == "exact" and recipe.fp8_rollout and recipe.train_linears != "fp8":
            raise ValueError(
                f"precision.consistency exact: recipe {self.recipe} trains in high precision what the "
                "replicas compute in FP8"
            )


class TaskConfig(_Slice):
    """The problems and their reward: arithmetic, or a dataset's rows."""

    name: Literal["arith", "arith-chat", "dataset", "jsonl"] = "arith"
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
    env: str | None = None
    """A multi-turn environment instead of a task: `module:factory` (called with seed=...) or
    `arith-feedback` (shipped); its episodes talk to the policy over the replicas' OpenAI-compatible HTTP
    and are trained as recorded (coordinator/environments.py)."""
    reward_deadline_s: float = Field(5.0, gt=0)
    """Seconds one completion's reward (math-verify's, or `reward`'s) may take in its worker process: past
    it the worker is killed and the completion scores 0, counted in the step's `reward_failures`."""
    episode_deadline_s: float = Field(900.0, gt=0)
    """Seconds one episode of `env` may take in its worker process: past it the worker is killed and the
    episode scores 0 (its recorded turns kept), counted in the step's `episode_failures`."""
    user_code_memory_mb: int = Field(2048, ge=64)
    """MiB of memory (heap and private mappings) each worker running a reward or an episode may hold: an
    allocation past it fails there and costs that one sample."""
    max_operand: int | None = Field(None, ge=1, le=999)
    """Tasks arith and arith-chat: the largest operand (default 99 for arith, 19 for arith-chat; a tenth
    of all pairs is held out for validation)."""
    val_size: int = Field(128, ge=1)
    """Validation problems (the most kept from a held-out split or val_dataset). Held out by count, the
    first val_size rows of a dataset, but never more than half of its rows."""

    @field_validator("dataset", "val_dataset", mode="before")
    @classmethod
    def _shipped_sample(cls, value: Any) -> Any:
        from coordinator.datasets import resolve

        return resolve(Path(value)) if isinstance(value, str | Path) else value

    def check_dataset(self) -> None:
        if self.name in ("dataset", "jsonl") and self.dataset is None:
            raise ValueError(
                f"task {self.name} needs dataset (a .jsonl or .parquet file, or a datasets directory)"
            )
        if self.name not in ("dataset", "jsonl") and (self.dataset or self.val_dataset or self.val_fraction):
            raise ValueError("dataset, val_dataset and val_fraction are for task dataset (--task dataset)")
        if self.max_operand is not None and self.name not in ("arith", "arith-chat"):
            raise ValueError("max_operand is for the tasks arith and arith-chat")
        for path in (self.dataset, self.val_dataset):
            if path is not None and not path.exists():
                raise ValueError(f"dataset {path} does not exist")
        if self.val_fraction is not None and self.val_dataset is not None:
            raise ValueError("give val_fraction or val_dataset, not both")

    def check_reward(self) -> None:
        if self.reward is not None and ":" not in self.reward:
            raise ValueError(f"reward {self.reward!r} is not of the form module:function")
        if self.env is not None and (self.reward or self.dataset or self.name != "arith"):
            raise ValueError("env brings its own problems and rewards: give no task, dataset or reward")


class SamplingConfig(_Slice):
    """What each step generates: prompts, samples per prompt and the sampling parameters."""

    prompts_per_step: int = Field(32, ge=1)
    """Prompts drawn per GRPO step (each sampled group_size times)."""
    group_size: int = Field(8, ge=1)
    """Samples per prompt (GRPO group)."""
    max_tokens: int = Field(8, ge=1)
    """Completion tokens per sample, at most."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the rollouts (validation is greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: 1 keeps every token."""
    top_k: int = Field(0, ge=0)
    """Sample from the k most likely tokens; 0: all."""
    stop: list[str] = ["\n"]
    """Stop strings: a completion ends at the first (it stays in the tokens trained on)."""


class MetricsConfig(_Slice):
    """Where the run's metrics are shown and logged."""

    mult_prob_warn: float = Field(1.05, gt=1)
    """Warn when token_mult_prob_error exceeds this."""
    progress: Literal["auto", "rich", "plain"] = "auto"
    """Live display: rich on a terminal, plain lines otherwise."""
    tensorboard: bool = True
    """Write TensorBoard event files to RUN_DIR/tensorboard (`tensorboard --logdir runs/`)."""
    wandb_project: str | None = None
    """Also log to Weights & Biases, in this project (WANDB_MODE=offline works without a network)."""


class RayConfig(_Slice):
    """Where `launcher: ray` places the run's trainer ranks and replicas on a Ray cluster (docs/ray.md)."""

    address: str | None = None
    """The Ray cluster to join (`ray.init(address=...)`: `host:port`, `ray://host:port`, `auto`); none:
    RAY_ADDRESS. The run never starts a Ray of its own (its ports would not stay on loopback)."""
    replicas: int = Field(1, ge=1, le=1024)
    """Rollout replicas, one actor each, spread over the cluster's nodes."""
    replica_cpus: float = Field(1.0, gt=0)
    """Ray CPUs each replica actor reserves."""
    replica_gpus: float = Field(0.0, ge=0)
    """Ray GPUs each replica actor reserves (1: vLLM on a GPU of its own)."""
    trainer_cpus: float = Field(1.0, gt=0)
    """Ray CPUs each trainer rank reserves (the ranks: trainer_procs, in one placement group)."""
    trainer_gpus: float = Field(0.0, ge=0)
    """Ray GPUs each trainer rank reserves."""
    trainer_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """The trainer's placement group strategy: PACK keeps ranks on as few nodes as fit."""
    replica_restart_wait_s: float = Field(0.0, ge=0, le=3600)
    """How long a step waits for a replica Ray is restarting (its node was lost) before it goes on
    without it; 0: at once, on the replicas that answer. With none answering, a step waits regardless."""


class EmbeddedConfig(_Slice):
    """Embedded mode: the processes the coordinator starts itself."""

    launcher: Literal["local", "ray"] = "local"
    """Embedded mode: where the run's processes start: `local`, child processes of the coordinator on
    this machine; `ray`, the trainer's ranks and the replicas as actors on a Ray cluster (`ray` section;
    Redis and the coordinator stay here; the `ray` extra)."""
    ray: RayConfig = RayConfig()
    """Embedded mode with `launcher: ray`: the cluster, replicas and resources (docs/ray.md)."""

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
    tls: bool = False
    """Embedded mode: the run's processes talk mutual TLS under a private CA in RUN_DIR/secrets (bearer
    tokens and signed weight updates are always on)."""
    trainer_procs: int = Field(1, ge=1)
    """Embedded mode: trainer ranks (torchrun; one per GPU), the model fully sharded (FSDP2) and checkpoints
    sharded; a run may resume on another number of ranks. 1: one plain process (unless the run's
    checkpoints are sharded already)."""
    kv_cache_gib: float = Field(1.0, gt=0)
    """Embedded rollout: KV-cache space (GiB)."""

    @field_validator("learner", mode="before")
    @classmethod
    def _over_demo(cls, value: Any) -> Any:
        return over(DEMO_LEARNER, value) if isinstance(value, dict) else value


class DistributedConfig(_Slice):
    """Distributed mode: the running services the coordinator drives (none given: embedded mode)."""

    redis_url: str | None = None
    """Distributed mode: the Redis holding run state (embedded mode starts a private one)."""
    trainer: str | None = None
    """Distributed mode: host:port of the trainer service."""
    rollout: list[str] = []
    """Distributed mode: host:port of each rollout replica; empty: discover them in Redis."""
    security: SecurityConfig = SecurityConfig()
    """Distributed mode: the coordinator's identity towards trainer and replicas (its token or client
    certificate, the CA it checks them against: fp8rl/security.py)."""

    def check(self) -> None:
        if bool(self.trainer) != bool(self.redis_url):
            raise ValueError("give redis_url and trainer together (distributed mode), or neither (embedded)")


# Every name users write (a `coordinator start` flag, a YAML key, a `--set` key) and the slice field it
# sets, in the order of `coordinator start --help`; a dumped config has these keys, in this order.
FIELDS: dict[str, str] = {
    "recipe": "run.recipe",
    "precision": "run.precision",
    "model": "run.model",
    "task": "task.name",
    "dataset": "task.dataset",
    "prompt_key": "task.prompt_key",
    "answer_key": "task.answer_key",
    "val_dataset": "task.val_dataset",
    "val_fraction": "task.val_fraction",
    "reward": "task.reward",
    "env": "task.env",
    "steps": "run.steps",
    "run_id": "run.run_id",
    "run_dir": "run.run_dir",
    "seed": "run.seed",
    "prompts_per_step": "sampling.prompts_per_step",
    "group_size": "sampling.group_size",
    "max_tokens": "sampling.max_tokens",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "stop": "sampling.stop",
    "max_staleness": "run.max_staleness",
    "val_every": "run.val_every",
    "max_operand": "task.max_operand",
    "val_size": "task.val_size",
    "mult_prob_warn": "metrics.mult_prob_warn",
    "max_restarts": "embedded.max_restarts",
    "compute_dtype": "embedded.compute_dtype",
    "learner": "embedded.learner",
    "redis_url": "distributed.redis_url",
    "trainer": "distributed.trainer",
    "rollout": "distributed.rollout",
    "security": "distributed.security",
    "tls": "embedded.tls",
    "progress": "metrics.progress",
    "trainer_procs": "embedded.trainer_procs",
    "kv_cache_gib": "embedded.kv_cache_gib",
    "launcher": "embedded.launcher",
    "ray": "embedded.ray",
    "tensorboard": "metrics.tensorboard",
    "wandb_project": "metrics.wandb_project",
}
_PATHS = {name: tuple(path.split(".")) for name, path in FIELDS.items()}
_SLICES = ("run", "task", "sampling", "metrics", "embedded", "distributed")
# The slices are filled from FIELDS' names only: their input keys are none a user writes (nor one that
# `--set` can make), so `--set run.steps=3` is refused as an unknown field, as it was before the slicing.
_INPUT = {name: f"{name}." for name in _SLICES}
_SLICE_OF_INPUT = {key: name for name, key in _INPUT.items()}


def public_name(dotted: str) -> str:
    """The name users write for a slice's field (``embedded.learner.optimizer.lr`` ->
    ``learner.optimizer.lr``)."""
    for name, path in FIELDS.items():
        if dotted == path or dotted.startswith(path + "."):
            return name + dotted[len(path) :]
    return dotted


def _nest(data: dict[str, Any]) -> dict[str, Any]:
    """Flat input (YAML, flags, ``--set``) as the slices' input; an unknown key stays, to be refused."""
    nested: dict[str, Any] = {}
    for key, value in data.items():
        if key in _PATHS:
            part, field = _PATHS[key]
            nested.setdefault(_INPUT[part], {})[field] = value
        else:
            nested[key] = value
    return nested


def _public_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    if not loc or loc[0] not in _SLICE_OF_INPUT:
        return loc  # an unknown key, or the whole config's check
    if len(loc) == 1:
        return ()  # a slice's own check reads as the whole config's
    field = public_name(f"{_SLICE_OF_INPUT[str(loc[0])]}.{loc[1]}")
    return (*field.split("."), *loc[2:])


def _public_errors(exc: ValidationError) -> ValidationError:
    """``exc`` with its locations under the names users write, in FIELDS' order: as the flat model's were."""
    errors = [
        InitErrorDetails(type=e["type"], loc=_public_loc(e["loc"]), input=e["input"], ctx=e.get("ctx", {}))
        for e in exc.errors()
    ]
    order = {name: i for i, name in enumerate(FIELDS)}  # unknown keys last, as pydantic reports them
    errors.sort(key=lambda e: order.get(str(e["loc"][0]), len(order)) if e["loc"] else len(order))
    return ValidationError.from_exception_data(exc.title, errors)


class CoordinatorConfig(BaseModel):
    """The run's config in slices, each read by the part of the coordinator it configures; input, dump and
    errors use the flat names of FIELDS."""

    model_config = ConfigDict(extra="forbid")

    run: RunConfig = Field(default_factory=RunConfig, validation_alias=_INPUT["run"])
    task: TaskConfig = Field(default_factory=TaskConfig, validation_alias=_INPUT["task"])
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, validation_alias=_INPUT["sampling"])
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, validation_alias=_INPUT["metrics"])
    embedded: EmbeddedConfig = Field(default_factory=EmbeddedConfig, validation_alias=_INPUT["embedded"])
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig, validation_alias=_INPUT["distributed"]
    )

    @model_validator(mode="wrap")
    @classmethod
    def _flat(cls, data: Any, handler: ModelWrapValidatorHandler[CoordinatorConfig]) -> CoordinatorConfig:
        try:
            return handler(_nest(data) if isinstance(data, dict) else data)
        except ValidationError as exc:
            raise _public_errors(exc) from None

    @model_validator(mode="after")
    def _consistent(self) -> CoordinatorConfig:
        # Once every field is valid, the checks across fields; the first problem found is the one reported.
        self.task.check_dataset()
        self.run.check()
        self.distributed.check()
        if self.is_embedded and self.distributed.security != SecurityConfig():
            raise ValueError("security configures a distributed coordinator; an embedded run makes its own")
        if self.embedded.launcher == "local" and self.embedded.ray != RayConfig():
            raise ValueError(
                "ray (and --replicas, --ray-address) configure launcher: ray; this run's is local"
            )
        if not self.is_embedded and self.embedded.launcher != "local":
            raise ValueError("launcher starts an embedded run's processes; a distributed run's are running")
        if not self.is_embedded and self.embedded.learner != EmbeddedConfig().learner:
            raise ValueError(
                "learner configures the embedded trainer; give a distributed trainer its own config"
            )
        self.task.check_reward()
        try:
            self.embedded.learner.loss.importance_sampling(get_recipe(self.run.recipe).importance_sampling)
        except ValueError as exc:
            raise ValueError(f"learner.{exc}") from None
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        nested = handler(self)
        return {name: nested[part][field] for name, (part, field) in _PATHS.items()}

    @property
    def is_embedded(self) -> bool:
        return self.distributed.redis_url is None

    def identity(self) -> dict[str, Any]:
        """What defines the run: compared when a run is resumed."""
        return {k: v for k, v in self.model_dump(mode="json").items() if k not in RESUMABLE_FIELDS}
