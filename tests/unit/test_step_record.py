"""The step record takes the trainer's figures from TrainMetrics itself: a field added to the proto is
recorded without another list to update; a run's summary reads the records."""

from __future__ import annotations

from coordinator.driver import NOT_RECORDED, RECORDED_AS, trainer_figures
from coordinator.metrics import summarize
from fp8rl.v1 import trainer_pb2


def test_every_trainer_figure_is_recorded_under_its_name_unless_listed() -> None:
    fields = trainer_pb2.TrainMetrics.DESCRIPTOR.fields
    every = trainer_pb2.TrainMetrics(
        **{f.name: [3, 4] if f.is_repeated else 2.5 if f.type == f.TYPE_DOUBLE else 7 for f in fields}
    )
    figures = trainer_figures(every)
    expected = {RECORDED_AS.get(f.name, f.name) for f in fields if f.name not in NOT_RECORDED}
    assert figures.keys() == expected
    assert figures["trained_tokens"] == 7 and figures["abs_log_ratio_counts"] == [3, 4]
    assert figures["routing_mismatch"] == 2.5
    unset = trainer_figures(trainer_pb2.TrainMetrics(loss=1.0))
    assert "routing_mismatch" not in unset and unset["loss"] == 1.0  # optional: only when measured


def test_a_runs_summary_has_its_accuracy_curve_and_the_medians_of_its_steps() -> None:
    records = [{"step": 0, "val_accuracy": 0.1}]
    for step, (train_s, generate_s) in enumerate([(30.0, 5.0), (50.0, 9.0), (40.0, 7.0)], start=1):
        timing = {"train_s": train_s, "generate_s": generate_s, "step_s": train_s + 10}
        records.append({"step": step, "token_mult_prob_error": 1.0 + step / 100, **timing})
    records[2]["val_accuracy"], records[3]["val_accuracy"] = 0.3, 0.4
    summary = summarize(records)
    assert summary["steps"] == 3 and summary["base_val_accuracy"] == 0.1
    assert summary["final_val_accuracy"] == 0.4
    assert summary["val_accuracy_by_step"] == {"0": 0.1, "2": 0.3, "3": 0.4}
    assert (summary["median_train_s"], summary["median_generate_s"], summary["median_step_s"]) == (40, 7, 50)
    assert summary["median_publish_s"] is None  # (not recorded: no median)
    assert (summary["median_token_mult_prob_error"], summary["max_token_mult_prob_error"]) == (1.02, 1.03)
