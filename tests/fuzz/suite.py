"""What the test tiers run of the fuzz targets: every committed input replayed in process (fast: seeds and
the regressions of crashes once found), and a time-boxed atheris run of a target in a child process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.fuzz.targets import CORPUS, TARGETS, run_one

ROOT = Path(__file__).resolve().parents[2]
SECONDS_ENV = "FP8RL_FUZZ_SECONDS"
# Per target, in every full run: 15 s keeps the five runs (with their start-up, about 2 minutes) within
# the suite's 40-minute budget and loses little: a 60 s run of the slowest target (openai, ~150 inputs a
# second) had 341 of its 371 edges from the seeds alone and 365 at 40 s; the committed corpus replays in
# every tier. Longer hunts: FP8RL_FUZZ_SECONDS.
DEFAULT_SECONDS = 15


def fuzz_seconds() -> int:
    """Each target's time box: ``FP8RL_FUZZ_SECONDS`` (e.g. 600 for a long hunt), else 15 s."""
    return int(os.environ.get(SECONDS_ENV, DEFAULT_SECONDS))


def replay(target: str) -> int:
    """Run every committed input of ``target`` (raising on a crash); returns how many ran."""
    inputs = sorted((CORPUS / target).iterdir())
    for path in inputs:
        try:
            run_one(TARGETS[target], path.read_bytes())
        except BaseException as exc:
            raise AssertionError(f"{target}: {path.name} crashes again: {exc!r}") from exc
    return len(inputs)


@dataclass(frozen=True)
class Outcome:
    target: str
    seconds: int
    inputs: int  # libFuzzer's executed units
    new_inputs: int  # inputs that reached new coverage, added to the working corpus
    coverage: str  # libFuzzer's last "cov: N ft: M" (edges, features)
    peak_rss_mb: int
    crashes: list[Path]  # crash-*, timeout-*, oom-* inputs written
    status: int
    output: str

    def line(self) -> str:
        return (
            f"fuzz {self.target}: {self.inputs} inputs in {self.seconds} s, {len(self.crashes)} crash(es), "
            f"{self.new_inputs} new inputs, {self.coverage}, peak RSS {self.peak_rss_mb} MB"
        )


def fuzz(target: str, seconds: int, work: Path, rss_mb: int | None = None) -> Outcome:
    """``target`` under atheris for ``seconds`` (a child process, reaped), its new inputs and any crash
    under ``work``; ``rss_mb``: the runner's memory limit, if not its default."""
    artifacts, corpus = work / "artifacts", work / "corpus"
    artifacts.mkdir(parents=True)
    corpus.mkdir()
    command = [sys.executable, "-m", "tests.fuzz.runner", target, f"--seconds={seconds}"]
    command += [f"--work={corpus}", f"--artifacts={artifacts}"]
    command += [f"--rss-mb={rss_mb}"] if rss_mb else []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=seconds + 300, check=False
    )
    output = done.stdout + done.stderr

    def stat(name: str) -> int:
        found = re.search(rf"stat::{name}:\s+(\d+)", output)
        return int(found.group(1)) if found else 0

    coverage = re.findall(r"cov: \d+ ft: \d+", output)
    return Outcome(
        target,
        seconds,
        stat("number_of_executed_units"),
        stat("new_units_added"),
        coverage[-1] if coverage else "cov: ?",
        stat("peak_rss_mb"),
        sorted(artifacts.iterdir()),
        done.returncode,
        output,
    )


def check(outcome: Outcome) -> None:
    """Print the figures; fail with the crashing input's path and what to do with it."""
    print(outcome.line())
    if outcome.crashes or outcome.status != 0:
        tail = outcome.output[-6000:]
        names = ", ".join(str(p) for p in outcome.crashes) or "(none written)"
        raise AssertionError(
            f"{outcome.line()}; exit status {outcome.status}; crashing input: {names}. Replay it with "
            f"tests.fuzz.targets.run_one; keep it as tests/fuzz/corpus/{outcome.target}/regress-<what>, "
            f"with a regression test, once fixed.\n{tail}"
        )
    assert outcome.inputs > 0, outcome.output[-3000:]
