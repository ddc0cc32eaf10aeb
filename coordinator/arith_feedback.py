"""``--env arith-feedback``: sums asked as a chat, with a second try after feedback. A multi-turn task
where the turns matter: the feedback says whether the sum is larger or smaller than the first answer.

The problems are ``arith-chat``'s (operands 0..19; coordinator/tasks.py). An answer scores when the last
number of its first line is the sum. Reward: 1 for a right first answer, 0.5 for a right second one
(after the feedback), else 0.
"""

from __future__ import annotations

import re

from coordinator.environments import Policy
from coordinator.problems import Problem
from coordinator.tasks import ArithChatTask

SECOND_TRY = 0.5


def number_of(reply: str) -> int | None:
    numbers = re.findall(r"-?\d+", reply.split("\n", 1)[0].replace(",", ""))
    return int(numbers[-1]) if numbers else None


def feedback(problem: Problem, reply: str) -> str:
    """What the user says to a wrong answer: larger or smaller, and the question again."""
    guess, total = number_of(reply), int(problem.answer)
    if guess is None:
        hint = "Please answer with a number."
    else:
        question = problem.prompt.removeprefix("What is ").rstrip("?")
        hint = f"No, {question} is {'more' if total > guess else 'less'} than {guess}."
    return f"{hint} {problem.prompt}"


class ArithFeedback:
    def __init__(self, seed: int, val_size: int = 45) -> None:
        self.task = ArithChatTask(seed, val_size)

    def train_problems(self, step: int, count: int) -> list[Problem]:
        return self.task.train_problems(step, count)

    def val_problems(self) -> list[Problem]:
        return self.task.val_problems()

    def play(self, problem: Problem, policy: Policy) -> float:
        messages = [{"role": "user", "content": problem.prompt}]
        first = policy.chat(messages)
        if number_of(first) == int(problem.answer):
            return 1.0
        messages += [
            {"role": "assistant", "content": first},
            {"role": "user", "content": feedback(problem, first)},
        ]
        return SECOND_TRY if number_of(policy.chat(messages)) == int(problem.answer) else 0.0

    def close(self) -> None:
        pass
