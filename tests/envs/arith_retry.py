"""A multi-turn environment for the tiny model (`--env tests.envs.arith_retry:ArithRetry`): its own
"a+b=" sums over the completions API; a wrong answer is followed by the sum asked again in the same text,
so each episode's second turn extends the first (the replica continues the sampled ids)."""

from __future__ import annotations

from coordinator.environments import Policy
from coordinator.problems import Problem
from coordinator.tasks import ArithTask, first_line


class ArithRetry:
    def __init__(self, seed: int) -> None:
        self.task = ArithTask(seed, val_size=8)
        self.played = 0

    def train_problems(self, step: int, count: int) -> list[Problem]:
        return self.task.train_problems(step, count)

    def val_problems(self) -> list[Problem]:
        return self.task.val_problems()

    def play(self, problem: Problem, policy: Policy) -> float:
        text = problem.prompt
        for turn in range(2):
            answer = policy.client.completions.create(model=policy.model, prompt=text, **policy.sampling)
            reply = answer.choices[0].text
            if first_line(reply) == problem.answer:
                return 1.0 / (turn + 1)
            text += first_line(reply) + "\n" + problem.prompt
        return 0.0

    def close(self) -> None:
        pass
