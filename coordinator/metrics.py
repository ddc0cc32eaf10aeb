"""Where step records go: RUN_DIR/metrics.jsonl (rebuilt from the Redis stream, the source of truth, when
a run resumes), TensorBoard event files (RUN_DIR/tensorboard) and Weights & Biases when asked, all fed
the same record under the same names, and the terminal — a live rich display on a TTY, plain lines
otherwise. A resumed run continues the same TensorBoard run (events from the resume point on are purged
first) and the same W&B run (its id is derived from the run id), so no step appears twice.

The files are views of Redis, never the record itself: a write that fails (a full disk) is logged and the
run goes on; metrics.jsonl keeps whole lines only (a failed append is cut back) and catches up with the
records it missed at the next write that succeeds, and TensorBoard's writer, dead after a failed write,
is started again from the first step it missed."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SHOWN = ("reward_mean", "val_accuracy", "token_mult_prob_error", "gen_kl_error", "step_s", "sync_bytes")


def wandb_id(run_id: str) -> str:
    """A W&B run id for a run id (W&B allows letters, digits, '-' and '_')."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", run_id)[:64]


class MetricsSink:
    def __init__(
        self,
        run_dir: Path,
        steps: int,
        progress: str = "auto",
        warn_above: float = 1.05,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        run_id: str = "",
        run_config: dict[str, Any] | None = None,
    ) -> None:
        self.path, self.run_dir = run_dir / METRICS_FILE, run_dir
        self.steps, self.warn_above = steps, warn_above
        self.rich = progress == "rich" or (progress == "auto" and sys.stdout.isatty())
        self._console: Any = None
        if self.rich:
            from rich.console import Console

            self._console = Console()
        self._want_tensorboard = tensorboard
        self._tb: Any = None
        self.records: list[dict[str, Any]] = []  # what the files must hold, in order
        self._written = 0  # records metrics.jsonl holds (the first ones)
        self._rewrite = False  # metrics.jsonl is to be written whole (a rebuild did not get through)
        self._tb_on = False  # TensorBoard is written (from the first rebuild on)
        self._tb_written = 0  # records TensorBoard holds
        self.write_failures = 0  # writes of metrics.jsonl or TensorBoard that failed (a full disk)
        self._failing: set[str] = set()  # what failed at its last write (logged once, until it recovers)
        self._wandb: Any = None
        if wandb_project:
            import wandb

            self._wandb = wandb.init(
                project=wandb_project,
                id=wandb_id(run_id or run_dir.name),
                name=run_id or run_dir.name,
                resume="allow",
                dir=str(run_dir),
                config=run_config or {},
            )

    def rebuild(self, records: list[dict[str, Any]], next_step: int) -> None:
        """Start from the run's committed records, before ``next_step`` (a rewound run recorded some
        steps again: the latest record of each step counts)."""
        self.records = committed(records, next_step)
        self._written, self._rewrite = 0, True
        self._save_lines()
        self._tb_written = len(self.records)  # (earlier sessions wrote them)
        if self._want_tensorboard and self._tb is None:
            self._tb_on = True
            # Steps from here on are written again: TensorBoard drops what an earlier session wrote for them.
            self._start_tensorboard(next_step)

    def write(self, record: dict[str, Any]) -> list[str]:
        """Append a record and show it; returns the warnings it raised."""
        self.records.append(record)
        self._save_lines()
        numbers = numbers_of(record)
        histograms = histograms_of(record)
        self._save_tensorboard()
        if self._wandb is not None:
            import numpy as np
            import wandb

            logged = numbers | {
                k: wandb.Histogram(np_histogram=(np.array(c), np.array(e)))
                for k, (c, e) in histograms.items()
            }
            self._wandb.log(logged, step=record["step"])
        warnings = []
        error = record.get("token_mult_prob_error")
        if error is not None and error > self.warn_above:
            warnings.append(
                f"token_mult_prob_error {error:.4f} > {self.warn_above} at step {record['step']}: "
                "rollout and trainer disagree more than usual"
            )
        self._show(record, warnings)
        return warnings

    def _save_lines(self) -> None:
        """Bring metrics.jsonl up to :attr:`records`: append the lines it lacks (cut back to whole lines if
        that fails), or write it whole (aside, then renamed) after a rebuild."""
        try:
            if self._rewrite:
                aside = self.path.with_name(f".{self.path.name}.tmp")
                try:
                    aside.write_text("".join(json.dumps(r) + "\n" for r in self.records))
                    os.replace(aside, self.path)
                finally:
                    aside.unlink(missing_ok=True)
                self._rewrite = False
            elif self._written < len(self.records):
                append_whole(self.path, "".join(json.dumps(r) + "\n" for r in self.records[self._written :]))
        except OSError as exc:
            self._failed("metrics.jsonl", exc)
            return
        self._written = len(self.records)
        self._recovered("metrics.jsonl")

    def _start_tensorboard(self, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        try:
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge_step or None)
        except OSError as exc:
            self._failed("TensorBoard", exc)

    def _save_tensorboard(self) -> None:
        """Write the records TensorBoard lacks. A writer whose write failed raises ever after: it is closed,
        and a new one starts from the first step missed (purging what the dead one may have left of it)."""
        if not self._tb_on or self._tb_written >= len(self.records):
            return
        if self._tb is None:
            if "metrics.jsonl" in self._failing:  # no room yet: each new writer's thread would die too
                return
            self._start_tensorboard(int(self.records[self._tb_written]["step"]))
            if self._tb is None:
                return
        try:
            for record in self.records[self._tb_written :]:
                for key, value in numbers_of(record).items():
                    self._tb.add_scalar(key, value, record["step"])
                for key, (counts, edges) in histograms_of(record).items():
                    add_histogram(self._tb, key, counts, edges, record["step"])
            self._tb.flush()
        except OSError as exc:
            with contextlib.suppress(Exception):
                self._tb.close()
            self._tb = None
            self._failed("TensorBoard", exc)
            return
        self._tb_written = len(self.records)
        self._recovered("TensorBoard")

    def _failed(self, what: str, exc: OSError) -> None:
        self.write_failures += 1
        if what not in self._failing:
            self._failing.add(what)
            log.error(
                "%s not written (%s): the run goes on (every record is in Redis), and %s catches up at "
                "the next write that succeeds",
                what,
                exc,
                what,
            )

    def _recovered(self, what: str) -> None:
        if what in self._failing:
            self._failing.discard(what)
            log.warning("%s written again: it holds all %d records", what, len(self.records))

    def close(self) -> None:
        if self._tb is not None:
            with contextlib.suppress(OSError):  # (a full disk: the records are in Redis)
                self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

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


