"""scripts/gpu_checks.py on a host without CUDA: ``--help`` answers, and in an interpreter that cannot import
pydantic, zstandard, vLLM, Transformer Engine, grpc or yaml (tests/unit/test_torch_only.py) it imports and
runs, every check skipping with its reason; with the project's packages the MoE refit check (e) runs on the
CPU, and fails where a replica would hold other scales than were sent."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.test_torch_only import script_lines

ROOT = Path(__file__).resolve().parents[2]


def torch_only(*args: str) -> list[str]:
    return script_lines("scripts/gpu_checks.py", *args)


def test_help_answers_with_the_checks() -> None:
    text = "\n".join(torch_only("--help"))
    assert (
        "usage: gpu_checks.py" in text and "(e) MoE expert refits" in text and "(f) MoE expert GEMMs" in text
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA host the CUDA checks run instead")
def test_with_torch_alone_and_no_cuda_every_check_skips_with_its_reason() -> None:
    lines = torch_only()
    verdicts = {line.split(":")[0] for line in lines if line.split(" ")[0] in ("PASS", "FAIL", "SKIP")}
    assert all(v.startswith("SKIP") for v in verdicts), verdicts
    refits = next(line for line in lines if line.startswith("SKIP e "))
    assert "the codec cannot be imported (pydantic is not installed" in refits, refits
    for check in ("a quantizers", "d GEMM time", "f MoE expert block-FP8 GEMMs"):
        assert f"SKIP {check}: no CUDA device" in "\n".join(lines), check


@pytest.mark.skipif(torch.cuda.is_available(), reason="(on CUDA the same check quantizes on the GPU)")
def test_the_moe_refit_check_runs_on_the_cpu_and_catches_a_wrong_scale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checks: dict[str, Any] = runpy.run_path(str(ROOT / "scripts" / "gpu_checks.py"))
    figure = checks["moe_refits"](experts=3, hidden=256, intermediate=128)
    assert "all 9 expert linears' codes and scales as sent" in figure, figure
    held = checks["received"]["fp8-block128-pow2"]
    assert len(held) == 18 and held["model.layers.0.mlp.experts.2.down_proj.weight_scale_inv"].shape == (2, 1)
    swapped = dict(held)
    a, b = (f"model.layers.0.mlp.experts.{e}.up_proj.weight_scale_inv" for e in (0, 1))
    swapped[a], swapped[b] = held[b], held[a]
    with pytest.raises(AssertionError, match=r"experts\.0\.up_proj: scales differ from sent"):
        checks["check_experts"](swapped, held, 3, "pow2")
