"""Tasks: deterministic prompts per step, held-out validation prompts, and rewards. Pure Python.

* ``arith``: "37+48=" -> "85" (operands 0..99), the tiny model's task; ``arith-chat``: the same sums as
  a chat question, for instruct models (SmolLM2-135M-Instruct).
* ``dataset`` (alias ``jsonl``): records from JSON lines, parquet or an HF datasets directory
  (coordinator/datasets.py), with the prompt and answer under configurable keys; scored by
  ``math-verify`` when installed (in worker processes, bounded in time and memory:
  coordinator/math_reward.py),
  else by exact match after normalisation of the completion's final answer (after GSM8K's ``####`` if
  it has one, else its first line). A prompt is text, or a conversation (a list of {"role": ...,
  "content": ...}) that the replica renders with the model's chat template. Each epoch visits the
  training rows in a seeded order, without replacement.
* ``--reward module:function``: ``function(prompt, completion, answer) -> float`` replaces the reward,
  called in worker processes (coordinator/user_code.py): one that hangs, crashes, leaks or raises scores
  that completion 0.
* ``--env module:factory``: a multi-turn environment's problems, played as episodes
  (coordinator/environments.py).
"""

from __future__ import annotations

import importlib.util
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from coordinator.problems import Problem
from coordinator.user_code import RewardFn, WorkerPool, load_plugin
from fp8rl import arith
from fp8rl.config import ConfigError

if TYPE_CHECKING:
    from coordinator.config import CoordinatorConfig, TaskConfig
    from coordinator.environments import Environment


class Task(Protocol):
    def train_problems(self, step: int, count: int) -> list[Problem]: ...
    def val_problems(self) -> list[Problem]: ...
    def reward(self, problem: Problem, completion: str) -> float: ...
    def close(self) -> None: ...


def first_line(text: str) -> str:
    return text.split("\n", 1)[0].strip()


class ArithTask:
    """Two-operand addition, operands 0..``max_operand``; validation pairs come from the held-out tenth
    (fp8rl.arith)."""

    MAX_OPERAND = arith.MAX_OPERAND
    TRAIN_STREAM = "arith"

    def __init__(self, seed: int, val_size: int = 64, max_operand: int | None = None) -> None:
        self.seed = seed
        self.max_operand = max_operand or self.MAX_OPERAND
        pairs = arith.val_pairs(seed, val_size, self.max_operand)
        self._val = [self._problem(f"val-{i}", a, b) for i, (a, b) in enumerate(pairs)]

    @staticmethod
    def _problem(pid: str, a: int, b: int) -> Problem:
        return Problem(pid, arith.prompt(a, b), arith.answer(a, b))

    def train_problems(self, step: int, count: int) -> list[Problem]:
        rng = random.Random(f"{self.TRAIN_STREAM}:{self.seed}:train:{step}")
        pairs = arith.train_pairs(rng, count, self.max_operand)
        return [self._problem(f"s{step}-{i}", a, b) for i, (a, b) in enumerate(pairs)]

    def val_problems(self) -> list[Problem]:
        return self._val

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if first_line(completion) == problem.answer else 0.0

    def close(self) -> None:
        pass


class ArithChatTask(ArithTask):
    """Sums of operands 0..19 asked as a chat ("What is 7 + 12?"), for instruct models: the model's chat
    template renders the question, and a completion scores when the last number on its first line is the
    sum ("7 + 12 = 19" and "19" both do). SmolLM2-135M-Instruct answers about 0.3 of them right greedily
    and 0.1 when sampling at temperature 1 at first; the 45 held-out pairs validate."""

    MAX_OPERAND = 19
    TRAIN_STREAM = "arith-chat"

    @staticmethod
    def _problem(pid: str, a: int, b: int) -> Problem:
        question = f"What is {a} + {b}?"
        return Problem(pid, question, arith.answer(a, b), messages=(("user", question),))

    def reward(self, problem: Problem, completion: str) -> float:
        numbers = re.findall(r"-?\d+", first_line(completion).replace(",", ""))
        return 1.0 if numbers and numbers[-1] == problem.answer else 0.0


def normalize_answer(text: str) -> str:
    text = text.lower().strip().rstrip(".")
    return re.sub(r"[\s,$]", "", text)


def completion_answer(completion: str) -> str:
    """The answer a completion gives: what follows its last ``####`` (GSM8K's style), else its first line."""
    return completion.rsplit("####", 1)[1].strip() if "####" in completion else first_line(completion)


