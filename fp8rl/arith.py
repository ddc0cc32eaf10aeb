"""The arith task's data: "37+48=" -> "85", operands 0..99. A fixed tenth of all pairs (chosen by hash, so
the split carries no pattern a model could exploit) is held out: validation draws from it, the warm start
and RL training never see it."""

from __future__ import annotations

import hashlib
import random

MAX_OPERAND = 99


def held_out(a: int, b: int) -> bool:
    return hashlib.blake2b(f"{a}+{b}".encode(), digest_size=2).digest()[0] % 10 == 0


def prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer(a: int, b: int) -> str:
    return str(a + b)


def hedged_answer(a: int, b: int, rng: random.Random) -> str:
    """The warm start's last teacher: the right sum, often hedged with a trailing "?" (on 70% of sums of
    100 or more, 30% of the rest), which the verifier rejects. A base model that imitates it knows more
    sums than its greedy answers show: the format flaw RL is quick to fix, as it is in real models."""
    hedge = rng.random() < (0.7 if a + b >= 100 else 0.3)
    return answer(a, b) + ("?" if hedge else "")


def train_pairs(rng: random.Random, count: int, max_operand: int = MAX_OPERAND) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    while len(out) < count:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if not held_out(a, b):
            out.append((a, b))
    return out


def val_pairs(seed: int, count: int, max_operand: int = MAX_OPERAND) -> list[tuple[int, int]]:
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1) if held_out(a, b)]
    random.Random(f"arith-val:{seed}").shuffle(pairs)
    return pairs[:count]
