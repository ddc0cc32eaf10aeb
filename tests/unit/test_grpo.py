"""GRPO numerics on hand-computed cases: advantages, every IS mode, clipping, token aggregation, the
divergence metrics, and the gradient of the IS-corrected loss against finite differences."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl import grpo
from fp8rl.recipes import ImportanceSampling


def test_group_advantages() -> None:
    adv = grpo.group_advantages([1.0, 0.0, 1.0, 0.0, 5.0, 5.0], ["a", "a", "b", "b", "c", "c"])
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0, 0.0]), atol=1e-5)
    centred = grpo.group_advantages([3.0, 1.0, 2.0], ["g", "g", "g"], norm="none")
    assert torch.allclose(centred, torch.tensor([1.0, -1.0, 0.0]))
    std = math.sqrt(2 / 3)
    assert torch.allclose(
        grpo.group_advantages([3.0, 1.0, 2.0], ["g"] * 3), torch.tensor([1 / std, -1 / std, 0.0])
    )
    # mean: r / mean - 1; one success in four is worth 3, three in four 1/3; an all-zero group 0.
    by_mean = grpo.group_advantages([1, 0, 0, 0, 1, 1, 1, 0, 0, 0], ["a"] * 4 + ["b"] * 4 + ["c"] * 2, "mean")
    assert torch.allclose(by_mean, torch.tensor([3, -1, -1, -1, 1 / 3, 1 / 3, 1 / 3, -1, 0, 0]))
    with pytest.raises(ValueError, match="non-negative"):
        grpo.group_advantages([1.0, -1.0], ["a", "a"], "mean")


def test_mean_normalised_advantages_ascend_log_pass_rate() -> None:
    """Against float64 autograd on a softmax policy over outcomes: the expected 'mean' advantage
    gradient equals the gradient of log E[r]; GRPO's ('std') equals it times sqrt(p (1 - p))."""
    logits = torch.randn(5, dtype=torch.float64, requires_grad=True)
    reward = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    probs = torch.softmax(logits, 0)
    p = float((probs * reward).sum().detach())
    (grad_log_p,) = torch.autograd.grad(torch.log((probs * reward).sum()), logits)
    score = torch.eye(5, dtype=torch.float64) - probs.detach()  # row y: d log pi(y) / d logits
    expected = {}
    for norm, scale in (("mean", p), ("std", math.sqrt(p * (1 - p)))):
        # Population advantages of each outcome (infinite group): (r - p) / scale.
        expected[norm] = (probs.detach()[:, None] * ((reward - p) / scale)[:, None] * score).sum(0)
    assert torch.allclose(expected["mean"], grad_log_p)
    assert torch.allclose(expected["std"], grad_log_p * math.sqrt(p / (1 - p)))


def tokens(*rows: list[float]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float64)


# Two sequences: 3 and 2 valid tokens. log ratios prev - gen = [ln 3, 0, ln 0.25] and [ln 1.5, ln 0.5].
GEN = tokens([-1.0, -2.0, -0.5], [-1.0, -1.0])
PREV = GEN + tokens([math.log(3), 0.0, math.log(0.25)], [math.log(1.5), math.log(0.5)])
MASK = tokens([1, 1, 1], [1, 1])


