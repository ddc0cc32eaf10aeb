"""Coverage-guided fuzzing of the code that reads untrusted bytes (tests/fuzz): the weight codec's decoder
and part stream, the Generate and TrainStep validators. Every committed input (seeds, and each crash
once found) replays here in seconds; the atheris runs, a time box each (FP8RL_FUZZ_SECONDS, default
35 s), are slow tests. The OpenAI face's are in tests/integration/test_fuzz_openai.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fuzz import suite

PURE = ["codec_decode", "codec_stream", "generate", "train_samples"]


@pytest.mark.parametrize("target", PURE)
def test_every_committed_input_replays_without_a_crash(target: str) -> None:
    print(f"{target}: {suite.replay(target)} committed inputs replayed")


@pytest.mark.slow
@suite.OPT_IN
@pytest.mark.parametrize("target", PURE)
def test_fuzzing_finds_no_crash(target: str, tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris (coverage-guided fuzzing) has wheels for x86-64 Linux")
    suite.check(suite.fuzz(target, suite.fuzz_seconds(), tmp_path))
