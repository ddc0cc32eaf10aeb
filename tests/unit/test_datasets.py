"""The dataset task: JSON lines, parquet and HF datasets directories load the same problems, split by
count, fraction or second file; training draws rows without replacement, epoch by epoch; a malformed
record, or a dataset that cannot be split, is one config error naming the field, file, row and key."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.datasets import final_answer, load_problems, records, split
from coordinator.problems import Problem
from coordinator.tasks import DatasetTask, build_task
from fp8rl.config import ConfigError, load_config
from fp8rl.data import GSM8K_SAMPLE

ROWS = [json.loads(line) for line in GSM8K_SAMPLE.read_text().splitlines()]


def write_parquet(rows: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_hf(rows: list[dict], path: Path, as_dict: bool = False) -> Path:
    import datasets

    data = datasets.Dataset.from_list(rows)
    (datasets.DatasetDict({"train": data}) if as_dict else data).save_to_disk(str(path))
    return path


def test_the_shipped_sample_is_gsm8k_shaped() -> None:
    assert len(ROWS) >= 30 and all(set(r) == {"question", "answer"} for r in ROWS)
    assert all(r["answer"].splitlines()[-1].startswith("#### ") for r in ROWS)
    assert final_answer("so 1,234 in all\n#### 1,234") == "1234" and final_answer(" 7 ") == "7"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "hf", "hf-dict"])
def test_every_format_loads_the_same_problems(fmt: str, tmp_path: Path) -> None:
    path = {
        "jsonl": lambda: GSM8K_SAMPLE,
        "parquet": lambda: write_parquet(ROWS, tmp_path / "gsm.parquet"),
        "hf": lambda: write_hf(ROWS, tmp_path / "gsm"),
        "hf-dict": lambda: write_hf(ROWS, tmp_path / "gsm", as_dict=True),
    }[fmt]()
    problems = load_problems(path, "question", "answer", "row")
    assert [p.prompt for p in problems] == [r["question"] for r in ROWS]
    assert [p.answer for p in problems] == [r["answer"].rsplit("#### ", 1)[1] for r in ROWS]


def test_splits_by_count_fraction_and_second_file() -> None:
    problems = load_problems(GSM8K_SAMPLE, "question", "answer", "row")
    train, val = split(problems, seed=0, val_size=8)
    assert val == problems[:8] and train == problems[8:]
    train, val = split(problems, seed=0, val_size=100, val_fraction=0.25)
    assert len(val) == 10 and len(train) == 30 and not set(p.id for p in val) & set(p.id for p in train)
    assert split(problems, seed=0, val_size=100, val_fraction=0.25) == (train, val)  # seeded
    assert split(problems, seed=1, val_size=100, val_fraction=0.25)[1] != val
    other = problems[:5]
    assert split(problems, seed=0, val_size=3, val_problems=other) == (problems, other[:3])
    # By count, validation never takes more than half the rows: the sample's default splits 20/20.
    assert split(problems, seed=0, val_size=128) == (problems[20:], problems[:20])
    assert split(problems[:5], seed=0, val_size=8) == (problems[2:5], problems[:2])
    with pytest.raises(ValueError, match="1 rows leave nothing to train on"):
        split(problems[:1], seed=0, val_size=8)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"question": "2+2?"}, r"row 3: no 'answer' key \(keys: question\)"),
        ({"question": 7, "answer": "1"}, r"row 3: 'question' must be text or a non-empty list"),
        ({"question": "2+2?", "answer": [4]}, r"row 3: 'answer' must be text or a number"),
        ("just text", r"row 3: not a record"),
    ],
)
def test_a_malformed_record_names_file_row_and_key(row: object, message: str, tmp_path: Path) -> None:
    rows = [*ROWS[:2], row]
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=rf"{jsonl}: {message}"):
        load_problems(jsonl, "question", "answer", "row")


def test_parquet_rows_are_checked_like_json_lines(tmp_path: Path) -> None:
    path = write_parquet([{"q": "1+1?", "a": "2"}, {"q": None, "a": "3"}], tmp_path / "q.parquet")
    with pytest.raises(ValueError, match=rf"{path}: row 2: 'q' must be text"):
        load_problems(path, "q", "a", "row")
    with pytest.raises(ValueError, match="invalid JSON"):
        bad = tmp_path / "x.jsonl"
        bad.write_text('{"q": 1}\n{oops\n')
        list(records(bad))


def test_chat_prompts_and_the_config_options(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"{i}+1?"}], "target": i + 1} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(
        CoordinatorConfig,
        dotted=[
            f"dataset={path}",
            "task=dataset",
            "prompt_key=messages",
            "answer_key=target",
            "val_fraction=0.5",
        ],
    )
    task = build_task(config)
    assert isinstance(task, DatasetTask) and len(task.val_problems()) == 3
    problem = task.train_problems(0, 1)[0]
    assert problem.messages == (("user", problem.prompt),) and problem.answer == str(
        int(problem.prompt[0]) + 1
    )
    with pytest.raises(ConfigError, match="val_fraction or val_dataset"):
        load_config(
            CoordinatorConfig,
            dotted=[f"dataset={path}", "task=dataset", "val_fraction=0.5", f"val_dataset={path}"],
        )
    with pytest.raises(ConfigError, match=r"dataset .* does not exist"):
        load_config(CoordinatorConfig, dotted=["dataset=/nonexistent.parquet", "task=dataset"])
    assert (
        load_config(CoordinatorConfig, dotted=["task=jsonl", "dataset=gsm8k-sample"]).task.dataset
        == GSM8K_SAMPLE
    )


@pytest.mark.parametrize("verifier", ["math-verify", "fallback"])
def test_rewards_with_and_without_math_verify(verifier: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import coordinator.tasks as tasks

    if verifier == "fallback":
        monkeypatch.setattr(tasks, "_math_verify", lambda _limits: None)
    else:
        pytest.importorskip("math_verify", reason="math-verify is part of the dev extra")
    config = load_config(
        CoordinatorConfig,
        dotted=["task=dataset", "dataset=gsm8k-sample", "prompt_key=question", "val_size=4"],
    )
    task = build_task(config)
    try:
        assert (task._verify is None) == (verifier == "fallback")  # type: ignore[attr-defined]
        problem = task.val_problems()[0]
        right = f"Adding it up step by step.\n#### {problem.answer}"
        wrong = f"Adding it up step by step.\n#### {int(problem.answer) + 1}"
        assert task.reward(problem, right) == 1.0 and task.reward(problem, wrong) == 0.0
        assert task.reward(problem, f"{problem.answer}\nmore text") == 1.0
    finally:
        task.close()


def test_training_draws_rows_without_replacement_epoch_by_epoch() -> None:
    rows = [Problem(f"row-{i}", f"q{i}", str(i)) for i in range(2000)]
    task = DatasetTask(rows, rows[:1], seed=7)
    # 32 of 2000 rows, with replacement, repeated a row in ~22% of steps (a duplicate prompt id: the
    # replica refused the request). Without: each epoch visits every row once, in a seeded order.
    steps = [task.train_problems(k, 32) for k in range(250)]  # 8000 draws: four epochs
    for k, step in enumerate(steps):
        assert len({p.id for p in step}) == 32, f"step {k} repeats an id"
    drawn = [p for step in steps for p in step]
    for epoch in range(4):
        assert sorted(p.id for p in drawn[epoch * 2000 : (epoch + 1) * 2000]) == sorted(r.id for r in rows)
    assert [p.id for p in drawn[:2000]] != [p.id for p in drawn[2000:4000]]  # a fresh order per epoch
    # Deterministic from seed and step alone: a resumed run (a fresh task) draws the same prompts.
    assert DatasetTask(rows, rows[:1], seed=7).train_problems(123, 32) == steps[123]
    assert DatasetTask(rows, rows[:1], seed=8).train_problems(123, 32) != steps[123]
    # A step spanning an epoch boundary may draw a row twice (count 16 of 20 rows: rows 16-31 of the
    # sequence); asking for more rows than there are draws some several times. Each copy has its own id.
    for count, total in ((16, 20), (50, 20), (5, 1)):
        few = DatasetTask(rows[:total], rows[:1], seed=0)
        for k in range(6):
            problems = few.train_problems(k, count)
            assert len(problems) == count and len({p.id for p in problems}) == count
            assert {p.id.split("#")[0] for p in problems} <= {r.id for r in rows[:total]}
    copies = [p for p in DatasetTask(rows[:20], rows[:1], seed=0).train_problems(0, 50) if "#" in p.id]
    assert len(copies) == 30 and {p.id.rsplit("#", 1)[1] for p in copies} == {"2", "3"}
    original = {r.id: r for r in rows}
    assert all(replace(p, id=p.id.split("#")[0]) == original[p.id.split("#")[0]] for p in copies)


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_dataset_the_run_cannot_use_is_one_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from coordinator.run import start

    one_row = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    bad_row = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}])
    good = write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "a", "answer": "1"}] * 4)
    (tmp_path / "torn.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n')
    (tmp_path / "not-a-dataset").mkdir()
    for settings, message in (
        (
            ["dataset=gsm8k-sample"],
            r"dataset: .*gsm8k_sample.jsonl: row 1: no 'prompt' key \(keys: answer, "
            r"question\); --prompt-key names the one to use$",
        ),
        ([f"dataset={one_row}"], r"dataset: 1 rows leave nothing to train on after 1 for validation"),
        ([f"dataset={one_row}", "val_fraction=0.5"], r"dataset: 1 rows leave nothing to train on"),
        ([f"dataset={bad_row}"], rf"dataset: {bad_row}: row 2: no 'answer' key"),
        ([f"dataset={tmp_path / 'torn.jsonl'}"], r"dataset: .*torn.jsonl: row 2: invalid JSON"),
        ([f"dataset={tmp_path / 'not-a-dataset'}"], r"dataset: .*not-a-dataset: cannot read as a datasets"),
        (
            [f"dataset={good}", f"val_dataset={bad_row}"],
            r"val_dataset: .*row 2: no 'answer'",
        ),
        (
            [
                f"dataset={write_jsonl(tmp_path / 'ok.jsonl', [{'prompt': 'a', 'answer': '1'}] * 4)}",
                "reward=no_such_module:score",
            ],
            r"reward: reward 'no_such_module:score': cannot import",
        ),
    ):
        config = load_config(CoordinatorConfig, dotted=["task=dataset", *settings])
        with pytest.raises(ConfigError, match=rf"^invalid config: {message}") as caught:
            build_task(config)
        assert "\n" not in str(caught.value)
        run_dir = tmp_path / "run"
        config = CoordinatorConfig.model_validate(config.model_dump() | {"run_dir": run_dir})
        assert start(config) == 2  # before anything starts
        err = capsys.readouterr().err
        assert err == f"coordinator: {caught.value}\n" and not run_dir.exists()