@pytest.mark.parametrize(
    ("config", "weights", "altered", "fraction"),
    [
        (ImportanceSampling(mode="none"), [[1, 1, 1], [1, 1, 0]], 0, 0),
        (ImportanceSampling(mode="tis", cap=2.0), [[2, 1, 0.25], [1.5, 0.5, 0]], 1 / 5, 1 / 5),
        (ImportanceSampling(mode="icepop", low=0.45, high=2.0), [[0, 1, 0], [1.5, 0.5, 0]], 2 / 5, 2 / 5),
        # geometric means: (3 * 1 * 0.25)^(1/3) = 0.909 (kept), (1.5 * 0.5)^(1/2) = 0.866 (dropped with
        # [0.9, 2]). Kept sequences keep their raw weights (3 stays 3: no cap); the fraction counts
        # sequences (1 of 2), as NeMo RL's does.
        (
            ImportanceSampling(mode="seq-mask-tis", cap=2.0, low=0.9, high=2.0),
            [[3, 1, 0.25], [0, 0, 0]],
            2 / 5,
            1 / 2,
        ),
    ],
)
def test_importance_weights(
    config: ImportanceSampling, weights: list[list[float]], altered: float, fraction: float
) -> None:
    mask = tokens([1, 1, 1], [1, 1, 0])
    gen, prev = GEN.clone(), PREV.clone()
    gen[1, 2] = prev[1, 2] = 0.0
    w = grpo.importance_weights(prev, gen, mask, config)
    assert torch.allclose(w.weights, torch.tensor(weights, dtype=torch.float64))
    assert w.altered[mask > 0].double().mean().item() == pytest.approx(altered)
    assert w.altered_fraction == pytest.approx(fraction)
    assert grpo.divergence_metrics(prev, gen, mask, w)["is_clipped_fraction"] == pytest.approx(fraction)


def test_divergence_metrics_exact_when_engines_agree() -> None:
    same = grpo.importance_weights(GEN, GEN, MASK, ImportanceSampling(mode="tis"))
    m = grpo.divergence_metrics(GEN, GEN, MASK, same)
    assert (
        m["token_mult_prob_error"] == 1.0 and m["gen_kl_error"] == 0.0 and m["max_seq_mult_prob_error"] == 1.0
    )
    assert m["is_weight_mean"] == m["is_weight_min"] == m["is_weight_max"] == 1.0
    assert m["is_clipped_fraction"] == 0.0


def test_divergence_metrics_hand_computed() -> None:
    w = grpo.importance_weights(PREV, GEN, MASK, ImportanceSampling(mode="tis", cap=2.0))
    m = grpo.divergence_metrics(PREV, GEN, MASK, w)
    ratios = [3.0, 1.0, 0.25, 1.5, 0.5]
    mult = [max(r, 1 / r) for r in ratios]  # exp(|log r|)
    assert m["token_mult_prob_error"] == pytest.approx(sum(mult) / 5)
    assert m["gen_kl_error"] == pytest.approx(sum(r - math.log(r) - 1 for r in ratios) / 5)
    assert m["max_seq_mult_prob_error"] == pytest.approx(max(sum(mult[:3]) / 3, sum(mult[3:]) / 2))
    assert (m["is_weight_min"], m["is_weight_max"]) == (pytest.approx(0.25), pytest.approx(3.0))
    assert m["is_weight_mean"] == pytest.approx(sum(ratios) / 5)
    assert m["is_clipped_fraction"] == pytest.approx(1 / 5)


