"""`coordinator compare`: the FP8 study in miniature — each recipe from the same base model and seed,
then one table (compare.md) and overlaid plots."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from coordinator.config import CoordinatorConfig, over
from coordinator.metrics import read_metrics, summarize
from fp8rl.config import format_validation_error

COLUMNS = [
    ("final val accuracy", "final_val_accuracy", "{:.3f}"),
    ("base val accuracy", "base_val_accuracy", "{:.3f}"),
    ("median token_mult_prob_error", "median_token_mult_prob_error", "{:.5f}"),
    ("max token_mult_prob_error", "max_token_mult_prob_error", "{:.5f}"),
    ("median gen_kl_error", "median_gen_kl_error", "{:.2e}"),
    ("median routing_mismatch", "median_routing_mismatch", "{:.4f}"),  # (MoE models only)
    ("rollout tokens/s", "median_rollout_tokens_per_s", "{:.0f}"),
    ("step time (s)", "median_step_s", "{:.2f}"),
    ("sync bytes / step", "median_sync_bytes", "{:,.0f}"),
]


def compare(base: CoordinatorConfig, recipes: list[str], no_is: bool, out_dir: Path | None) -> int:
    from coordinator.report import write_plots
    from coordinator.run import start

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = (out_dir or Path("runs") / f"compare-{stamp}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    for recipe in recipes:
        changes: dict[str, Any] = {
            "recipe": recipe,
            "run_id": f"{out.name}-{recipe}{'-no-is' if no_is else ''}",
            "run_dir": out / recipe,
        }
        if no_is:
            changes["learner"] = {"loss": {"is_mode": "none"}}
        try:
            config = CoordinatorConfig.model_validate(over(base.model_dump(), changes))
        except ValidationError as exc:
            print(f"coordinator: {format_validation_error(exc)}", file=sys.stderr)
            return 2
        status = start(config)
        if status != 0:
            return status
        runs[recipe] = read_metrics(out / recipe)
    table = render(runs, base, no_is)
    (out / "compare.md").write_text(table)
    plots = write_plots([], out, runs=runs)
    print(table)
    for plot in plots:
        print(f"plot: {plot}")
    return 0


def render(runs: dict[str, list[dict[str, Any]]], base: CoordinatorConfig, no_is: bool) -> str:
    lines = [
        f"# Recipes compared: {', '.join(runs)}",
        "",
        f"Task `{base.task.name}`, {base.run.steps} GRPO steps of {base.sampling.prompts_per_step} prompts x "
        f"{base.sampling.group_size} samples, seed {base.run.seed}, importance sampling "
        f"{'off' if no_is else 'per recipe (TIS, cap 2, for FP8 recipes)'}.",
        "",
    ]
    summaries = {recipe: summarize(records) for recipe, records in runs.items()}
    columns = [c for c in COLUMNS if any(s[c[1]] is not None for s in summaries.values())]  # (MoE's)
    lines += [
        "| recipe | " + " | ".join(c[0] for c in columns) + " |",
        "| --- | " + " | ".join("---" for _ in columns) + " |",
    ]
    for recipe, summary in summaries.items():
        cells = [fmt.format(summary[key]) if summary[key] is not None else "-" for _, key, fmt in columns]
        lines.append(f"| `{recipe}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
