"""Logprobs of sampled tokens under the distribution they were sampled from — the quantity the rollout
reports and the trainer must reproduce. Pure torch.

Processing order (vLLM's): divide logits by the temperature (0 means greedy: left unscaled), keep the
top-k logits, keep the smallest set of tokens whose probability reaches top-p (always at least one),
renormalise with log-softmax.
"""

from __future__ import annotations

import torch


def process_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """``logits`` [..., V] -> processed logits (masked entries are -inf), in float32 or wider."""
    logits = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    if temperature > 0:
        logits = logits / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = logits.sort(dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1] = False  # the most likely token always stays
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Logprob of each ``tokens[..., t]`` under processed ``logits[..., t, :]``; shape of ``tokens``."""
    logprobs = torch.log_softmax(process_logits(logits, temperature, top_k, top_p), dim=-1)
    return logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