def test_ppo_loss_clipping_and_token_level_aggregation() -> None:
    # One sequence of 4 tokens, advantage +1: ratios 1.5 (clipped to 1.2), 0.5 (min picks 0.5), 1, 1.1.
    prev = torch.zeros(1, 4, dtype=torch.float64)
    cur = torch.log(torch.tensor([[1.5, 0.5, 1.0, 1.1]], dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)  # last token is padding
    w = torch.tensor([[1.0, 2.0, 1.0, 1.0]], dtype=torch.float64)
    out = grpo.ppo_loss(cur, prev, torch.tensor([1.0]), mask, w, clip_eps=0.2, normalizer=3)
    assert out.loss.item() == pytest.approx(-(1.2 * 1 + 0.5 * 2 + 1.0 * 1) / 3)
    assert out.clipped_fraction.item() == pytest.approx(1 / 3)
    # Negative advantage: ratio 0.5 is clipped to 0.8 (the pessimistic side), 1.5 is not.
    neg = grpo.ppo_loss(cur, prev, torch.tensor([-1.0]), mask, w, clip_eps=0.2, normalizer=3)
    assert neg.loss.item() == pytest.approx((1.5 * 1 + 0.8 * 2 + 1.0 * 1) / 3)
    # Token-level: two sequences of different lengths weigh by tokens, not by sequences.
    cur2 = torch.zeros(2, 3, dtype=torch.float64)
    mask2 = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    agg = grpo.ppo_loss(
        cur2, cur2, torch.tensor([1.0, -1.0]), mask2, torch.ones(2, 3, dtype=torch.float64), 0.2, 4
    )
    assert agg.loss.item() == pytest.approx(-(3 * 1 - 1) / 4)


def test_is_corrected_loss_gradient_matches_finite_differences(gen: torch.Generator) -> None:
    b, t = 3, 5
    gen_lp = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    prev = gen_lp + 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=gen) > 0.2).double()
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    ref = prev + 0.1 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    cur = (prev + 0.05 * torch.randn(b, t, generator=gen, dtype=torch.float64)).requires_grad_()
    for mode in ("tis", "icepop", "seq-mask-tis", "none"):
        w = grpo.importance_weights(prev, gen_lp, mask, ImportanceSampling(mode=mode))

        def loss(c: torch.Tensor, w: grpo.ISWeights = w) -> torch.Tensor:
            return grpo.ppo_loss(c, prev, adv, mask, w.weights, 0.2, mask.sum().item(), ref, 0.05).loss

        assert torch.autograd.gradcheck(loss, (cur,), eps=1e-6, atol=1e-6), mode


