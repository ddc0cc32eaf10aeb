"""GRPO as small pure functions: group advantages, importance-sampling correction of the rollout /
trainer mismatch, divergence metrics, and the PPO-clipped token-level loss.

Shapes: per-token tensors are [B, T] with a float ``mask`` (1 for completion tokens, 0 for padding);
``gen`` are the rollout's logprobs, ``prev`` the trainer's logprobs of the same tokens under the same
weights (no grad), ``cur`` the trainer's logprobs under the weights being optimized.

Outside the mask, logprobs may be -inf (with top-k / top-p, a prompt or padding token can lie outside
the sampling set), so masking is always by selection (``torch.where``), never by multiplication:
-inf * 0 is NaN, and so is the gradient of an unselected NaN branch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fp8rl.recipes import AdvantageNorm, ImportanceSampling


def group_advantages(
    rewards: Sequence[float], groups: Sequence[str], norm: AdvantageNorm = "std", eps: float = 1e-6
) -> torch.Tensor:
    """Reward minus its group's mean, then divided by

    * ``std``: the group's (population) std — GRPO;
    * ``mean``: the group's mean, i.e. ``r / mean - 1``: the policy gradient of log E[r] per prompt
      (for 0/1 rewards, of the log of the prompt's pass rate), which weights a prompt by 1/p where
      GRPO's expected gradient weights it by sqrt(p / (1 - p)) — so prompts the policy rarely solves
      are not drowned by the ones it already solves. Rewards must be non-negative;
    * ``none``: nothing (Dr. GRPO).

    A group whose rewards are all equal gets advantage 0: it carries no learning signal.
    """
    r = torch.tensor(rewards, dtype=torch.float64)
    if norm == "mean" and bool((r < 0).any()):
        raise ValueError("advantage normalisation 'mean' needs non-negative rewards")
    out = torch.zeros_like(r)
    for group in dict.fromkeys(groups):
        idx = torch.tensor([i for i, g in enumerate(groups) if g == group])
        mean = r[idx].mean()
        centred = r[idx] - mean
        if norm == "std":
            out[idx] = centred / (r[idx].std(unbiased=False) + eps)
        elif norm == "mean":
            out[idx] = centred / mean if mean > eps else torch.zeros_like(centred)
        else:
            out[idx] = centred
    return out.float()


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where ``mask`` is set, 0 elsewhere (whatever ``x`` holds there, inf and NaN included)."""
    return torch.where(mask > 0, x, torch.zeros_like(x))


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked(x, mask).sum() / (mask > 0).sum().clamp(min=1)


def sampling_support(prev: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mask of valid tokens that the trainer's own sampling set contains (float, like ``mask``).

    With top-k / top-p the two engines can disagree at the boundary of the set: a token the rollout
    sampled may have probability 0 (logprob -inf) under the trainer's processed distribution. Such a
    token carries no gradient for the policy the trainer computes and an infinite mismatch; it is left
    out of the loss and of the divergence metrics, and counted (``out_of_support_fraction``).
    """
    return ((mask > 0) & torch.isfinite(prev)).to(mask.dtype)


@dataclass(frozen=True)
class ISWeights:
    weights: torch.Tensor  # [B, T], detached; 0 where masked
    altered: torch.Tensor  # [B, T] bool: clipped or masked
    raw: torch.Tensor  # [B, T] exp(prev - gen)
    altered_fraction: float  # of valid tokens (tis, icepop), of sequences with any (seq-mask-tis)


def importance_weights(
    prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor, config: ImportanceSampling
) -> ISWeights:
    """w = exp(prev - gen), corrected by ``config.mode``:

    * ``tis``: clamp to [0, cap];
    * ``icepop``: zero tokens with w outside [low, high];
    * ``seq-mask-tis`` (as in NeMo RL and OpenRLHF): drop whole sequences whose geometric-mean w (exp of
      the mean log ratio) lies outside [low, high]; the kept tokens keep their raw, untruncated w
      (``cap`` plays no part). Its ``altered_fraction`` counts sequences, not tokens;
    * ``none``: 1.
    """
    log_ratio = masked((prev - gen).detach(), mask)
    raw = torch.exp(log_ratio)
    valid = mask > 0

    def token_share(altered: torch.Tensor) -> float:
        return (altered & valid).sum().item() / max(valid.sum().item(), 1)

    if config.mode == "none":
        return ISWeights(masked(torch.ones_like(raw), mask), torch.zeros_like(valid), raw, 0.0)
    if config.mode == "tis":
        clipped = valid & (raw > config.cap)
        return ISWeights(masked(raw.clamp(max=config.cap), mask), clipped, raw, token_share(clipped))
    if config.mode == "icepop":
        outside = valid & ((raw < config.low) | (raw > config.high))
        return ISWeights(masked(torch.where(outside, 0.0, raw), mask), outside, raw, token_share(outside))
    if config.mode == "seq-mask-tis":
        has_tokens = valid.any(-1)
        geometric = torch.exp(log_ratio.sum(-1) / valid.sum(-1).clamp(min=1))
        dropped_sequences = has_tokens & ((geometric < config.low) | (geometric > config.high))
        dropped = valid & dropped_sequences[:, None]
        share = dropped_sequences.sum().item() / max(has_tokens.sum().item(), 1)
        return ISWeights(masked(torch.where(dropped, 0.0, raw), mask), dropped, raw, share)
    raise ValueError(f"unknown importance sampling mode {config.mode!r}")


def divergence_metrics(
    prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor, weights: ISWeights
) -> dict[str, float]:
    """Mismatch between trainer and rollout over valid tokens (1.0 / 0.0 when they agree exactly); NaN
    for each when no token is covered (e.g. every sampled token outside the trainer's top-k)."""
    m = mask.double()
    d = masked((prev - gen).double(), m)
    mult_error = torch.exp(d.abs())
    per_sequence = masked(mult_error, m).sum(-1) / m.sum(-1).clamp(min=1)
    valid = mask > 0
    raw = weights.raw[valid].double()
    figures: dict[str, Callable[[], float]] = {
        "token_mult_prob_error": lambda: masked_mean(mult_error, m).item(),
        "gen_kl_error": lambda: masked_mean(torch.exp(d) - d - 1, m).item(),
        "max_seq_mult_prob_error": lambda: per_sequence[m.sum(-1) > 0].max().item(),
        "is_weight_mean": lambda: raw.mean().item(),
        "is_weight_min": lambda: raw.min().item(),
        "is_weight_max": lambda: raw.max().item(),
        "is_clipped_fraction": lambda: weights.altered_fraction,
    }
    covered = bool(valid.any())
    return {name: figure() if covered else math.nan for name, figure in figures.items()}


# Bucket edges of the per-token histograms a TrainStep reports (TrainMetrics *_counts): bucket i holds
# values in [edges[i], edges[i + 1]); the last bucket also takes everything above. Fixed, so counts from
# every step and every trainer line up.
HISTOGRAMS = {
    "abs_log_ratio": [0.0, *(10 ** (-7 + i / 4) for i in range(33))],  # |prev - gen|, 1e-7 ... 10
    "is_weight": [i / 20 for i in range(61)],  # exp(prev - gen), 0 ... 3
}


def histogram_counts(values: torch.Tensor, edges: list[float]) -> list[int]:
    """Counts of ``values`` (1-D) per bucket of ``edges`` (values above the last edge go to the last
    bucket; below the first, to the first)."""
    bounds = torch.tensor(edges[1:-1], dtype=torch.float64)
    index = torch.bucketize(values.double().contiguous(), bounds, right=True)
    return torch.bincount(index, minlength=len(edges) - 1).tolist()


def token_histograms(prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor) -> dict[str, list[int]]:
    """The per-token histograms of a step, over the tokens ``mask`` covers."""
    valid = mask > 0
    d = (prev - gen)[valid].double()
    return {
        "abs_log_ratio_counts": histogram_counts(d.abs(), HISTOGRAMS["abs_log_ratio"]),
        "is_weight_counts": histogram_counts(torch.exp(d), HISTOGRAMS["is_weight"]),
    }


@dataclass(frozen=True)
class LossTerms:
    loss: torch.Tensor  # scalar: sum over tokens of per-token loss / normalizer
    clipped_fraction: torch.Tensor  # fraction of valid tokens where the PPO clip was active


def ppo_loss(
    cur: torch.Tensor,
    prev: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor,
    clip_eps: float,
    normalizer: float,
    ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> LossTerms:
    """Token-level PPO-clipped surrogate with importance-sampling weights.

    per token: ``-w * min(r * A, clip(r, 1 - eps, 1 + eps) * A)`` with ``r = exp(cur - prev)``, plus
    ``kl_coef * k3(cur, ref)`` when a reference is given; summed over valid tokens and divided by
    ``normalizer`` (the number of valid tokens in the whole mini-batch, so micro-batches add up to the
    token mean). ``advantages`` is [B] (one per sequence) or [B, T].
    """
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    # Select before any arithmetic: an unselected -inf would turn into a NaN gradient.
    cur, prev = masked(cur, mask), masked(prev.detach(), mask)
    ratio = torch.exp(cur - prev)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped) * is_weights.detach()
    if ref is not None and kl_coef > 0:
        # A token outside the reference's or the current policy's sampling set (-inf: after an optimizer
        # step of an earlier mini-batch the current set can move) has no finite KL: left out.
        finite = torch.isfinite(ref) & torch.isfinite(cur.detach())
        kl_mask = masked(finite.to(mask.dtype), mask)
        d = masked(ref.detach(), kl_mask) - masked(cur, kl_mask)
        per_token = per_token + kl_coef * masked(torch.exp(d) - d - 1, kl_mask)
    loss = masked(per_token, mask).sum() / normalizer
    clip_active = ((unclipped > clipped) & (mask > 0)).float().sum() / max(mask.sum().item(), 1)
    return LossTerms(loss, clip_active)
