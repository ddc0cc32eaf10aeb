"""The FP8 study on a real model with statistical power: GRPO runs of every setting from the same base,
over several seeds, and the 95% confidence interval of each setting's final accuracy against bf16's.

Each (setting, seed) is one embedded ``coordinator start`` (redis-server, trainer and one replica as
child processes) on the chat sums with operands 0..49 (``--task arith-chat --max-operand 49``; a tenth
of the 2,500 pairs is held out), validating greedily before the first step and every ``--val-every``
steps on ``--val-size`` held-out sums of a seeded draw (all 265 of operands 0..49 at the default 300,
the same for every seed). A run's final accuracy is the mean of its last ``--final-evals``
validations after training: greedy accuracy moves by up to 0.11 between neighbouring validations of one
run, so a single end point adds that jitter to every seed's difference. A run whose summary.json exists
is not run again, so the study resumes where it stopped. The report pairs the settings by seed: the
difference of final accuracies per seed, its mean, a t-interval over the seeds (the seed-to-seed
spread of RL runs is in it), and how many seeds an interval of +-4 points would take at the spread seen
so far.

Each finished run's summary is also copied to ``--summaries`` (committed), and a run whose summary is
there is not run again either: the study, hours long on a 2-core machine, resumes across sessions and
machines from the repository alone. A summary records its design (steps, validation...); one of another
design is refused, not mixed in.

    python bench/study.py --model models/smollm2 --settings bf16,fp8 --seeds 24 --report FILE
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@functools.cache
def t_975(df: int) -> float:
    """Student's t with ``df`` degrees of freedom, its 0.975 quantile (a two-sided 95% interval): the t
    at which the density's integral from 0 (Simpson's rule) reaches 0.475, by bisection."""
    if df < 1:
        return math.inf
    log_scale = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(x: float) -> float:
        return math.exp(log_scale - (df + 1) / 2 * math.log1p(x * x / df))

    def mass(t: float, n: int = 2000) -> float:  # P(0 < T < t)
        h = t / n
        inner = sum((4 if i % 2 else 2) * density(i * h) for i in range(1, n))
        return h / 3 * (density(0.0) + inner + density(t))

    low, high = 0.0, 20.0  # (df 1's quantile is 12.706)
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if mass(mid) < 0.475 else (low, mid)
    return (low + high) / 2


@dataclass(frozen=True)
class Setting:
    name: str
    recipe: str
    consistency: str = "default"


SETTINGS = {
    s.name: s
    for s in (
        Setting("bf16", "bf16"),
        Setting("fp8-rollout", "fp8-rollout"),
        Setting("fp8", "fp8"),
        Setting("fp8-exact", "fp8", "exact"),
    )
}


FIRST_DESIGN = {"steps": 6, "prompts": 8, "group": 8, "val_size": 300, "max_operand": 49, "val_every": 0}
"""The design of the summaries kept before a summary recorded its own."""


def design(args: argparse.Namespace) -> dict[str, int]:
    """What makes two runs of a setting and seed the same run: a kept summary of another design is
    another study's."""
    return {key: getattr(args, key) for key in FIRST_DESIGN}


