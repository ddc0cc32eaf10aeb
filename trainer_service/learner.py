"""The learner: an HF causal LM with float32 master weights, AdamW, and the GRPO step.

Version semantics: the weights after ``n`` applied TrainSteps are version ``n``; the step to train next is
``n`` as well. Nothing here does I/O.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import astuple, dataclass
from typing import Any, TypeVar

import torch

from fp8rl import grpo, quant, routing
from fp8rl.devices import resolve_device
from fp8rl.logprobs import token_logprobs
from fp8rl.recipes import ImportanceSampling, Recipe
from fp8rl.sampling import SamplingSettings
from trainer_service.config import TrainerConfig
from trainer_service.distributed import ONE_PROCESS, Ranks
from trainer_service.exact import attend as exact_attend
from trainer_service.exact import convert_exact
from trainer_service.fp8_linear import Backend, convert_linears, fp8_context, resolve_backend
from trainer_service.kv_cache import KVCache
from trainer_service.routing import moe_routers, own_routing, routed

T = TypeVar("T")

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class NonFiniteGradient(Exception):
    """A mini-batch's gradient (or a tensor FP8 had to quantize on the way) is NaN or inf. Out of
    :meth:`Learner.train` it means the step was skipped: the weights and optimizer state are unchanged."""


@dataclass(frozen=True)
class SampleData:
    prompt: list[int]
    completion: list[int]
    gen_logprobs: list[float]
    reward: float = 0.0
    group: str = ""
    advantage: float | None = None
    # MoE: the experts the rollout routed each position it computed to, [prompt + completion - 1,
    # MoE layers, top_k] (fp8rl.routing)
    routed_experts: torch.Tensor | None = None
    # Multi-turn: one flag per completion token, True where the policy sampled it (only those are trained
    # and measured); None: every completion token is the policy's
    loss_mask: list[bool] | None = None


@dataclass
class PaddedBatch:
    """Right-padded sequences; per-token tensors are aligned with the logits that predict them: position
    t of ``targets``/``mask``/``gen`` is the token at t + 1 of ``input_ids``."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1]
    mask: torch.Tensor  # [B, L-1] float, 1 on the policy's completion tokens
    gen: torch.Tensor  # [B, L-1] rollout logprobs (0 elsewhere)
    routed: torch.Tensor | None = None  # [B, L, MoE layers, top_k] the rollout's experts (UNKNOWN elsewhere)

    def rows(self, index: torch.Tensor) -> PaddedBatch:
        return self._map(lambda t: t[index])

    def to(self, device: torch.device) -> PaddedBatch:
        return self._map(lambda t: t.to(device))

    def _map(self, f: Callable[[torch.Tensor], torch.Tensor]) -> PaddedBatch:
        routed = None if self.routed is None else f(self.routed)
        return PaddedBatch(
            f(self.input_ids), f(self.attention_mask), f(self.targets), f(self.mask), f(self.gen), routed
        )


def collate(samples: Sequence[SampleData], pad_id: int = 0, multiple: int = 1) -> PaddedBatch:
    """Right-pad ``samples`` to the longest, rounded up to ``multiple`` positions (padding is masked out:
    attention, loss and metrics never see it)."""
    longest = max(len(s.prompt) + len(s.completion) for s in samples)
    length = -(-longest // multiple) * multiple
    b = len(samples)
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    attention = torch.zeros(b, length, dtype=torch.long)
    mask = torch.zeros(b, length - 1)
    gen = torch.zeros(b, length - 1)
    for i, s in enumerate(samples):
        p, c = len(s.prompt), len(s.completion)
        input_ids[i, : p + c] = torch.tensor(s.prompt + s.completion)
        attention[i, : p + c] = 1
        mask[i, p - 1 : p + c - 1] = 1 if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=mask.dtype)
        gen[i, p - 1 : p + c - 1] = torch.tensor(s.gen_logprobs)
    return PaddedBatch(input_ids, attention, input_ids[:, 1:].clone(), mask, gen, _routed(samples, length))


