"""Rows of a dataset task: JSON lines, parquet, or a directory written by HF ``datasets``
(``Dataset.save_to_disk``; of a ``DatasetDict``, its ``train`` split), each row a record with a prompt
and an answer under configurable keys. Every malformed record is refused naming the file, the row and
the key."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from coordinator.problems import Problem, parse_prompt

log = logging.getLogger(__name__)
SAMPLES = {"gsm8k-sample"}  # names of datasets shipped with fp8rl (fp8rl/data)


def resolve(path: Path) -> Path:
    """A dataset path, or the name of a shipped sample."""
    if str(path) == "gsm8k-sample":
        from fp8rl.data import GSM8K_SAMPLE

        return GSM8K_SAMPLE
    return path


def records(path: Path) -> Iterator[Any]:
    """The rows of a dataset file or directory, in order."""
    if path.is_dir():
        try:
            import datasets
        except ImportError:
            raise ValueError(f"{path}: a datasets directory needs the `datasets` package") from None
        try:
            loaded = datasets.load_from_disk(str(path))
        except (OSError, ValueError) as exc:  # not a directory save_to_disk wrote
            raise ValueError(f"{path}: cannot read as a datasets directory: {exc}") from None
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ValueError(f"{path}: a DatasetDict without a 'train' split (has {sorted(loaded)})")
            loaded = loaded["train"]
        yield from loaded
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:
            raise ValueError(f"{path}: cannot read parquet: {exc}") from exc
        yield from table.to_pylist()
    elif path.suffix == ".json":  # one JSON array of records
        try:
            rows = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON: {exc.msg}") from None
        if not isinstance(rows, list):
            raise ValueError(f"{path}: a .json dataset is one array of records")
        yield from rows
    elif path.suffix == ".jsonl":
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}: row {i}: invalid JSON: {exc.msg}") from None
    else:
        raise ValueError(
            f"{path}: unknown dataset format (a .jsonl, .json or .parquet file, or a datasets directory)"
        )


def final_answer(value: object) -> str:
    """The reference answer: GSM8K's answers end with ``#### <number>`` after their reasoning."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # a parquet column of numbers reads 42 as 42.0
    text = str(value)
    return text.rsplit("####", 1)[1].strip().replace(",", "") if "####" in text else text.strip()


def load_problems(path: Path, prompt_key: str, answer_key: str, prefix: str) -> list[Problem]:
    problems = []
    for i, row in enumerate(records(path), 1):
        where = f"{path}: row {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: not a record")
        for key, flag in ((prompt_key, "--prompt-key"), (answer_key, "--answer-key")):
            if key not in row:
                keys = ", ".join(sorted(map(str, row)))
                raise ValueError(f"{where}: no {key!r} key (keys: {keys}); {flag} names the one to use")
        if not isinstance(row[answer_key], str | int | float) or isinstance(row[answer_key], bool):
            raise ValueError(f"{where}: {answer_key!r} must be text or a number")
        text, messages = parse_prompt(row[prompt_key], where, prompt_key)
        problems.append(Problem(f"{prefix}-{i}", text, final_answer(row[answer_key]), messages))
    if not problems:
        raise ValueError(f"{path}: no rows")
    return problems


def split(
    problems: list[Problem],
    seed: int,
    val_size: int,
    val_fraction: float | None = None,
    val_problems: list[Problem] | None = None,
) -> tuple[list[Problem], list[Problem]]:
    """(train, validation): a second file's rows, a seeded random fraction, or else the first ``val_size``
    rows but never more than half of them (at least one), so a small dataset keeps rows to train on (the
    shipped 40-row sample splits 20/20 under the default of 128). Validation keeps at most ``val_size``
    problems."""
    if val_problems is not None:
        return problems, val_problems[:val_size]
    if val_fraction is not None:
        order = list(range(len(problems)))
        random.Random(f"split:{seed}").shuffle(order)
        held = set(order[: max(1, round(val_fraction * len(problems)))])
        train = [p for i, p in enumerate(problems) if i not in held]
        val = [p for i, p in enumerate(problems) if i in held]
    else:
        count = min(val_size, max(1, len(problems) // 2))
        if count < val_size:
            log.warning(
                "validation holds out %d of the %d rows, not val_size %d: at most half of them "
                "(--val-fraction or --val-dataset choose otherwise)",
                count,
                len(problems),
                val_size,
            )
        train, val = problems[count:], problems[:count]
    if not train:
        raise ValueError(
            f"{len(problems)} rows leave nothing to train on after {len(val)} for validation: "
            "give more rows, a lower val_fraction (--val-fraction) or a val_dataset (--val-dataset)"
        )
    return train, val[:val_size]
