"""Multi-turn environments' loading, config and the shipped arith-feedback rules (coordinator/
environments.py, coordinator/arith_feedback.py); their episodes on a real replica: tests/e2e."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.arith_feedback import ArithFeedback, feedback
from coordinator.config import CoordinatorConfig
from coordinator.environments import Policy, load_environment, openai_sampling
from fp8rl.config import ConfigError, load_config
from fp8rl.v1 import common_pb2


class ScriptedPolicy(Policy):
    """Answers from a script (the environment's rules are under test here, not the policy)."""

    def __init__(self, replies: list[str]) -> None:
        super().__init__(client=None, model="m")  # type: ignore[arg-type]
        self.replies, self.seen = replies, []

    def chat(self, messages: list[dict[str, str]]) -> str:
        self.seen.append([dict(m) for m in messages])
        return self.replies.pop(0)


def test_arith_feedback_rewards_a_first_and_a_second_try() -> None:
    env = load_environment("arith-feedback", seed=0)
    assert isinstance(env, ArithFeedback)
    problem = env.train_problems(3, 4)[0]
    a, b = (int(x) for x in problem.prompt.removeprefix("What is ").rstrip("?").split(" + "))
    right, low = str(a + b), str(a + b - 1)
    assert env.play(problem, ScriptedPolicy([f"{a} + {b} = {right}"])) == 1.0
    second = ScriptedPolicy([low, right])
    assert env.play(problem, second) == 0.5
    # The second turn repeats the conversation, then the feedback: larger than the wrong answer.
    assert second.seen[1][:2] == [
        {"role": "user", "content": problem.prompt},
        {"role": "assistant", "content": low},
    ]
    assert second.seen[1][2]["content"] == f"No, {a} + {b} is more than {low}. {problem.prompt}"
    assert env.play(problem, ScriptedPolicy(["no idea", "still none"])) == 0.0
    assert feedback(problem, "no idea").startswith("Please answer with a number.")
    assert env.train_problems(3, 4) == env.train_problems(3, 4) != env.train_problems(4, 4)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nocolon", "neither module:factory"),
        ("no_such_module_x:f", "cannot import"),
        ("coordinator.arith_feedback:missing", "has no callable missing"),
        ("coordinator.arith_feedback:number_of", "number_of"),
    ],
)
def test_a_bad_env_is_refused_with_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        load_environment(spec, seed=0)


def test_an_env_brings_its_own_problems() -> None:
    config = load_config(CoordinatorConfig, None, {"env": "arith-feedback"}, [])
    assert config.task.env == "arith-feedback"
    for extra in ({"reward": "m:f"}, {"task": "arith-chat"}):
        with pytest.raises(ConfigError, match="env brings its own problems"):
            load_config(CoordinatorConfig, None, {"env": "arith-feedback", **extra}, [])


def test_the_runs_sampling_as_openai_arguments() -> None:
    sampling = common_pb2.SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_tokens=12, stop=["\n"])
    args: dict[str, Any] = openai_sampling(sampling)
    assert args == {
        "temperature": pytest.approx(0.7),
        "max_tokens": 12,
        "top_p": pytest.approx(0.9),
        "stop": ["\n"],
        "extra_body": {"top_k": 5},
    }
    assert openai_sampling(common_pb2.SamplingParams(temperature=1.0, max_tokens=4)) == {
        "temperature": 1.0,
        "max_tokens": 4,
    }