def run_once(setting: Setting, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run's summary (run now unless its summary.json exists)."""
    run_dir = args.out / f"{setting.name}-s{seed}"
    summary = run_dir / "summary.json"
    kept = args.summaries / f"{setting.name}-s{seed}.json"
    if kept.exists():
        result = json.loads(kept.read_text())
        if result.get("design", FIRST_DESIGN) != design(args):
            raise SystemExit(
                f"{kept} is a run of another design ({result.get('design', FIRST_DESIGN)}, not "
                f"{design(args)}): keep this study's summaries in another folder (--summaries)"
            )
        return result
    # A run's folder says what it was launched as (its design, commit and date): a folder of another
    # design, or of a study before this file, would resume as this one's run.
    launched = run_dir / "launched.json"
    if run_dir.exists() and any(run_dir.iterdir()):
        if not launched.exists() or json.loads(launched.read_text())["design"] != design(args):
            raise SystemExit(f"{run_dir} holds a run of another design: give this study its own --out")
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        measured = {"date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": machine()}
        launched.write_text(json.dumps({"design": design(args), "measured": measured}))
    if not summary.exists():  # (or it stopped before its end: the coordinator resumes it)
        command = [sys.executable, "-m", "coordinator.cli", "start", "--recipe", setting.recipe]
        command += ["--consistency", setting.consistency, "--model", str(args.model), "--seed", str(seed)]
        command += ["--run-id", f"study-{setting.name}-s{seed}", "--run-dir", str(run_dir)]
        command += ["--task", "arith-chat", "--max-operand", str(args.max_operand)]
        command += ["--steps", str(args.steps)]
        command += ["--prompts-per-step", str(args.prompts), "--group-size", str(args.group)]
        command += ["--max-tokens", "16", "--val-size", str(args.val_size)]
        command += ["--val-every", str(args.val_every)]
        command += ["--progress", "plain", "--no-tensorboard"]
        # One checkpoint, at the end: a step's 1.6 GB save took 9 s of its ~75 (a run stopped part-way
        # starts over: the coordinator rewinds to the trainer's step, 0).
        command += ["--set", f"learner.checkpoint_every={args.steps}"]
        start = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = done.stdout[-3000:] + done.stderr[-3000:]
            raise RuntimeError(f"{setting.name} seed {seed}: exit {done.returncode}\n{tail}")
        print(f"{setting.name} seed {seed}: {time.monotonic() - start:.0f} s", flush=True)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # (GBs a run; the study keeps summaries)
    result = json.loads(summary.read_text()) | json.loads(launched.read_text())
    args.summaries.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(result, indent=2) + "\n")
    return result


POWER = 0.04  # issue 42: the 95% interval of (fp8 - bf16) final accuracy within +-4 points


def seeds_needed(values: list[float], half_width: float = POWER) -> int | None:
    """Seeds a t-interval of ``values``' mean would need to be within ``half_width``, at the spread the
    seeds so far show (None: fewer than two seeds, no spread to go on)."""
    if len(values) < 2:
        return None
    spread = statistics.stdev(values)
    n = 2
    while t_975(n - 1) * spread / math.sqrt(n) > half_width:
        n += 1
    return n


def final_accuracy(run: dict[str, Any], evals: int) -> float:
    """A run's final accuracy: the mean of its last ``evals`` validations (one is its last alone; RL
    accuracy moves by several points between neighbouring validations, so one is a noisy end point)."""
    if evals < 1:
        raise SystemExit(f"--final-evals {evals}: at least one validation")
    if evals == 1:
        return float(run["final_val_accuracy"])
    # (after training only: step 0's is the base model's)
    curve = sorted((int(k), acc) for k, acc in run.get("val_accuracy_by_step", {}).items() if int(k) > 0)
    if len(curve) < evals:
        raise SystemExit(f"a run validated {len(curve)} times after training, not {evals}: --val-every")
    return statistics.mean(acc for _, acc in curve[-evals:])


def interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% t-interval)."""
    if len(values) < 2:
        return (values[0] if values else math.nan), math.inf
    return statistics.mean(values), t_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


HEADER = [
    "| setting | final accuracy (mean ± 95% CI) | base accuracy | final − bf16 (mean ± 95% CI) | "
    "seeds for ± 4 points | median token_mult_prob_error | median gen_kl_error | step time (s) |",
    "| --- " * 8 + "|",
]


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    name = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    return f"{name or platform.processor()} ({platform.machine()})"


def validation_sums(args: argparse.Namespace) -> int:
    """How many sums a run validates on: ``--val-size``, at most the held-out tenth of the pairs."""
    from fp8rl import arith

    span = range(args.max_operand + 1)
    return min(args.val_size, sum(arith.held_out(a, b) for a in span for b in span))


def commit() -> str:
    git = ["git", "rev-parse", "--short", "HEAD"]
    return subprocess.run(git, capture_output=True, text=True).stdout.strip()


def report(results: dict[str, dict[int, dict[str, Any]]], args: argparse.Namespace) -> str:
    measured = [r["measured"] for runs in results.values() for r in runs.values() if "measured" in r]
    commits = ", ".join(sorted({m["commit"] for m in measured})) or commit()
    last = max((m["date"] for m in measured), default=time.strftime("%Y-%m-%d"))
    seeds = sorted(set.intersection(*(set(r) for r in results.values())))
    lines = [
        f"Measured up to {last} at commits {commits} on {machine()}; "
        f"{len(seeds)} seeds x {validation_sums(args)} held-out validation sums each (greedy); "
        f"{args.steps} GRPO steps of {args.prompts} prompts x {args.group} samples; "
        f"`python bench/study.py --seeds {args.seeds} --steps {args.steps} --prompts {args.prompts} "
        f"--group {args.group} --val-size {args.val_size} --max-operand {args.max_operand} "
        f"--val-every {args.val_every} --final-evals {args.final_evals}`"
        + (
            f" (final accuracy: the mean of each run's last {args.final_evals} validations)."
            if args.final_evals > 1
            else "."
        ),
        "",
        *HEADER,
    ]
    bf16 = results.get("bf16", {})
    for name, runs in results.items():
        mean, half = interval([final_accuracy(runs[s], args.final_evals) for s in seeds])
        difference = needed = "—"
        if name != "bf16" and bf16:
            gaps = [
                final_accuracy(runs[s], args.final_evals) - final_accuracy(bf16[s], args.final_evals)
                for s in seeds
            ]
            d_mean, d_half = interval(gaps)
            difference = f"{d_mean:+.3f} ± {d_half:.3f}"
            needed = str(seeds_needed(gaps) or "—")

        def median(key: str, runs: dict[int, dict[str, Any]] = runs) -> float:
            values = [runs[s].get(key) for s in seeds]  # (0.0 is a value: exact mode's gen_kl_error)
            return statistics.median(math.nan if v is None else float(v) for v in values)

        base = statistics.mean(runs[s]["base_val_accuracy"] for s in seeds)
        lines.append(
            f"| `{name}` | {mean:.3f} ± {half:.3f} | {base:.3f} | {difference} | {needed} | "
            f"{median('median_token_mult_prob_error'):.5f} | {median('median_gen_kl_error'):.3g} | "
            f"{median('median_step_s'):.1f} |"
        )
    lines += ["", "Final accuracy per seed:", "", "| seed | " + " | ".join(results) + " |"]
    lines.append("| --- " * (len(results) + 1) + "|")
    for s in seeds:
        lines.append(
            f"| {s} | "
            + " | ".join(f"{final_accuracy(results[n][s], args.final_evals):.3f}" for n in results)
            + " |"
        )
    return "\n".join(lines) + "\n"


TABLE_BEGIN, TABLE_END = "<!-- bench/study.py: table -->", "<!-- bench/study.py: end of table -->"


def write_report(path: Path, table: str) -> None:
    """The table into ``path``: between its markers where the page has them (its prose stays), else the
    whole file."""
    page = path.read_text() if path.exists() else ""
    before, begin, rest = page.partition(TABLE_BEGIN)
    _, end, after = rest.partition(TABLE_END)
    if begin and end:
        table = f"{before}{TABLE_BEGIN}\n{table}{TABLE_END}{after}"
    elif TABLE_BEGIN in page or TABLE_END in page:  # (the prose would be lost)
        raise SystemExit(f"{path}: its table markers are not one begin and then one end")
    path.write_text(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=Path("models/smollm2"))
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--val-size", type=int, default=300)
    parser.add_argument("--max-operand", type=int, default=49)
    parser.add_argument("--val-every", type=int, default=2, help="validate every N steps (0: the last)")
    parser.add_argument(
        "--final-evals", type=int, default=3, help="final accuracy: the mean of the last N validations"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/study"), help="the runs' own folders")
    parser.add_argument("--summaries", type=Path, default=Path("docs/results/study-smollm2-v2"))
    parser.add_argument(
        "--report",
        type=Path,
        help="also write the table to this markdown file (between its markers where it has them)",
    )
    args = parser.parse_args(argv)
    settings = [SETTINGS[name] for name in args.settings.split(",")]
    results: dict[str, dict[int, dict[str, Any]]] = {s.name: {} for s in settings}
    for seed in range(args.seeds):  # (seed by seed: a study stopped early still pairs every setting)
        for setting in settings:
            results[setting.name][seed] = run_once(setting, seed, args)
        table = report(results, args)
        print(table, flush=True)
        if args.report:
            write_report(args.report, table)


if __name__ == "__main__":
    main()
