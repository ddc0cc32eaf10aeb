"""PNG plots of a run (reward, validation accuracy, token_mult_prob_error per step) and of several runs
side by side (coordinator compare)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def write_plots(
    records: list[dict[str, Any]], out_dir: Path, runs: dict[str, list[dict[str, Any]]] | None = None
) -> list[Path]:
    """One PNG per metric; with ``runs`` (label -> records) each chart overlays every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = runs or {"": records}
    paths = []
    for key, title in (
        ("reward_mean", "reward (mean over samples)"),
        ("val_accuracy", "validation accuracy"),
        ("token_mult_prob_error", "token_mult_prob_error (1 = rollout and trainer agree)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, recs in series.items():
            xs, ys = _series(recs, key)
            ax.plot(xs, ys, marker="o", markersize=3, label=label or None)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if runs:
            ax.legend()
        path = out_dir / f"{key}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
