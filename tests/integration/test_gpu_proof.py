"""scripts/gpu_proof.py as the bare GPU host runs it, here on the CPU: in an interpreter that cannot import
pydantic, zstandard, vLLM, Transformer Engine, grpc or yaml (tests/unit/test_torch_only.py), it exits 0 with
the CUDA checks skipped for the reason and the others passed; and its CUDA checks' own code runs, with
the CPU in the GPU's place (--dry-run-on-cpu)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_torch_only import script_lines


def proof_lines(*args: str) -> list[str]:
    return script_lines("scripts/gpu_proof.py", *args)


def outcome(lines: list[str], check: str) -> str:
    return next(line for line in lines if line.split(" ", 2)[1] == check)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA host the CUDA checks run instead")
def test_on_the_cpu_the_cuda_checks_skip_and_the_rest_passes() -> None:
    lines = proof_lines()
    assert lines[0].startswith("gpu_proof: Python") and "no CUDA device" in lines[0]
    for check in "ac":
        assert outcome(lines, check).startswith(f"PASS {check} "), outcome(lines, check)
    for check in "bdefghi":
        assert outcome(lines, check).startswith(f"SKIP {check} "), outcome(lines, check)
        assert "no CUDA device (torch.cuda.is_available() is False)" in outcome(lines, check)
    assert "none of pydantic, zstandard, vllm, transformer_engine" in outcome(lines, "a")
    assert "blocks come back byte for byte" in outcome(lines, "c")
    assert lines[-1].startswith("gpu_proof: 2 PASS, 0 FAIL, 7 SKIP")


def test_the_cuda_checks_code_runs_with_the_cpu_in_the_gpus_place() -> None:
    lines = proof_lines("--dry-run-on-cpu")
    assert "DRY RUN" in lines[0] and "DRY RUN" in lines[-1]
    for check in "abcefghi":
        assert outcome(lines, check).startswith(f"PASS {check} "), outcome(lines, check)
    assert outcome(lines, "d").startswith("SKIP d ") and "no CPU kernel" in outcome(lines, "d")
    assert "of the bound" in outcome(lines, "e") and "codes equal 2/2" in outcome(lines, "f")
    assert "fp8 blockwise unavailable" in outcome(lines, "g")
    assert "bit-identical" in outcome(lines, "h") and "a row alone = in a batch" in outcome(lines, "h")
    assert "GLOO broadcast to cpu bit for bit" in outcome(lines, "i")
