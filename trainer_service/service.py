"""Trainer handlers: exactly-once TrainStep, ComputeLogprobs, PublishWeights, checkpoints, status.

Plain Python over the learner; the gRPC servicer only converts messages and maps errors.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from google.protobuf import json_format

from fp8rl import routing
from fp8rl.config import config_hash
from fp8rl.errors import InvalidRequest, PermissionDenied, PreconditionFailed
from fp8rl.prometheus import Sample
from fp8rl.recipes import get_recipe
from fp8rl.sampling import SamplingSettings, sampling_settings
from fp8rl.security import is_loopback, proof_refusal
from fp8rl.serving import FENCE_METADATA
from fp8rl.v1 import trainer_pb2
from trainer_service import checkpoint, distributed
from trainer_service.config import TrainerConfig
from trainer_service.distributed import ONE_PROCESS, Ranks
from trainer_service.learner import Learner, NonFiniteGradient, SampleData
from trainer_service.publisher import Publisher, Target

log = logging.getLogger(__name__)
KEPT_RESULTS = 64  # replayable TrainStep results (the last ones; also saved with each checkpoint)


def check_tokens(field: str, ids: list[int], vocab: int, allow_empty: bool = False) -> None:
    if not ids and not allow_empty:
        raise InvalidRequest(field, "must not be empty")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(field, f"token id {bad} outside the vocabulary [0, {vocab})")


def parse_samples(
    samples: Any,
    vocab: int,
    max_positions: int,
    rewards_non_negative: bool = False,
    routers: Sequence[Any] = (),
) -> list[SampleData]:
    """Validated samples; ``rewards_non_negative`` when advantages are normalised by the group mean;
    ``routers``: the model's MoE routers (the shape a sample's routed experts must have)."""
    if not samples:
        raise InvalidRequest("samples", "at least one sample is required")
    out = []
    for i, s in enumerate(samples):
        field = f"samples[{i}]"
        prompt, completion, logprobs = (
            list(s.prompt_token_ids),
            list(s.completion_token_ids),
            list(s.gen_logprobs),
        )
        check_tokens(f"{field}.prompt_token_ids", prompt, vocab)
        check_tokens(f"{field}.completion_token_ids", completion, vocab)
        if len(prompt) + len(completion) > max_positions:
            raise InvalidRequest(
                field, f"{len(prompt) + len(completion)} tokens exceed the context of {max_positions}"
            )
        if len(logprobs) != len(completion):
            raise InvalidRequest(
                f"{field}.gen_logprobs", f"{len(logprobs)} logprobs for {len(completion)} tokens"
            )
        bad = next((x for x in logprobs if not math.isfinite(x) or x > 0), None)
        if bad is not None:
            raise InvalidRequest(f"{field}.gen_logprobs", f"logprobs must be finite and <= 0, got {bad}")
        if not math.isfinite(s.reward):
            raise InvalidRequest(f"{field}.reward", f"must be finite, got {s.reward}")
        advantage = s.advantage if s.HasField("advantage") else None
        if rewards_non_negative and advantage is None and s.reward < 0:
            raise InvalidRequest(
                f"{field}.reward", f"must be >= 0 with loss.advantage_norm 'mean', got {s.reward}"
            )
        if advantage is not None and not math.isfinite(advantage):
            raise InvalidRequest(f"{field}.advantage", f"must be finite, got {advantage}")
        routed = (
            parse_routed_experts(
                f"{field}.routed_experts", s.routed_experts, routers, len(prompt) + len(completion) - 1
            )
            if s.HasField("routed_experts")
            else None
        )
        loss_mask = list(s.loss_mask) or None
        if loss_mask is not None and len(loss_mask) != len(completion):
            raise InvalidRequest(f"{field}.loss_mask", f"{len(loss_mask)} flags for {len(completion)} tokens")
        if loss_mask is not None and not any(loss_mask):
            raise InvalidRequest(f"{field}.loss_mask", "covers none of the policy's tokens")
        out.append(
            SampleData(
                prompt, completion, logprobs, s.reward, s.group_id or str(i), advantage, routed, loss_mask
            )
        )
    return out


def parse_routed_experts(field: str, message: Any, routers: Sequence[Any], positions: int) -> torch.Tensor:
    """A sample's routed experts as [positions, MoE layers, top_k], checked against the model's routers."""
    if not routers:
        raise InvalidRequest(field, "the model has no mixture-of-experts layers")
    layers, top_k, experts = len(routers), int(routers[0].top_k), int(routers[0].num_experts)
    if (message.moe_layers, message.top_k) != (layers, top_k):
        raise InvalidRequest(
            field,
            f"{message.moe_layers} layers x top {message.top_k}; the model routes {layers} layers x "
            f"top {top_k}",
        )
    if message.id_bytes != routing.id_bytes(experts):
        raise InvalidRequest(
            field, f"id_bytes {message.id_bytes}, {routing.id_bytes(experts)} for {experts} experts"
        )
    try:
        ids = routing.unpack(message.expert_ids, message.id_bytes, layers, top_k)
    except ValueError as exc:
        raise InvalidRequest(field, str(exc)) from None
    if len(ids) != positions:
        raise InvalidRequest(field, f"{len(ids)} positions, the sequence computes {positions}")
    if ids.numel() and int(ids.max()) >= experts:
        raise InvalidRequest(field, f"expert id {int(ids.max())} outside [0, {experts})")
    return ids


class TrainerService:
    def __init__(
        self, config: TrainerConfig, learner: Learner | None = None, ranks: Ranks = ONE_PROCESS
    ) -> None:
        """``ranks``: this process's place in the trainer (trainer_service/distributed.py). Rank 0 serves:
        each method checks its request, then announces it to the other ranks, which run the same method
        on it."""
        self.config = config
        self.recipe = get_recipe(config.recipe)
        self.learner = learner or Learner(config, self.recipe, ranks)
        self.ranks = self.learner.ranks
        hp_dtype = torch.float32 if config.compute_dtype == "float32" else torch.bfloat16
        self.publisher = Publisher(
            self.recipe.rollout_weights,
            hp_dtype,
            self.recipe.name,
            config.security,
            high_precision=config.fp8_plan.high_precision,
            shared_memory=config.shared_memory_updates,
            tcp_streams=config.tcp_update_streams,
            weight_transfer=config.weight_transfer,
            device=self.learner.device,
        )
        self.registration_key = config.security.registration_key()  # checks replicas' proofs
        self.run_id = ""
        self.results: OrderedDict[int, trainer_pb2.TrainStepResponse] = OrderedDict()
        self.request_digests: dict[int, str] = {}  # step -> SHA-256 of the request that trained it
        self.fence = 0  # the newest coordinator fencing token seen (kept in checkpoints)
        self.started = time.time()
        self.steps_trained, self.train_seconds = 0, 0.0  # by this process, for /metrics
        self.last_metrics: dict[str, Any] = {}
        self.save_failures = 0  # scheduled checkpoints that failed (each retried after the next step)
        self.save_pending = False
        self.last_checkpoint = -1  # the step of the newest checkpoint this process wrote or resumed
        self._lock = threading.Lock()  # one TrainStep / checkpoint at a time
        if config.checkpoint_dir is not None and self.ranks.is_root:
            for path in checkpoint.clean_stale(config.checkpoint_dir):
                log.warning("removed %s, left by an interrupted checkpoint", path)
        if config.resume:
            self.restore()

    @property
    def step(self) -> int:
        return self.learner.step

    @contextlib.contextmanager
    def _collective(self, kind: str, request: Any = None) -> Iterator[None]:
        """Around the part of a call that runs collectives: once a request passed its checks, rank 0 has
        the other ranks run the same method on it (which reach here too, and announce nothing); an
        unexpected failure then ends the group rather than leave ranks out of step."""
        self.ranks.announce(kind, request.SerializeToString() if request is not None else b"")
        with distributed.in_step(self.ranks):
            yield

    def follow(self) -> None:
        """Ranks > 0: run rank 0's commands until it stops."""
        distributed.follow(
            {
                "train": lambda b: self.train_step(trainer_pb2.TrainStepRequest.FromString(b)),
                "logprobs": lambda b: self.compute_logprobs(trainer_pb2.ComputeLogprobsRequest.FromString(b)),
                "publish": lambda b: self.publish(trainer_pb2.PublishWeightsRequest.FromString(b)),
                "save": lambda b: self.save_checkpoint(),
            }
        )

    def stop_ranks(self) -> None:
        """Rank 0, shutting down: the other ranks stop after any command in flight (a call still running
        holds the lock; past the wait, torchrun ends them with this process)."""
        if self.ranks.sharded and self._lock.acquire(timeout=10):
            try:
                self.ranks.announce("stop", b"")
            finally:
                self._lock.release()

    def check_fence(self, fence: str | None, method: str) -> None:
        """Refuse a coordinator whose fencing token is older than one already seen: another coordinator
        took the run's lease after it. With authentication on, a ``method`` call without a token is
        refused too (without it, as from a test client on loopback, it is not fenced)."""
        if fence is None:
            if self.config.security.identifies_callers:
                raise PreconditionFailed(
                    f"{method}: call metadata {FENCE_METADATA} is missing: with authentication on, every "
                    "call that changes the run carries the coordinator's fencing token"
                )
            return
        if not fence.isdigit() or int(fence) >= 2**63:  # it becomes the epoch of updates (int64)
            raise InvalidRequest("fencing token", f"expected an integer in [0, 2^63), got {fence[:32]!r}")
        with self._lock:
            if int(fence) < self.fence:
                raise PreconditionFailed(
                    f"fencing token {fence} is stale: a coordinator with token {self.fence} drives the run"
                )
            self.fence = int(fence)

    def train_step(self, request: trainer_pb2.TrainStepRequest) -> trainer_pb2.TrainStepResponse:
        if not request.run_id:
            raise InvalidRequest("run_id", "required: a trainer serves one run")
        digest = hashlib.sha256(request.SerializeToString(deterministic=True)).hexdigest()
        with self._lock:
            if self.run_id and request.run_id != self.run_id:
                raise PreconditionFailed(f"trainer belongs to run {self.run_id!r}, not {request.run_id!r}")
            if request.step in self.results:  # already applied: answer again, train nothing
                if self.request_digests.get(request.step, digest) != digest:
                    raise PreconditionFailed(
                        f"step {request.step} was trained on another batch; only the same request replays"
                    )
                replay = trainer_pb2.TrainStepResponse()
                replay.CopyFrom(self.results[request.step])
                replay.replayed = True
                return replay
            if request.step != self.step:
                raise PreconditionFailed(f"expected step {self.step}, got step {request.step}")
            samples = parse_samples(
                request.samples,
                self.learner.vocab_size,
                self.learner.max_positions,
                rewards_non_negative=self.config.loss.advantage_norm == "mean",
                routers=self.learner.routers,
            )
            sampling = sampling_settings(request.sampling)
            with self._collective("train", request):
                return self._train(request, samples, sampling, digest)

    def _train(
        self,
        request: trainer_pb2.TrainStepRequest,
        samples: list[SampleData],
        sampling: SamplingSettings,
        digest: str,
    ) -> trainer_pb2.TrainStepResponse:
        """The step itself, and a scheduled checkpoint (on every rank). A skipped step is an answer, not
        an error: every rank skips it alike (the gradient norm is global), and nothing is remembered."""
        try:
            metrics = self.learner.train(samples, sampling)
        except NonFiniteGradient as exc:
            log.warning("%s", exc)
            return trainer_pb2.TrainStepResponse(
                step=request.step,
                weight_version=self.step,
                skipped=trainer_pb2.StepSkipped(
                    reason=trainer_pb2.StepSkipped.REASON_NON_FINITE_GRADIENT, detail=str(exc)
                ),
            )
        self.steps_trained += 1
        self.train_seconds += metrics["train_s"]
        self.last_metrics = metrics
        self.run_id = self.run_id or request.run_id
        response = trainer_pb2.TrainStepResponse(
            step=request.step,
            weight_version=self.step,
            metrics=trainer_pb2.TrainMetrics(**metrics),
        )
        self._remember(request.step, response, digest)
        every = self.config.checkpoint_every if self.config.checkpoint_dir is not None else 0
        if (every and self.step % every == 0) or self.save_pending:
            self._save_after_step()
        return response

    def _save_after_step(self) -> None:
        """A scheduled checkpoint. The step is applied whatever happens here: a failed save (a full disk,
        whichever file it hit) is logged, counted and retried after the next step, never reported as the
        step's failure; it leaves nothing behind, so a resume takes the last complete checkpoint."""
        try:
            self._save()
        except checkpoint.SaveFailed as exc:
            if self.ranks.sharded:
                raise  # a rank's failed write leaves the ranks out of step: the group ends (in_step)
            self.save_failures += 1
            self.save_pending = True
            log.error(
                "%s; the step is trained all the same (version %d), and the checkpoint is retried after "
                "the next step (%d failed so far)",
                exc,
                self.step,
                self.save_failures,
            )
        else:
            self.save_pending = False
            self.last_checkpoint = self.step

    def _remember(self, step: int, response: trainer_pb2.TrainStepResponse, digest: str | None) -> None:
        self.results[step] = response
        if digest:
            self.request_digests[step] = digest
        while len(self.results) > KEPT_RESULTS:
            dropped, _ = self.results.popitem(last=False)
            self.request_digests.pop(dropped, None)

    def compute_logprobs(
        self, request: trainer_pb2.ComputeLogprobsRequest
    ) -> trainer_pb2.ComputeLogprobsResponse:

        if not request.sequences:
            raise InvalidRequest("sequences", "at least one sequence is required")
        vocab = self.learner.vocab_size
        samples = []
        for i, seq in enumerate(request.sequences):
            prompt, completion = list(seq.prompt_token_ids), list(seq.completion_token_ids)
            check_tokens(f"sequences[{i}].prompt_token_ids", prompt, vocab)
            check_tokens(f"sequences[{i}].completion_token_ids", completion, vocab)
            if len(prompt) + len(completion) > self.learner.max_positions:
                raise InvalidRequest(
                    f"sequences[{i}]", f"exceeds the context of {self.learner.max_positions}"
                )
            samples.append(SampleData(prompt, completion, [0.0] * len(completion)))
        sampling = sampling_settings(request.sampling)
        with self._lock:
            with self._collective("logprobs", request):
                logprobs = self.learner.score(self.learner.collate(samples), sampling).cpu()
            version = self.step
        results = []
        for row, s in zip(logprobs, samples, strict=True):
            start = len(s.prompt) - 1
            results.append(
                trainer_pb2.SequenceLogprobs(logprobs=row[start : start + len(s.completion)].tolist())
            )
        return trainer_pb2.ComputeLogprobsResponse(results=results, weight_version=version)

    def publish(self, request: trainer_pb2.PublishWeightsRequest) -> trainer_pb2.PublishWeightsResponse:
        if request.version != self.step:
            raise PreconditionFailed(
                f"trainer holds version {self.step}, cannot publish version {request.version}"
            )
        refused = self.check_targets(request)
        allowed = [t for i, t in enumerate(request.targets) if i not in refused]
        with self._lock:  # the weights must not move while they are quantized
            if request.version != self.step:  # again: a TrainStep may have finished meanwhile
                raise PreconditionFailed(
                    f"trainer holds version {self.step}, cannot publish version {request.version}"
                )
            built = None
            if self.ranks.sharded:  # every rank takes part in gathering each tensor whole
                with self._collective("publish", request):
                    built = self.publisher.build(self.learner.published_weights(), keep=self.ranks.is_root)
                if not self.ranks.is_root:
                    return trainer_pb2.PublishWeightsResponse(version=request.version)
            deliveries = self.publisher.publish(
                request.version,
                self.learner.published_weights,
                [Target(t.address, t.held_version) for t in allowed],
                epoch=self.fence,
                built=built,
            )
        delivered = iter(trainer_pb2.PublishResult(**vars(d)) for d in deliveries)
        results = [
            trainer_pb2.PublishResult(address=t.address, ok=False, error=f"PERMISSION_DENIED: {refused[i]}")
            if i in refused
            else next(delivered)
            for i, t in enumerate(request.targets)
        ]
        return trainer_pb2.PublishWeightsResponse(version=request.version, results=results)

    def check_targets(self, request: trainer_pb2.PublishWeightsRequest) -> dict[int, str]:
        """The targets that are not the run's replicas (index -> why), which get nothing: an impostor
        registered beside real replicas cannot stall a run. Raises when the request is malformed or no
        target is the run's."""
        if not request.targets:
            raise InvalidRequest("targets", "at least one target is required")
        refused = {}
        for i, t in enumerate(request.targets):
            if not t.address or ":" not in t.address:
                raise InvalidRequest(f"targets[{i}].address", f"expected host:port, got {t.address!r}")
            why = self._target_refusal(f"targets[{i}].address", t)
            if why:
                refused[i] = why
        if len(refused) == len(request.targets):
            raise PermissionDenied("; ".join(refused.values()))
        return refused

    def _target_refusal(self, field: str, target: trainer_pb2.PublishTarget) -> str | None:
        """Weights go only to the run's replicas: listed in publish_to, or proving (with a proof that has
        not expired) they hold the run's registration key; a trainer without either sends only to
        loopback."""
        if target.address in self.config.publish_to:
            return None
        if self.registration_key is not None:
            why = proof_refusal(self.registration_key, target.address, target.proof)
            if why is None:
                return None
        elif not self.config.publish_to and is_loopback(target.address.rsplit(":", 1)[0]):
            return None
        else:
            why = "not loopback, and this trainer has no registration key to check a proof with"
        return f"{field}: {target.address} is not a replica of this run ({why}; not in publish_to)"

    def save_checkpoint(self) -> trainer_pb2.SaveCheckpointResponse:
        if self.config.checkpoint_dir is None:
            raise PreconditionFailed("no checkpoint_dir configured")
        with self._lock, self._collective("save"):
            path = self._save()
            self.save_pending, self.last_checkpoint = False, self.step
        return trainer_pb2.SaveCheckpointResponse(path=path, step=self.step)

    def _save(self) -> str:
        if self.config.checkpoint_dir is None:
            raise PreconditionFailed("no checkpoint_dir configured")
        path = checkpoint.write(
            self.config.checkpoint_dir, self.learner, self._meta(), self.config.keep_checkpoints
        )
        return str(path)

    def _meta(self) -> dict[str, Any]:
        """The service's part of a checkpoint (JSON; the learner's is checkpoint.write's)."""
        return {
            "run_id": self.run_id,
            "recipe": self.recipe.name,
            "config_hash": config_hash(self.config.model_copy(update={"resume": False})),
            "results": {str(k): json_format.MessageToDict(v) for k, v in self.results.items()},
            "request_digests": {str(k): v for k, v in self.request_digests.items()},
            "fence": self.fence,
        }

    def restore(self) -> None:
        """Load the latest complete checkpoint of ``checkpoint_dir``, if any (written by any number of
        ranks)."""
        found = checkpoint.resume(self.config.checkpoint_dir, self.learner)
        if found is None:
            log.info("no checkpoint to resume from; starting at step 0")
            return
        path, meta = found
        self.last_checkpoint = self.step
        self.run_id = meta["run_id"]
        self.fence = int(meta.get("fence", 0))
        digests = meta.get("request_digests", {})  # (absent from checkpoints of older versions)
        for step, result in sorted(meta["results"].items(), key=lambda kv: int(kv[0])):
            response = json_format.ParseDict(result, trainer_pb2.TrainStepResponse())
            self._remember(int(step), response, digests.get(step))
        if meta["config_hash"] != config_hash(self.config.model_copy(update={"resume": False})):
            log.warning("resuming %s under a different trainer config", path)
        log.info("resumed from %s at step %d", path, self.step)

    def prometheus(self) -> list[Sample]:
        """The trainer's figures for /metrics (fp8rl/prometheus.py), read at scrape time."""
        error = self.last_metrics.get("token_mult_prob_error", float("nan"))
        return [
            Sample("trainer_step", "gauge", "next GRPO step to train", self.step),
            Sample("trainer_weight_version", "gauge", "weight version held (= steps trained)", self.step),
            Sample(
                "trainer_train_step_seconds",
                "summary",
                "TrainStep compute time",
                self.steps_trained,
                self.train_seconds,
            ),
            Sample(
                "trainer_token_mult_prob_error", "gauge", "last step's token_mult_prob_error", float(error)
            ),
            Sample(
                "trainer_checkpoint_failures",
                "counter",
                "scheduled checkpoints that failed",
                self.save_failures,
            ),
        ]

    def status(self) -> trainer_pb2.TrainerStatus:
        return trainer_pb2.TrainerStatus(
            model=str(self.config.model),
            recipe=self.recipe.name,
            backend=self.learner.backend_name,
            device=self.learner.device.type,
            step=self.step,
            weight_version=self.step,
            uptime_s=time.time() - self.started,
            run_id=self.run_id,
            checkpoint_failures=self.save_failures,
            checkpoint_pending=self.save_pending,
            last_checkpoint_step=self.last_checkpoint,
        )