def _masked_logits(model: Any, batch: PaddedBatch, scored: torch.Tensor) -> torch.Tensor:
    """The LM head's logits [N, V] at the ``scored`` positions [B, L-1] only (the decoder, then the head:
    the causal LMs of docs/architectures.md apply nothing else to the last hidden state)."""
    hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    return model.get_output_embeddings()(hidden.last_hidden_state[:, :-1][scored])


def _routed(samples: Sequence[SampleData], length: int) -> torch.Tensor | None:
    """The samples' rollout routings as [B, length, layers, top_k], UNKNOWN where none was sent; None
    when no sample carries one."""
    shaped = next((s.routed_experts for s in samples if s.routed_experts is not None), None)
    if shaped is None:
        return None
    out = torch.full((len(samples), length, *shaped.shape[1:]), routing.UNKNOWN, dtype=torch.long)
    for i, s in enumerate(samples):
        if s.routed_experts is not None:
            out[i, : len(s.routed_experts)] = s.routed_experts
    return out


TE_TOKEN_MULTIPLE = 16  # positions a te batch is padded to


def split(n: int, parts: int) -> list[torch.Tensor]:
    """Indices 0..n-1 in ``parts`` contiguous, nearly equal, non-empty chunks."""
    return [c for c in torch.arange(n).tensor_split(min(parts, n)) if len(c)]


@dataclass(frozen=True)
class StepInputs:
    """What every mini-batch of one TrainStep reads: the batch and, over its rows and tokens, the
    figures computed once before the first update."""

    batch: PaddedBatch
    sampling: SamplingSettings
    prev: torch.Tensor  # [B, L-1] logprobs under the weights before the step
    support: torch.Tensor  # [B, L-1] float, the tokens the loss and metrics cover
    weights: torch.Tensor  # [B, L-1] importance weights
    advantages: torch.Tensor  # [B]
    ref: torch.Tensor | None  # [B, L-1] reference logprobs, when the loss has a KL term


@dataclass(frozen=True)
class Update:
    """One optimizer step's figures, summed over every rank's micro-batches."""

    loss: float
    grad_norm: float
    clipped: float  # the micro-batches' PPO clipped fractions, summed
    micro_batches: int


