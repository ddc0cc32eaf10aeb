"""A refit through vLLM's worker-process engine (what tensor parallel > 1 uses): the worker method is
called by name, since worker processes refuse pickled Python functions. On this CPU build the engine runs
its core in a separate process at tensor parallel 1 (see test_tensor_parallel_two_on_cpu for TP 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support import load_reference, reference_logprobs, set_weights

pytestmark = pytest.mark.slow

REFIT = """
import json, sys, torch
from safetensors.torch import load_file
from fp8rl.codec.schema import build_weight_set
from rollout_service.config import RolloutConfig
from rollout_service.engine import EngineRequest, Sampling, VllmEngine

model, weights, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
engine = VllmEngine(RolloutConfig(model=model, recipe="fp8", dtype="float32", max_model_len=128,
                                  tensor_parallel_size=tp))
assert engine.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == tp
engine.load_weights(build_weight_set(load_file(weights), "fp8-block128", torch.float32).tensors)
engine.add(EngineRequest("r", [5, 6, 7, 8, 9], Sampling(0.0, 1.0, 0, 6, (), None)))
done = []
while engine.has_unfinished():
    done += engine.step()
print("RESULT " + json.dumps({"tokens": done[0].token_ids, "logprobs": done[0].logprobs}), flush=True)
"""


def refit_in_worker_processes(model: Path, state: dict[str, torch.Tensor], tmp: Path, tp: int) -> dict:
    save_file(state, tmp / "weights.safetensors")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", REFIT, str(model), str(tmp / "weights.safetensors"), str(tp)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[0].removeprefix("RESULT "))


def random_weights(model: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(11)
    return {
        k: v + v.std() * torch.randn(v.shape, generator=g) if v.ndim == 2 else v
        for k, v in load_file(model / "model.safetensors").items()
    }


def test_refit_by_name_through_a_worker_process_engine(tiny_model_dir_f32: Path, tmp_path: Path) -> None:
    state = random_weights(tiny_model_dir_f32)
    result = refit_in_worker_processes(tiny_model_dir_f32, state, tmp_path, tp=1)
    reference = load_reference(tiny_model_dir_f32, fp8=True, arithmetic="vllm")
    set_weights(reference, state, fp8=True)
    expected = reference_logprobs(reference, [5, 6, 7, 8, 9], result["tokens"])
    errors = (expected - torch.tensor(result["logprobs"], dtype=torch.float64)).abs()
    assert errors.median() < 1e-4 and errors.max() < 1e-2, errors  # the new weights, not the checkpoint's
    base = load_reference(tiny_model_dir_f32, fp8=True, arithmetic="vllm")
    assert (reference_logprobs(base, [5, 6, 7, 8, 9], result["tokens"]) - expected).abs().max() > 0.1
