"""Tasks: deterministic prompts per step, held-out validation prompts, and rewards. Pure Python.

* ``arith``: "37+48=" -> "85" (operands 0..99), the tiny model's task.
* ``jsonl``: a file of {"prompt": ..., "answer": ...} lines; scored by ``math-verify`` when installed,
  else by exact match after normalisation. A prompt is text, or a conversation (a list of
  {"role": ..., "content": ...}) that the replica renders with the model's chat template.
* ``--reward module:function``: ``function(prompt, completion, answer) -> float`` replaces the reward.
"""

from __future__ import annotations

import importlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from fp8rl import arith

RewardFn = Callable[[str, str, str], float]


Messages = tuple[tuple[str, str], ...]  # (role, content) per turn


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str  # the text sent, or a conversation's last message (what a reward function sees)
    answer: str
    messages: Messages | None = None  # a chat-format prompt, sent instead of ``prompt``


def parse_prompt(value: object, where: str) -> tuple[str, Messages | None]:
    """A dataset row's prompt: text, or a list of {"role", "content"} messages (chat format)."""
    if isinstance(value, str):
        return value, None
    if (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    ):
        messages = tuple((m["role"], m["content"]) for m in value)
        return messages[-1][1], messages
    raise ValueError(f"{where}: 'prompt' must be text or a non-empty list of {{role, content}} messages")


class Task(Protocol):
    def train_problems(self, step: int, count: int) -> list[Problem]: ...
    def val_problems(self) -> list[Problem]: ...
    def reward(self, problem: Problem, completion: str) -> float: ...


def first_line(text: str) -> str:
    return text.split("\n", 1)[0].strip()


class ArithTask:
    """Two-operand addition; validation pairs come from the held-out tenth (fp8rl.arith)."""

    def __init__(self, seed: int, val_size: int = 64) -> None:
        self.seed = seed
        self._val = [
            self._problem(f"val-{i}", a, b) for i, (a, b) in enumerate(arith.val_pairs(seed, val_size))
        ]

    @staticmethod
    def _problem(pid: str, a: int, b: int) -> Problem:
        return Problem(pid, arith.prompt(a, b), arith.answer(a, b))

    def train_problems(self, step: int, count: int) -> list[Problem]:
        rng = random.Random(f"arith:{self.seed}:train:{step}")
        return [self._problem(f"s{step}-{i}", a, b) for i, (a, b) in enumerate(arith.train_pairs(rng, count))]

    def val_problems(self) -> list[Problem]:
        return self._val

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if first_line(completion) == problem.answer else 0.0


def normalize_answer(text: str) -> str:
    text = first_line(text).lower().strip().rstrip(".")
    return re.sub(r"[\s,$]", "", text)


class JsonlTask:
    """The first ``val_size`` rows are held out for validation; training samples the rest per step."""

    def __init__(self, path: Path, seed: int, val_size: int = 64) -> None:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        problems = []
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
                raise ValueError(f"{path}:{i + 1}: each line needs 'prompt' and 'answer'")
            text, messages = parse_prompt(row["prompt"], f"{path}:{i + 1}")
            problems.append(Problem(f"row-{i}", text, str(row["answer"]), messages))
        if len(problems) <= val_size:
            raise ValueError(
                f"{path}: {len(problems)} rows leave nothing to train on after {val_size} for validation"
            )
        self._val, self._train, self.seed = problems[:val_size], problems[val_size:], seed
        self._verify = _math_verify()

    def train_problems(self, step: int, count: int) -> list[Problem]:
        rng = random.Random(f"jsonl:{self.seed}:train:{step}")
        return [rng.choice(self._train) for _ in range(count)]

    def val_problems(self) -> list[Problem]:
        return self._val

    def reward(self, problem: Problem, completion: str) -> float:
        if self._verify is not None:
            return self._verify(problem.answer, completion)
        return 1.0 if normalize_answer(completion) == normalize_answer(problem.answer) else 0.0


def _math_verify() -> Callable[[str, str], float] | None:
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    return lambda answer, completion: float(verify(parse(answer), parse(completion)))


class CustomReward:
    """Wraps a task, replacing its reward with ``module:function(prompt, completion, answer)``."""

    def __init__(self, task: Task, spec: str) -> None:
        self.task, self.fn = task, load_reward(spec)

    def train_problems(self, step: int, count: int) -> list[Problem]:
        return self.task.train_problems(step, count)

    def val_problems(self) -> list[Problem]:
        return self.task.val_problems()

    def reward(self, problem: Problem, completion: str) -> float:
        return float(self.fn(problem.prompt, completion, problem.answer))


def load_reward(spec: str) -> RewardFn:
    module, sep, name = spec.partition(":")
    if not sep:
        raise ValueError(f"reward {spec!r} is not of the form module:function")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {module} has no function {name}")
    return fn


def build_task(
    name: str, seed: int, dataset: Path | None = None, reward: str | None = None, val_size: int = 64
) -> Task:
    task: Task = ArithTask(seed, val_size) if name == "arith" else JsonlTask(dataset, seed, val_size)  # type: ignore[arg-type]
    return CustomReward(task, reward) if reward else task
