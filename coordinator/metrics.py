"""Where step records go: RUN_DIR/metrics.jsonl (rebuilt from the Redis stream, the source of truth, when
a run resumes), TensorBoard when installed, and the terminal — a live rich display on a TTY, plain lines
otherwise."""

from __future__ import annotations

import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SHOWN = ("reward_mean", "val_accuracy", "token_mult_prob_error", "gen_kl_error", "step_s", "sync_bytes")


class MetricsSink:
    def __init__(self, run_dir: Path, steps: int, progress: str = "auto", warn_above: float = 1.05) -> None:
        self.path = run_dir / METRICS_FILE
        self.steps, self.warn_above = steps, warn_above
        self.rich = progress == "rich" or (progress == "auto" and sys.stdout.isatty())
        self._console: Any = None
        if self.rich:
            from rich.console import Console

            self._console = Console()
        self._tb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:
            pass  # TensorBoard is optional

    def rebuild(self, records: list[dict[str, Any]]) -> None:
        self.path.write_text("".join(json.dumps(r) + "\n" for r in records))

    def write(self, record: dict[str, Any]) -> list[str]:
        """Append a record and show it; returns the warnings it raised."""
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key != "step":
                    self._tb.add_scalar(key, value, record["step"])
            self._tb.flush()
        warnings = []
        error = record.get("token_mult_prob_error")
        if error is not None and error > self.warn_above:
            warnings.append(
                f"token_mult_prob_error {error:.4f} > {self.warn_above} at step {record['step']}: "
                "rollout and trainer disagree more than usual"
            )
        self._show(record, warnings)
        return warnings

    def _show(self, record: dict[str, Any], warnings: list[str]) -> None:
        parts = [f"{k}={_fmt(record[k])}" for k in SHOWN if k in record]
        line = f"step {record['step']}/{self.steps} " + " ".join(parts)
        if self._console is not None:
            self._console.print(f"[bold cyan]{line}[/]")
            for w in warnings:
                self._console.print(f"[bold yellow]WARNING[/] {w}")
        else:
            print(line, flush=True)
            for w in warnings:
                print(f"WARNING {w}", flush=True)

    def say(self, text: str) -> None:
        if self._console is not None:
            self._console.print(text)
        else:
            print(text, flush=True)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The step records of a run directory, in order; none when it has no metrics file yet."""
    path = run_dir / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Base vs final accuracy and the medians a reader wants at the end of a run."""
    steps = [r for r in records if r.get("step", 0) > 0]
    validated = [r for r in records if "val_accuracy" in r]

    def median(key: str) -> float | None:
        values = [r[key] for r in steps if key in r]
        return statistics.median(values) if values else None

    return {
        "steps": len(steps),
        "base_val_accuracy": validated[0]["val_accuracy"]
        if validated and validated[0]["step"] == 0
        else None,
        "final_val_accuracy": validated[-1]["val_accuracy"] if validated else None,
        "median_token_mult_prob_error": median("token_mult_prob_error"),
        "max_token_mult_prob_error": max((r["token_mult_prob_error"] for r in steps), default=None),
        "median_gen_kl_error": median("gen_kl_error"),
        "median_rollout_tokens_per_s": median("rollout_tokens_per_s"),
        "median_step_s": median("step_s"),
        "median_sync_bytes": median("sync_bytes"),
    }
