"""Coverage-guided fuzzing of the code that reads untrusted bytes (tests/fuzz): the weight codec's decoder
and part stream, the Generate and TrainStep validators. Every committed input (seeds, and each crash
once found) replays here in seconds; the atheris runs, a time box each (FP8RL_FUZZ_SECONDS, default
15 s), are slow tests. The OpenAI face's are in tests/integration/test_fuzz_openai.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuzz import suite

PURE = ["codec_decode", "codec_stream", "generate", "train_samples"]


@pytest.mark.parametrize("target", PURE)
def test_every_committed_input_replays_without_a_crash(target: str) -> None:
    print(f"{target}: {suite.replay(target)} committed inputs replayed")


@pytest.mark.slow
@pytest.mark.parametrize("target", PURE)
def test_fuzzing_finds_no_crash(target: str, tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris (coverage-guided fuzzing) has wheels for x86-64 Linux")
    suite.check(suite.fuzz(target, suite.fuzz_seconds(), tmp_path))


# A launcher that once held ~800 MB (freed before it starts the fuzzer), and a 600 MB limit the fuzzer
# itself (~300 MB) stays under.
BIG_LAUNCHER = """
import sys
from pathlib import Path
from tests.fuzz import suite
peak = bytearray(800 << 20)
peak[::4096] = bytes(len(peak[::4096]))  # written, so resident
del peak
outcome = suite.fuzz("codec_decode", 1, Path(sys.argv[1]), rss_mb=600)
print(outcome.line(), outcome.status)
sys.exit(outcome.status or len(outcome.crashes))
"""


@pytest.mark.slow
def test_the_memory_limit_counts_the_fuzzer_not_its_launcher(tmp_path: Path) -> None:
    # libFuzzer's -rss_limit_mb reads getrusage's peak RSS, into which Linux carries the launcher's peak
    # across exec: from the full suite (pytest holding vLLM, 5-6 GB) every run stopped as out of memory.
    pytest.importorskip("atheris", reason="atheris (coverage-guided fuzzing) has wheels for x86-64 Linux")
    done = subprocess.run(
        [sys.executable, "-c", BIG_LAUNCHER, str(tmp_path)],
        cwd=suite.ROOT,
        env={**os.environ, "PYTHONPATH": str(suite.ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "0 crash(es)" in done.stdout, done.stdout
