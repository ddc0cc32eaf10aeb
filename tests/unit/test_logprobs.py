"""Processed logprobs (temperature, top-k, top-p) against a direct reference written token by token."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl.logprobs import token_logprobs


def reference(logits: list[float], token: int, temperature: float, top_k: int, top_p: float) -> float:
    scaled = [x / temperature if temperature > 0 else x for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order[:top_k]) if top_k else set(order)
    kept = [i for i in order if i in keep]
    z = sum(math.exp(scaled[i]) for i in kept)
    if top_p < 1:
        chosen, mass = [], 0.0
        for i in kept:  # the most likely first, until the mass reaches top_p
            chosen.append(i)
            mass += math.exp(scaled[i]) / z
            if mass >= top_p:
                break
        kept = chosen
    if token not in kept:
        return -math.inf
    return scaled[token] - math.log(sum(math.exp(scaled[i]) for i in kept))


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.0, 0, 1.0), (1.0, 5, 1.0), (0.8, 0, 0.9), (1.3, 7, 0.6)],
)
def test_processed_logprobs_match_reference(
    gen: torch.Generator, temperature: float, top_k: int, top_p: float
) -> None:
    logits = torch.randn(6, 20, generator=gen, dtype=torch.float64) * 2
    tokens = logits.argsort(-1, descending=True)[:, 0]  # the most likely token is never masked
    tokens[::2] = torch.randint(0, 20, (3,), generator=gen)
    got = token_logprobs(logits, tokens, temperature, top_k, top_p)
    for row in range(6):
        want = reference(logits[row].tolist(), int(tokens[row]), temperature, top_k, top_p)
        if want == -math.inf:
            assert got[row] == -math.inf
        else:
            assert got[row].item() == pytest.approx(want, abs=1e-9)