def _top_k_case(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Fresh logits [B, T, V]; prompt positions (mask 0) hold tokens outside the top-k set, completion
    positions the most likely token except one, which the rollout sampled outside the trainer's top-k."""
    from fp8rl.logprobs import token_logprobs

    logits = torch.randn(3, 7, 40, generator=gen, dtype=torch.float64)
    ranked = logits.argsort(-1, descending=True)
    targets = ranked[..., -1].clone()  # the least likely token: outside top-k
    mask = torch.zeros(3, 7, dtype=torch.float64)
    mask[:, 3:] = 1
    targets[:, 3:] = ranked[:, 3:, 0]
    targets[1, 5] = ranked[1, 5, 10]  # valid, but rank 10 under the trainer: outside its top-5
    prev = token_logprobs(logits, targets, 1.0, top_k=5)
    noise = 0.05 * torch.randn(3, 7, generator=gen, dtype=torch.float64)
    gen_lp = torch.where(mask > 0, torch.nan_to_num(prev, neginf=-3.0) + noise, 0.0)
    return logits, targets, mask, prev, gen_lp


def test_top_k_logprobs_outside_the_mask_or_the_support_never_make_nan(gen: torch.Generator) -> None:
    """-inf logprobs at prompt/padding positions and at a valid token outside the trainer's top-k set
    (the engines disagree at its boundary): the support leaves the latter out, every metric, the loss
    and its gradient stay finite, and nothing depends on what the excluded positions hold."""
    from fp8rl.logprobs import token_logprobs

    logits, targets, mask, prev, gen_lp = _top_k_case(gen)
    assert torch.isinf(prev[:, :3]).all() and torch.isinf(prev[1, 5])
    support = grpo.sampling_support(prev, mask)
    assert support.sum() == mask.sum() - 1 and support[1, 5] == 0
    config = ImportanceSampling(mode="tis", cap=2.0)

    def step(prev: torch.Tensor) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        weights = grpo.importance_weights(prev, gen_lp, support, config)
        metrics = grpo.divergence_metrics(prev, gen_lp, support, weights)
        leaf = logits.clone().requires_grad_()
        cur = token_logprobs(leaf, targets, 1.0, top_k=5)
        ref = token_logprobs(logits + 0.1, targets, 1.0, top_k=5)
        adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
        terms = grpo.ppo_loss(cur, prev, adv, support, weights.weights, 0.2, support.sum().item(), ref, 0.1)
        terms.loss.backward()
        assert leaf.grad is not None
        return metrics, terms.loss.detach(), leaf.grad

    metrics, loss, grad = step(prev)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad.abs().sum() > 0
    junk = torch.where(support > 0, prev, torch.full_like(prev, 123.0))  # anything outside the support
    metrics_junk, loss_junk, grad_junk = step(junk)
    assert metrics_junk == metrics and torch.equal(loss_junk, loss) and torch.equal(grad_junk, grad)


def test_a_token_the_current_policy_no_longer_samples_keeps_the_kl_loss_finite(gen: torch.Generator) -> None:
    """After an earlier mini-batch's optimizer step, a covered token can fall outside the current
    policy's top-k (cur = -inf): with a KL penalty, ref - cur was +inf and the loss NaN."""
    from fp8rl.logprobs import token_logprobs

    logits, targets, mask, prev, gen_lp = _top_k_case(gen)
    support = grpo.sampling_support(prev, mask)
    moved = logits.clone()
    moved[0, 4, targets[0, 4]] -= 100.0  # the policy moved: token (0, 4) leaves its top-5
    leaf = moved.requires_grad_()
    cur = token_logprobs(leaf, targets, 1.0, top_k=5)
    assert torch.isinf(cur[0, 4]) and support[0, 4] == 1
    ref = token_logprobs(logits, targets, 1.0, top_k=5)
    weights = grpo.importance_weights(prev, gen_lp, support, ImportanceSampling(mode="tis", cap=2.0))
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    terms = grpo.ppo_loss(cur, prev, adv, support, weights.weights, 0.2, support.sum().item(), ref, 0.1)
    terms.loss.backward()
    assert leaf.grad is not None
    assert torch.isfinite(terms.loss) and torch.isfinite(leaf.grad).all()


def test_masked_mean_ignores_excluded_values() -> None:
    x = torch.tensor([[1.0, float("-inf"), float("nan")], [3.0, 5.0, float("inf")]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    assert grpo.masked_mean(x, mask).item() == 3.0


def test_metrics_of_a_batch_with_no_covered_token_are_nan_not_a_crash() -> None:
    nothing = torch.zeros_like(MASK)
    weights = grpo.importance_weights(PREV, GEN, nothing, ImportanceSampling(mode="tis"))
    metrics = grpo.divergence_metrics(PREV, GEN, nothing, weights)
    covered = grpo.divergence_metrics(
        PREV, GEN, MASK, grpo.importance_weights(PREV, GEN, MASK, ImportanceSampling(mode="tis"))
    )
    assert metrics.keys() == covered.keys() and all(math.isnan(v) for v in metrics.values())


def test_token_histograms_count_the_covered_tokens_per_fixed_bucket() -> None:
    import numpy as np

    from fp8rl.grpo import HISTOGRAMS, histogram_counts, token_histograms

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))  # fresh inputs each run
    prev, gen = -torch.rand(4, 50, generator=g) * 5, -torch.rand(4, 50, generator=g) * 5
    mask = (torch.rand(4, 50, generator=g) > 0.3).float()
    counts = token_histograms(prev, gen, mask)
    d = (prev - gen)[mask > 0].double().numpy()
    for name, values in (("abs_log_ratio", np.abs(d)), ("is_weight", np.exp(d))):
        edges = np.array(HISTOGRAMS[name])
        clipped = np.clip(values, edges[0], np.nextafter(edges[-1], 0))  # the end buckets take the rest
        expected = np.histogram(clipped, bins=edges)[0].tolist()
        assert counts[f"{name}_counts"] == expected and sum(expected) == int(mask.sum())
    assert histogram_counts(torch.tensor([0.0, 0.5, 1.0, 7.0]), [0.0, 1.0, 2.0]) == [2, 2]