def numbers_of(record: dict[str, Any]) -> dict[str, int | float]:
    """The record's scalars, but its step."""
    return {
        k: v
        for k, v in record.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"
    }


def append_whole(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` in full, or not at all: a write cut short (a full disk) is cut back to
    the file's size before it, so the file keeps whole lines."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        data = memoryview(text.encode())
        try:
            while data:
                data = data[os.write(fd, data) :]
        except BaseException:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def histograms_of(record: dict[str, Any]) -> dict[str, tuple[list[int], list[float]]]:
    """The record's per-token histograms that hold counts: name -> (counts, bucket edges)."""
    found = {}
    for key, value in record.items():
        if key.endswith("_counts") and isinstance(value, list) and sum(value) > 0:
            from fp8rl.grpo import HISTOGRAMS

            name = key.removesuffix("_counts")
            if name in HISTOGRAMS and len(HISTOGRAMS[name]) == len(value) + 1:
                found[name] = (value, HISTOGRAMS[name])
    return found


def add_histogram(writer: Any, tag: str, counts: list[int], edges: list[float], step: int) -> None:
    """A histogram of bucket counts, as TensorBoard's writer takes them (moments from bucket midpoints)."""
    middles = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
    used = [i for i, c in enumerate(counts) if c]
    writer.add_histogram_raw(
        tag,
        min=edges[used[0]],
        max=edges[used[-1] + 1],
        num=sum(counts),
        sum=sum(c * m for c, m in zip(counts, middles, strict=True)),
        sum_squares=sum(c * m * m for c, m in zip(counts, middles, strict=True)),
        bucket_limits=edges[1:],
        bucket_counts=counts,
        global_step=step,
    )


def committed(records: list[dict[str, Any]], next_step: int | None = None) -> list[dict[str, Any]]:
    """One record per step, the latest (a rewound run records its redone steps again), in step order,
    before ``next_step`` when given."""
    latest = {int(r["step"]): r for r in records if next_step is None or int(r["step"]) < next_step}
    return [latest[k] for k in sorted(latest)]


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
        # (the curve too: one validation is one point of a noisy RL trajectory; a study averages its end)
        "val_accuracy_by_step": {str(r["step"]): r["val_accuracy"] for r in validated},
        "median_token_mult_prob_error": median("token_mult_prob_error"),
        "max_token_mult_prob_error": max((r["token_mult_prob_error"] for r in steps), default=None),
        "median_gen_kl_error": median("gen_kl_error"),
        "median_routing_mismatch": median("routing_mismatch"),
        "median_rollout_tokens_per_s": median("rollout_tokens_per_s"),
        "median_step_s": median("step_s"),
        # (where a step's time goes: generation, the trainer's step, the publish to the replicas)
        "median_generate_s": median("generate_s"),
        "median_train_s": median("train_s"),
        "median_publish_s": median("publish_s"),
        "median_sync_bytes": median("sync_bytes"),
    }
