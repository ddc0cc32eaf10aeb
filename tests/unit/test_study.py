"""The study's arithmetic (bench/study.py): a run's final accuracy, the seeds a +-4-point interval would
take, kept summaries refused across designs, and the table written into a page between its markers."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "study.py"
_spec = importlib.util.spec_from_file_location("study", BENCH)
assert _spec is not None and _spec.loader is not None
study = importlib.util.module_from_spec(_spec)
sys.modules["study"] = study  # (its dataclasses look their module up there)
_spec.loader.exec_module(study)


def run(curve: dict[int, float]) -> dict:
    return {
        "final_val_accuracy": curve[max(curve)],
        "val_accuracy_by_step": {str(k): v for k, v in curve.items()},
    }


def test_final_accuracy_is_the_mean_of_the_last_validations() -> None:
    curve = run({0: 0.1, 2: 0.2, 4: 0.4, 6: 0.5, 8: 0.9})  # (JSON keys: "10" sorts before "2" as text)
    curve["val_accuracy_by_step"]["10"] = 0.3
    assert study.final_accuracy(curve, 1) == 0.9  # (the summary's own last)
    assert study.final_accuracy(curve, 3) == pytest.approx((0.5 + 0.9 + 0.3) / 3)
    assert study.final_accuracy(curve, 5) == pytest.approx((0.2 + 0.4 + 0.5 + 0.9 + 0.3) / 5)
    with pytest.raises(SystemExit, match="validated 5 times after training, not 6"):
        study.final_accuracy(curve, 6)  # (step 0's validation is the base model's: never counted)
    with pytest.raises(SystemExit, match="at least one"):
        study.final_accuracy(curve, 0)


def test_t_quantiles_match_closed_forms_and_published_tables() -> None:
    assert study.t_975(1) == pytest.approx(math.tan(0.475 * math.pi), rel=1e-6)  # (Cauchy)
    assert study.t_975(2) == pytest.approx(0.95 / math.sqrt(2 * 0.975 * 0.025), rel=1e-6)
    published = {3: 3.182, 10: 2.228, 20: 2.086, 21: 2.080, 23: 2.069, 24: 2.064, 29: 2.045, 60: 2.000}
    for df, t in published.items():
        assert round(study.t_975(df), 3) == t, df
    assert 1.96 < study.t_975(1000) < 1.963 and study.t_975(0) == math.inf


def test_seeds_needed_is_the_first_count_whose_interval_is_within_the_goal() -> None:
    gaps = [0.05, -0.06, 0.02, -0.01]
    n = study.seeds_needed(gaps)
    spread = statistics.stdev(gaps)
    assert study.t_975(n - 1) * spread / math.sqrt(n) <= study.POWER
    assert study.t_975(n - 2) * spread / math.sqrt(n - 1) > study.POWER
    assert study.seeds_needed([0.1]) is None
    assert study.seeds_needed([0.0, 0.0]) == 2


def test_a_kept_summary_of_another_design_is_refused(tmp_path: Path) -> None:
    args = argparse.Namespace(
        **study.FIRST_DESIGN, out=tmp_path / "runs", summaries=tmp_path / "kept", model=tmp_path
    )
    args.summaries.mkdir()
    kept = args.summaries / "bf16-s0.json"
    kept.write_text(json.dumps(run({0: 0.1, 6: 0.5})))  # (no design: the first study's)
    assert study.run_once(study.SETTINGS["bf16"], 0, args)["final_val_accuracy"] == 0.5
    args.steps = 8
    with pytest.raises(SystemExit, match="another design"):
        study.run_once(study.SETTINGS["bf16"], 0, args)
    # A run's folder from a study of another design (or of none recorded) is refused too, not resumed.
    kept.unlink()
    old_run = args.out / "bf16-s0"
    old_run.mkdir(parents=True)
    (old_run / "summary.json").write_text(json.dumps(run({0: 0.1, 6: 0.5})))
    with pytest.raises(SystemExit, match="another design"):
        study.run_once(study.SETTINGS["bf16"], 0, args)
    (old_run / "launched.json").write_text(json.dumps({"design": study.FIRST_DESIGN, "measured": {}}))
    with pytest.raises(SystemExit, match="another design"):
        study.run_once(study.SETTINGS["bf16"], 0, args)
    assert not kept.exists()


def test_the_table_goes_between_the_pages_markers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"prose\n{study.TABLE_BEGIN}\nold table\n{study.TABLE_END}\nmore prose\n")
    study.write_report(page, "| new |\n")
    assert page.read_text() == f"prose\n{study.TABLE_BEGIN}\n| new |\n{study.TABLE_END}\nmore prose\n"
    backwards = tmp_path / "backwards.md"
    backwards.write_text(f"{study.TABLE_END}\n{study.TABLE_BEGIN}\n")
    with pytest.raises(SystemExit, match="markers"):
        study.write_report(backwards, "| new |\n")
    assert backwards.read_text() == f"{study.TABLE_END}\n{study.TABLE_BEGIN}\n"
    bare = tmp_path / "bare.md"
    study.write_report(bare, "| new |\n")
    assert bare.read_text() == "| new |\n"