class Learner:
    def __init__(self, config: TrainerConfig, recipe: Recipe, ranks: Ranks = ONE_PROCESS) -> None:
        """``ranks``: the group this learner is one rank of (torchrun); with more than one, its model is
        fully sharded and every rank works on its share of each batch (trainer_service/distributed.py)."""
        from transformers import AutoModelForCausalLM

        torch.manual_seed(config.seed)
        self.config, self.recipe, self.ranks = config, recipe, ranks
        self.device = torch.device(resolve_device(config.device))
        if self.device.type == "cuda":  # (the device torchrun's rank was given: join_group)
            self.device = torch.device("cuda", torch.cuda.current_device())
        model: Any = AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.float32)
        self.model = model.to(self.device)
        self.model.train()
        self.backend: Backend | None = None
        self.exact = config.precision.consistency == "exact"
        fp8 = recipe.train_linears == "fp8"
        if self.exact:  # (the rollout's arithmetic: fp8rl/exact.py; FP8 GEMMs too)
            self.backend = "emulated" if fp8 else None
            convert_exact(
                self.model,
                recipe.scale_format if fp8 else None,
                config.fp8_plan.high_precision,
                COMPUTE_DTYPES[config.compute_dtype],
                cache_weights=not ranks.sharded,
            )
        elif fp8:
            self.backend = resolve_backend(config.fp8_backend, cuda=self.device.type == "cuda")
            convert_linears(self.model, self.backend, recipe.scale_format, config.fp8_plan.high_precision)
        # Transformer Engine's FP8 GEMMs need the flattened token count to be a multiple of 8 (16 to be
        # safe): sequences are padded to 16 positions (masked: nothing sees the padding), under `te` and
        # under `emulated` alike, whose wgrad then quantizes the same 128 consecutive tokens per feature
        # as TE's (the padding's activations are in those groups: they share its amax).
        self.token_multiple = TE_TOKEN_MULTIPLE if self.backend is not None else 1
        self.kv_cache: KVCache | None = None  # under a -kv recipe: the rollout's FP8 attention, emulated
        if recipe.kv_cache_dtype == "fp8":
            self.kv_cache = KVCache(
                self.model,
                recipe.scale_format,
                calibrate=config.kv_scales == "calibrated",
                emulate=config.emulate_kv_cache,
                device=self.device,
                attention=exact_attend if self.exact else None,
            )
            self.kv_cache.install(self.model)
        self.routers = moe_routers(self.model)
        self.routing_seen = routing.Mismatch()  # (the pre-step scoring's, per step)
        self.reference = None
        if config.loss.kl_coef > 0:
            if ranks.sharded:
                raise ValueError("loss.kl_coef > 0 (a reference model) is not supported across ranks yet")
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
            if self.kv_cache is not None:  # the same FP8 attention, with the policy's scales
                self.kv_cache.install(self.reference)
        if ranks.sharded:
            shard(self.model)
        opt = config.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
        )
        self.vocab_size = self.model.config.vocab_size
        self.max_positions = self.model.config.max_position_embeddings
        self.pad_id = self.model.config.pad_token_id or 0
        self.step = 0  # = the weight version
        self.is_config = importance_sampling_config(recipe.importance_sampling, config)
        # Exact mode's forward under grad is bit for bit the scoring pass: one forward serves both.
        self.one_pass = self.exact and config.mini_batches == 1

    def collate(self, samples: Sequence[SampleData]) -> PaddedBatch:
        """``samples`` as a batch on the device, padded to ``token_multiple`` positions."""
        return collate(samples, self.pad_id, self.token_multiple).to(self.device)

    @property
    def backend_name(self) -> str:
        return self.backend or "bf16"

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.config.compute_dtype == "float32" or self.exact:  # (exact modules cast themselves)
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def logprobs(
        self,
        batch: PaddedBatch,
        sampling: SamplingSettings,
        model: torch.nn.Module | None = None,
        calibrate: bool = False,
    ) -> torch.Tensor:
        """Processed logprobs of ``batch.targets`` [B, L-1] (grad flows when enabled by the caller; in
        exact mode 0 where ``batch.mask`` is, those positions are not computed).
        ``calibrate``: the batch's queries, keys and values count towards the next version's FP8
        attention scales."""
        # Across ranks NaN must not raise on one rank while the others wait in a collective: it flows
        # into the global gradient norm, which every rank refuses alike.
        passes = quant.nonfinite_passes() if self.ranks.sharded else contextlib.nullcontext()
        recording = (
            self.kv_cache.recording(batch.attention_mask)
            if calibrate and self.kv_cache is not None
            else contextlib.nullcontext()
        )
        replay = batch.routed if self.config.routing_replay and model is None else None
        with (
            self.autocast(),
            fp8_context(self.backend, self.recipe.scale_format),
            passes,
            recording,
            routed(self.routers if model is None else [], replay) as chosen,
        ):
            if self.exact:
                scored = batch.mask != 0
                logits = _masked_logits(model or self.model, batch, scored)
            else:
                logits = (model or self.model)(
                    input_ids=batch.input_ids, attention_mask=batch.attention_mask
                ).logits[:, :-1]
        if calibrate and self.routers and batch.routed is not None:  # (the step's pre-update scoring)
            own = own_routing(chosen, *batch.input_ids.shape)
            predicting = torch.nn.functional.pad(batch.mask.bool(), (0, 1))  # the positions scored
            self.routing_seen += routing.mismatch(own.cpu(), batch.routed.cpu(), predicting.cpu())
        if self.exact:  # (the LM head on the masked positions only: exact GEMM rows do not depend on
            # how many there are, and prompt and padding rows are most of a long micro-batch's)
            chosen_logprobs = token_logprobs(
                logits.float(), batch.targets[scored], sampling.temperature, sampling.top_k, sampling.top_p
            )
            return torch.zeros_like(batch.mask, dtype=chosen_logprobs.dtype).masked_scatter(
                scored, chosen_logprobs
            )
        return token_logprobs(
            logits.float(), batch.targets, sampling.temperature, sampling.top_k, sampling.top_p
        )

    @torch.no_grad()
    def score(self, batch: PaddedBatch, sampling: SamplingSettings, calibrate: bool = False) -> torch.Tensor:
        """``logprobs`` without grad, in micro-batches; across ranks each scores its share of them and
        every rank gets them all."""
        micros = list(torch.arange(len(batch.input_ids)).split(self.config.micro_batch_size))
        scored = [
            (self.logprobs(batch.rows(m), sampling, calibrate=calibrate and real), real)
            for m, real in self._share(micros)
        ]
        local = torch.cat([s for s, real in scored if real] or [scored[0][0][:0]])  # stand-ins dropped
        owners = [
            torch.cat(micros[r :: self.ranks.world] or [micros[0][:0]]) for r in range(self.ranks.world)
        ]
        return self.ranks.gather_rows(local, owners)

    def _share(self, micros: list[torch.Tensor]) -> list[tuple[torch.Tensor, bool]]:
        """This rank's micro-batches, with whether each is real: whole micro-batches, round robin, so each
        is exactly one a single process runs (FP8's wgrad quantizes 128 consecutive tokens per feature:
        the same rows give the same groups), as many on every rank (FSDP's collectives run per forward
        and backward); a rank short of one takes a stand-in (one row, weighed zero or dropped). A world
        of one runs them all, in order."""
        mine = [(m, True) for m in micros[self.ranks.rank :: self.ranks.world]]
        return mine + [(micros[0][:1], False)] * (_ceil_div(len(micros), self.ranks.world) - len(mine))

    def learning_rate(self) -> float:
        warmup = self.config.optimizer.warmup_steps
        scale = min(1.0, (self.step + 1) / warmup) if warmup else 1.0
        return self.config.optimizer.lr * scale

    def train(self, samples: Sequence[SampleData], sampling: SamplingSettings) -> dict[str, Any]:
        """One GRPO step on ``samples``; afterwards the weights are version ``step + 1``. Raises
        :class:`NonFiniteGradient` when it skipped the step instead (weights and AdamW state unchanged)."""
        start = time.perf_counter()
        lr = self.learning_rate()
        if self.one_pass:
            batch, metrics, updates = self._one_pass(samples, sampling, lr)
        else:
            inputs, metrics = self._inputs(samples, sampling)
            batch, updates = inputs.batch, self._updates(inputs, lr)
        if self.kv_cache is not None:
            self.kv_cache.calibrate(self.ranks.all_max)
        self.step += 1
        seconds = time.perf_counter() - start
        tokens = int(batch.mask.sum().item())
        micro_batches = sum(u.micro_batches for u in updates)
        return metrics | {
            "loss": _mean([u.loss for u in updates]),
            "grad_norm": _mean([u.grad_norm for u in updates]),
            "learning_rate": lr,
            "ppo_clipped_fraction": sum(u.clipped for u in updates) / micro_batches
            if micro_batches
            else math.nan,
            "num_tokens": tokens,
            "num_samples": len(samples),
            "tokens_per_s": tokens / seconds,
            "train_s": seconds,
            "reward_mean": sum(s.reward for s in samples) / len(samples),
        }

    def _inputs(
        self, samples: Sequence[SampleData], sampling: SamplingSettings
    ) -> tuple[StepInputs, dict[str, Any]]:
        """The step's batch and what is computed over it before any update, with the metrics of the
        rollout's divergence from the trainer."""
        batch = self.collate(samples)
        if self.kv_cache is not None:  # (whatever a failed step recorded does not count)
            self.kv_cache.amax.zero_()
        self.routing_seen = routing.Mismatch()
        prev = self.score(batch, sampling, calibrate=True)  # (the step's sequences set the next KV scales)
        support, weights, metrics = self._divergence(batch, prev)
        advantages = self._advantages(samples).to(self.device)
        ref = self._reference_logprobs(batch, sampling)
        return StepInputs(batch, sampling, prev, support, weights.weights, advantages, ref), metrics

    def _divergence(
        self, batch: PaddedBatch, prev: torch.Tensor
    ) -> tuple[torch.Tensor, grpo.ISWeights, dict[str, Any]]:
        """The tokens the loss and metrics cover, their importance weights, and the metrics of the
        rollout's divergence from ``prev`` (the trainer's logprobs of the batch before the update)."""
        support = grpo.sampling_support(prev, batch.mask)
        weights = grpo.importance_weights(prev, batch.gen, support, self.is_config)
        metrics: dict[str, Any] = grpo.divergence_metrics(prev, batch.gen, support, weights)
        metrics |= grpo.token_histograms(prev, batch.gen, support)
        metrics["out_of_support_fraction"] = 1 - support.sum().item() / max(batch.mask.sum().item(), 1)
        if batch.routed is not None and self.routers:  # (every rank scored its share: their sum)
            metrics |= routing.Mismatch(
                *(int(self.ranks.all_sum(n)) for n in astuple(self.routing_seen))
            ).metrics()
        return support, weights, metrics

    def _one_pass(
        self, samples: Sequence[SampleData], sampling: SamplingSettings, lr: float
    ) -> tuple[PaddedBatch, dict[str, Any], list[Update]]:
        """The step in one forward per micro-batch (exact mode, one mini-batch): the forward the update
        differentiates is bit for bit the scoring pass, so its detached logprobs are ``prev``; each
        micro-batch's loss is a sum over its tokens, and the mini-batch's token count divides the
        gradient once every micro-batch has run (:meth:`_mini_batch` divides each loss by it)."""
        batch = self.collate(samples)
        if self.kv_cache is not None:
            self.kv_cache.amax.zero_()
        self.routing_seen = routing.Mismatch()
        advantages = self._advantages(samples).to(self.device)
        ref = self._reference_logprobs(batch, sampling)
        self.optimizer.zero_grad(set_to_none=True)
        micros = list(torch.arange(len(batch.input_ids)).split(self.config.micro_batch_size))
        try:
            scored, figures = [], []
            for micro, real in self._share(micros):
                prev, loss, clipped = self._summed_loss(
                    batch.rows(micro), sampling, advantages[micro], real, ref, micro
                )
                if real:
                    scored.append(prev)
                    figures.append((loss, clipped))
            owners = [
                torch.cat(micros[r :: self.ranks.world] or [micros[0][:0]]) for r in range(self.ranks.world)
            ]
            prev = self.ranks.gather_rows(torch.cat(scored or [batch.gen[:0]]), owners)
            support, _, metrics = self._divergence(batch, prev)
            normalizer = support.sum().item()
            if normalizer == 0:  # (no token to learn from: Adam would still move on its moments)
                self.optimizer.zero_grad(set_to_none=True)
                return batch, metrics, []
            for parameter in self.model.parameters():
                if parameter.grad is not None:
                    parameter.grad.div_(normalizer)
            loss, clipped, counted = self._reduced(
                sum(f[0] for f in figures) / normalizer, sum(f[1] for f in figures), len(figures)
            )
            return batch, metrics, [Update(loss, self._optimizer_step(0, lr), clipped, counted)]
        except NonFiniteGradient as exc:
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteGradient(
                f"step {self.step}: non-finite gradient: {exc} (rewards or advantages too large?); "
                f"the update was skipped, the weights stay at version {self.step}"
            ) from None

    def _summed_loss(
        self,
        rows: PaddedBatch,
        sampling: SamplingSettings,
        advantages: torch.Tensor,
        real: bool,
        ref: torch.Tensor | None,
        micro: torch.Tensor,
    ) -> tuple[torch.Tensor, float, float]:
        """One micro-batch of :meth:`_one_pass`: the loss summed over its tokens, its gradient added;
        returns its logprobs (detached: ``prev``), the loss and the PPO clipped fraction."""
        cur = self._checked(functools.partial(self.logprobs, rows, sampling, calibrate=real), 0)
        prev = cur.detach()
        support = grpo.sampling_support(prev, rows.mask)
        terms = grpo.ppo_loss(
            cur,
            prev,
            advantages,
            support if real else torch.zeros_like(support),
            grpo.importance_weights(prev, rows.gen, support, self.is_config).weights,
            self.config.loss.clip_eps,
            1.0,
            None if ref is None else ref[micro],
            self.config.loss.kl_coef,
        )
        self._checked(terms.loss.backward, 0)
        return prev, terms.loss.item(), terms.clipped_fraction.item()

    def _updates(self, inputs: StepInputs, lr: float) -> list[Update]:
        """An optimizer step per mini-batch that covers a token. With several, a non-finite gradient in
        a later one must undo the earlier ones: the TrainStep is applied whole or not at all."""
        before = self._snapshot() if self.config.mini_batches > 1 else None
        minis = split(len(inputs.advantages), self.config.mini_batches)
        try:
            done = [self._mini_batch(inputs, mini, index, lr) for index, mini in enumerate(minis)]
        except NonFiniteGradient as exc:
            self.optimizer.zero_grad(set_to_none=True)
            if before is not None:
                self._restore(before)
            raise NonFiniteGradient(
                f"step {self.step}: non-finite gradient: {exc} (rewards or advantages too large?); "
                f"the update was skipped, the weights stay at version {self.step}"
            ) from None
        return [u for u in done if u is not None]

    def _mini_batch(self, inputs: StepInputs, mini: torch.Tensor, index: int, lr: float) -> Update | None:
        """One optimizer step on the rows ``mini`` (mini-batch ``index``), each rank on its share of
        its micro-batches; None when the rows cover no token (Adam would still move on its moments)."""
        self.optimizer.zero_grad(set_to_none=True)
        normalizer = inputs.support[mini].sum().item()  # every rank has the whole batch: the global count
        if normalizer == 0:
            return None
        figures = []  # (loss, PPO clipped fraction) of this rank's real micro-batches
        for micro, real in self._share(list(mini.split(self.config.micro_batch_size))):
            terms = self._micro_batch(inputs, micro, real, normalizer, index)
            if real:
                figures.append((terms.loss.item(), terms.clipped_fraction.item()))
        loss, clipped, counted = self._reduced(
            sum(f[0] for f in figures), sum(f[1] for f in figures), len(figures)
        )
        return Update(loss, self._optimizer_step(index, lr), clipped, counted)

    def _optimizer_step(self, index: int, lr: float) -> float:
        """Clip the accumulated gradient and step AdamW at ``lr``; returns the gradient norm. Raises
        :class:`NonFiniteGradient` for a non-finite norm (mini-batch ``index``), stepping nothing."""
        norm = _item(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optimizer.grad_clip))
        if not math.isfinite(norm):
            raise NonFiniteGradient(f"the gradient norm of mini-batch {index} is {norm}")
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return norm

    def _micro_batch(
        self, inputs: StepInputs, micro: torch.Tensor, real: bool, normalizer: float, index: int
    ) -> grpo.LossTerms:
        """The loss on the rows ``micro``, its gradient added to the mini-batch's (a stand-in, not
        ``real``, weighs nothing); ``normalizer``: the mini-batch's token count."""
        cur = self._checked(
            functools.partial(self.logprobs, inputs.batch.rows(micro), inputs.sampling), index
        )
        support = inputs.support[micro]
        terms = grpo.ppo_loss(
            cur,
            inputs.prev[micro],
            inputs.advantages[micro],
            support if real else torch.zeros_like(support),
            inputs.weights[micro],
            self.config.loss.clip_eps,
            normalizer,
            None if inputs.ref is None else inputs.ref[micro],
            self.config.loss.kl_coef,
        )
        self._checked(terms.loss.backward, index)
        return terms

    def _reduced(self, loss: float, clipped: float, counted: int) -> tuple[float, float, int]:
        """This rank's sums over its real micro-batches (loss, PPO clipped fractions, how many) -> every
        rank's."""
        return self.ranks.all_sum(loss), self.ranks.all_sum(clipped), int(self.ranks.all_sum(counted))

    @staticmethod
    def _checked(compute: Callable[[], T], index: int) -> T:
        """``compute()``, with FP8's refusal of a non-finite tensor (forward or backward) reported as a
        non-finite gradient of mini-batch ``index``."""
        try:
            return compute()
        except quant.NonFiniteError as exc:
            raise NonFiniteGradient(f"mini-batch {index}: {exc}") from None

    def _snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        return params, copy.deepcopy(self.optimizer.state_dict())

    def _restore(self, snapshot: tuple[dict[str, torch.Tensor], dict[str, Any]]) -> None:
        params, optimizer = snapshot
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(params[n])
        self.optimizer.load_state_dict(optimizer)

    def _advantages(self, samples: Sequence[SampleData]) -> torch.Tensor:
        computed = grpo.group_advantages(
            [s.reward for s in samples], [s.group for s in samples], self.config.loss.advantage_norm
        )
        given = [s.advantage for s in samples]
        return torch.tensor([computed[i].item() if a is None else a for i, a in enumerate(given)])

    def _reference_logprobs(self, batch: PaddedBatch, sampling: SamplingSettings) -> torch.Tensor | None:
        if self.reference is None:
            return None
        with torch.no_grad():
            return self.logprobs(batch, sampling, self.reference)

    def state_dict(self, optimizer: bool | None = None) -> dict[str, Any]:
        """What a checkpoint holds of the learner: ``"model"``, this rank's shards of the float32
        weights, and ``"optimizer"``, of AdamW's state (torch.distributed.checkpoint's state dicts under
        HF names, which it saves and loads in place; a world of one holds them whole); ``"kv_cache"``,
        the FP8 attention scales [layers, 3] under a -kv recipe (alike on every rank); ``"step"``.
        ``optimizer``: whether AdamW's state is in it; by default once it has any (before the first step,
        asking for it would make it up with a step of lr 0, which advances AdamW's count)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {"model": get_model_state_dict(self.model), "step": self.step}
        if bool(self.optimizer.state) if optimizer is None else optimizer:
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        if self.kv_cache is not None:
            state["kv_cache"] = self.kv_cache.scales
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take ``state``, shaped as :meth:`state_dict`'s (sharded as this learner is). Without
        ``"optimizer"`` AdamW starts afresh; without ``"kv_cache"`` the scales stay as they are."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.model, state["model"])
        if "optimizer" in state:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        if self.kv_cache is not None and "kv_cache" in state:
            self.kv_cache.load(state["kv_cache"])
        self.step = int(state["step"])

    def published_weights(self) -> Mapping[str, torch.Tensor]:
        """What the rollout's weight set is built from: the master weights, then (under a -kv recipe) the
        FP8 attention scales of this version; read like :meth:`master_weights`."""
        weights = self.master_weights()
        return weights if self.kv_cache is None else Joined(weights, self.kv_cache.tensors())

    def master_weights(self) -> Mapping[str, torch.Tensor]:
        """float32 master weights under HF names (detached views; copy before mutating). Sharded, a view
        that gathers each whole as it is read, one at a time, on every rank: all ranks must read the same
        tensors in the same order (build_weight_set and the checkpoint read each once, in order)."""
        return Gathered(dict(self.model.named_parameters()))


class Gathered(Mapping[str, torch.Tensor]):
    """Sharded parameters under their names; reading one gathers it whole (a collective)."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params

    def __getitem__(self, name: str) -> torch.Tensor:
        return _whole(self.params[name].detach())

    def __contains__(self, name: object) -> bool:  # (Mapping's would gather the tensor to find out)
        return name in self.params

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)


class Joined(Mapping[str, torch.Tensor]):
    """Two mappings read as one, ``first``'s names first (each read from where it lives)."""

    def __init__(self, first: Mapping[str, torch.Tensor], then: Mapping[str, torch.Tensor]) -> None:
        self.first, self.then = first, then

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.then[name] if name in self.then else self.first[name]

    def __iter__(self) -> Iterator[str]:
        yield from self.first
        yield from self.then

    def __len__(self) -> int:
        return len(self.first) + len(self.then)


def shard(model: torch.nn.Module) -> None:
    """FSDP2: each transformer block and the root its own unit; gradients are summed over ranks, not
    averaged (each rank's loss is already divided by the global token count)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no pre-multiplied sum


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _item(t: torch.Tensor) -> float:
    return float(_whole(t).item())


def importance_sampling_config(default: ImportanceSampling, config: TrainerConfig) -> ImportanceSampling:
    """The recipe's importance sampling with the trainer config's explicit overrides applied."""
    return config.loss.importance_sampling(default)
