"""The step record takes the trainer's figures from TrainMetrics itself: a field added to the proto is
recorded without another list to update."""

from __future__ import annotations

from coordinator.driver import NOT_RECORDED, RECORDED_AS, trainer_figures
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