class DatasetTask:
    """Problems from a dataset; validation by count (the first ``val_size`` rows), fraction or file.

    Training visits the rows without replacement: epoch e is a permutation of them seeded by (seed, e),
    and step k takes the next ``count`` rows of the sequence of epochs (rows k*count onwards), so a
    resumed run draws the same prompts. A row that comes again within one step (the step spans an epoch
    boundary, or ``count`` exceeds the rows) gets a distinct id: ``row-17#2``."""

    def __init__(
        self, train: list[Problem], val: list[Problem], seed: int, verify: WorkerPool | None = None
    ) -> None:
        self._train, self._val, self.seed = train, val, seed
        self._orders: dict[int, list[int]] = {}  # epoch -> permutation, the last two kept
        self._verify = verify  # math-verify's workers, else exact match

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self._train)))
            random.Random(f"jsonl:{self.seed}:epoch:{epoch}").shuffle(order)
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1} | {epoch: order}
        return self._orders[epoch]

    def train_problems(self, step: int, count: int) -> list[Problem]:
        problems: list[Problem] = []
        seen: dict[str, int] = {}  # row id -> times drawn in this step
        for i in range(step * count, (step + 1) * count):
            epoch, at = divmod(i, len(self._train))
            problem = self._train[self._order(epoch)[at]]
            seen[problem.id] = seen.get(problem.id, 0) + 1
            if seen[problem.id] > 1:
                problem = replace(problem, id=f"{problem.id}#{seen[problem.id]}")
            problems.append(problem)
        return problems

    def val_problems(self) -> list[Problem]:
        return self._val

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 or 0.0; raises :class:`CallFailed` when math-verify does not answer in time."""
        if self._verify is not None:
            return self._verify(problem.answer, completion)
        return (
            1.0
            if normalize_answer(completion_answer(completion)) == normalize_answer(problem.answer)
            else 0.0
        )

    def close(self) -> None:
        if self._verify is not None:
            self._verify.close()


def _math_verify(limits: TaskConfig) -> WorkerPool | None:
    """math-verify's reward when it is installed (its workers start at the first reward), else None."""
    if importlib.util.find_spec("math_verify") is None:
        return None
    from coordinator.math_reward import math_verifier

    return math_verifier(deadline_s=limits.reward_deadline_s, memory_mb=limits.user_code_memory_mb)


class CustomReward:
    """Wraps a task, replacing its reward with ``module:function(prompt, completion, answer)``, called in
    worker processes: raises :class:`CallFailed` when it times out, crashes, runs out of memory, raises,
    or returns what is not a finite number."""

    def __init__(self, task: Task, spec: str, limits: TaskConfig) -> None:
        load_reward(spec)  # (a spec that cannot be loaded is the run's configuration: ValueError here)
        self.task = task
        self.fn = WorkerPool(
            "coordinator.user_code:reward_function",
            (spec,),
            name=f"reward {spec}",
            workers=REWARD_WORKERS,
            deadline_s=limits.reward_deadline_s,
            memory_mb=limits.user_code_memory_mb,
        )

    def train_problems(self, step: int, count: int) -> list[Problem]:
        return self.task.train_problems(step, count)

    def val_problems(self) -> list[Problem]:
        return self.task.val_problems()

    def reward(self, problem: Problem, completion: str) -> float:
        return float(self.fn(problem.prompt, completion, problem.answer))

    def close(self) -> None:
        self.fn.close()
        self.task.close()


REWARD_WORKERS = 4  # the coordinator's reward threads (coordinator/batches.py)


def load_reward(spec: str) -> RewardFn:
    return load_plugin(spec, "reward")


@contextmanager
def _field(name: str) -> Iterator[None]:
    """A dataset or reward the config names but that cannot be used: a ConfigError naming the field."""
    try:
        yield
    except (ValueError, OSError) as exc:
        raise ConfigError(f"invalid config: {name}: {exc}") from None


class EnvironmentTask:
    """A multi-turn environment's problems (coordinator/environments.py); its episodes score themselves."""

    def __init__(self, env: Environment, spec: str, seed: int) -> None:
        self.env, self.spec, self.seed = env, spec, seed  # (each episode worker makes its own from these)

    def train_problems(self, step: int, count: int) -> list[Problem]:
        return self.env.train_problems(step, count)

    def val_problems(self) -> list[Problem]:
        return self.env.val_problems()

    def reward(self, problem: Problem, completion: str) -> float:
        raise TypeError("an environment's episodes are scored as they are played")

    def close(self) -> None:
        self.env.close()


def build_task(config: CoordinatorConfig) -> Task:
    """The run's task. Raises :class:`ConfigError` (one line, naming the field) for a dataset that cannot
    be read or split, or a reward that cannot be loaded."""
    task: Task
    wanted, seed = config.task, config.run.seed
    if wanted.env is not None:
        from coordinator.environments import load_environment

        with _field("env"):
            return EnvironmentTask(load_environment(wanted.env, seed), wanted.env, seed)
    if wanted.name in ("arith", "arith-chat"):
        kind = ArithChatTask if wanted.name == "arith-chat" else ArithTask
        task = kind(seed, wanted.val_size, wanted.max_operand)
    else:
        from coordinator.datasets import load_problems, split

        assert wanted.dataset is not None  # the config checked it
        with _field("dataset"):
            rows = load_problems(wanted.dataset, wanted.prompt_key, wanted.answer_key, "row")
        held = None
        if wanted.val_dataset is not None:
            with _field("val_dataset"):
                held = load_problems(wanted.val_dataset, wanted.prompt_key, wanted.answer_key, "val")
        with _field("dataset"):
            train, val = split(rows, seed, wanted.val_size, wanted.val_fraction, held)
        task = DatasetTask(train, val, seed, None if wanted.reward else _math_verify(wanted))
    if wanted.reward:
        with _field("reward"):
            return CustomReward(task, wanted.reward, wanted)
    return task
