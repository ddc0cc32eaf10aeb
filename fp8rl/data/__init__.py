"""Data shipped with fp8rl: a small math word-problem sample in GSM8K's layout (``question``, and an
``answer`` whose last line is ``#### <number>``), written for the project, for trying the dataset task."""

from pathlib import Path

GSM8K_SAMPLE = Path(__file__).resolve().parent / "gsm8k_sample.jsonl"
