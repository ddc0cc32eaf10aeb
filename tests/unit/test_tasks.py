"""Tasks and rewards: deterministic prompts, a held-out split, JSONL datasets, custom rewards."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.problems import Problem
from coordinator.tasks import ArithChatTask, ArithTask, Task, build_task, normalize_answer
from fp8rl import arith
from fp8rl.config import load_config


def dataset_task(path: Path, *settings: str) -> Task:
    return build_task(load_config(CoordinatorConfig, dotted=["task=jsonl", f"dataset={path}", *settings]))


def test_arith_is_deterministic_and_validation_is_held_out() -> None:
    task = ArithTask(seed=3, val_size=32)
    assert task.train_problems(5, 8) == ArithTask(seed=3).train_problems(5, 8)
    assert task.train_problems(5, 8) != task.train_problems(6, 8)
    val = {p.prompt for p in task.val_problems()}
    assert len(val) == 32
    train = {p.prompt for step in range(50) for p in task.train_problems(step, 64)}
    assert not val & train
    # The split is by hash: held-out sums end in every digit, so no pattern separates them.
    assert {int(p.answer) % 10 for p in task.val_problems()} == set(range(10))
    assert all(arith.held_out(*map(int, p.prompt[:-1].split("+"))) for p in task.val_problems())
    p = Problem("x", "37+48=", "85")
    assert task.reward(p, "85") == 1.0 and task.reward(p, "85\nmore") == 1.0 and task.reward(p, "84") == 0.0


def test_arith_chat_asks_small_sums_as_a_chat_and_scores_the_last_number() -> None:
    task = build_task(CoordinatorConfig(task="arith-chat", seed=3))
    assert isinstance(task, ArithChatTask)
    train = task.train_problems(5, 32)
    assert train == ArithChatTask(3).train_problems(5, 32)  # deterministic from seed and step
    for problem in train + task.val_problems():
        a, b = (int(x) for x in problem.prompt.removeprefix("What is ").removesuffix("?").split(" + "))
        assert 0 <= a <= 19 and 0 <= b <= 19 and problem.answer == str(a + b)
        assert problem.messages == (("user", problem.prompt),)
    val = {p.prompt for p in task.val_problems()}
    assert len(val) == 45 and not val & {p.prompt for p in task.train_problems(6, 200)}
    problem = Problem("p", "What is 7 + 12?", "19", (("user", "What is 7 + 12?"),))
    assert [
        task.reward(problem, c) for c in ("7 + 12 = 19", "19", "It is 1,9.\n19", "20", "", "19 or 20")
    ] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_hedging_teacher_is_right_and_hedges_big_sums_more() -> None:
    rng = random.Random()  # fresh pairs and draws each run
    pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(4000)]
    hedged = {True: [], False: []}  # keyed by "sum >= 100"
    for a, b in pairs:
        text = arith.hedged_answer(a, b, rng)
        assert text.removesuffix("?") == arith.answer(a, b)
        hedged[a + b >= 100].append(text.endswith("?"))
    # 4 standard errors of a rate measured on ~2000 draws is under 0.045.
    assert abs(sum(hedged[True]) / len(hedged[True]) - 0.7) < 0.045
    assert abs(sum(hedged[False]) / len(hedged[False]) - 0.3) < 0.045
    # The verifier rejects a hedged answer.
    assert ArithTask(seed=0).reward(Problem("x", "60+48=", "108"), "108?") == 0.0


def test_jsonl_task_and_custom_reward(tmp_path: Path) -> None:
    rows = [{"prompt": f"What is {i} times 2?", "answer": str(2 * i)} for i in range(10)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = dataset_task(path, "val_size=3")
    try:
        assert [p.answer for p in task.val_problems()] == ["0", "2", "4"]
        assert all(p.answer not in ("0", "2", "4") for p in task.train_problems(0, 20))
        assert task.reward(Problem("r", "q", "1,000"), " 1000. ") == 1.0
    finally:
        task.close()  # math-verify's workers, when it is installed
    assert normalize_answer("$12") == "12"
    (tmp_path / "my_reward.py").write_text(
        "def score(prompt, completion, answer):\n    return len(completion) / 10\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        custom = dataset_task(path, "reward=my_reward:score", "val_size=3")
        assert custom.reward(Problem("r", "q", "x"), "abcde") == 0.5
    finally:
        sys.path.remove(str(tmp_path))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "no answer"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl: row 1: no 'answer' key"):
        dataset_task(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="has no callable nope"):
        build_task(CoordinatorConfig(reward="json:nope"))


def test_jsonl_task_takes_chat_format_prompts(tmp_path: Path) -> None:
    from coordinator.batches import wire_prompt

    rows = [
        {
            "prompt": [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": f"{i}*2?"},
            ],
            "answer": str(2 * i),
        }
        for i in range(6)
    ] + [{"prompt": "plain text", "answer": "1"}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = dataset_task(path, "val_size=2")
    first = task.val_problems()[0]
    assert first.messages == (("system", "Answer briefly."), ("user", "0*2?")) and first.prompt == "0*2?"
    wire = wire_prompt(first)
    assert wire.WhichOneof("input") == "chat" and wire.id == first.id
    assert [(m.role, m.content) for m in wire.chat.messages] == list(first.messages)
    plain = wire_prompt(Problem("p", "plain text", "1"))
    assert plain.WhichOneof("input") == "text" and plain.text == "plain text"
    (tmp_path / "bad.jsonl").write_text('{"prompt": [{"role": "user"}], "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl: row 1: 'prompt' must be text or a non-empty list"):
        dataset_task(tmp_path / "bad.jsonl")
