"""A replica runs vLLM compiled, as `vllm serve` does by default, wherever its arithmetic allows
(rollout_service/engine.py, eager_reason), and a refit reaches what the compiled graph computes with: the
graph reads the weights each update brings, never a copy taken when it was captured. Checked on a tied
model, whose output layer shares the embedding (on CPU it computes through a handle made from the weight,
which the refit must make anew), after a keyframe and after a delta."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from fp8rl.codec.schema import build_weight_set
from fp8rl.codec.testing import encode_delta, encode_keyframe
from fp8rl.v1 import rollout_pb2_grpc
from rollout_service.config import RolloutConfig
from rollout_service.engine import eager_reason
from tests.integration.test_rollout import push, request
from tests.support import load_reference, reference_logprobs, service_process, set_weights


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``state`` with every matrix moved by 0.3 of its spread: a model as sane as the first, and clearly
    another one."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: v + 0.3 * v.std() * torch.randn(v.shape, generator=g) if v.ndim == 2 else v
        for k, v in state.items()
    }


def test_compiled_where_the_arithmetic_allows_it(family_checkpoints: dict[str, Path]) -> None:
    dense, moe = family_checkpoints["llama-tied-576"], family_checkpoints["qwen3-moe"]
    assert eager_reason(RolloutConfig(model=dense, recipe="bf16"), "cpu") is None
    assert eager_reason(RolloutConfig(model=dense, recipe="bf16"), "cuda") is None
    assert "FP8 emulation" in (eager_reason(RolloutConfig(model=dense, recipe="fp8"), "cpu") or "")
    assert "FP8 emulation" in (eager_reason(RolloutConfig(model=dense, recipe="fp8-kv"), "cpu") or "")
    exact = RolloutConfig.model_validate(
        {"model": dense, "recipe": "bf16", "precision": {"consistency": "exact"}}
    )
    assert "exact" in (eager_reason(exact, "cpu") or "")
    assert "routing recorder" in (eager_reason(RolloutConfig(model=moe, recipe="bf16"), "cpu") or "")


@pytest.mark.slow  # (a compiled engine: about 30 s to start on 2 cores)
def test_a_compiled_replica_computes_with_the_weights_each_refit_brings(
    family_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    model = family_checkpoints["llama-tied-576"]
    log = tmp_path / "rollout.log"
    args = ("--recipe", "bf16", "--dtype", "float32", "--max-model-len", "256")
    base = load_file(model / "model.safetensors")
    states = [base, perturbed(base, 1), perturbed(base, 2)]
    sets = [build_weight_set(s, "bf16", hp_dtype=torch.float32) for s in states]
    reference = load_reference(model, fp8=False)
    prompt = [17, 4024, 312, 1195, 28, 9, 733, 4400, 61, 2000]
    with (
        service_process("rollout_service.cli", model, log, *args) as (_, address),
        grpc.insecure_channel(address) as channel,
    ):
        assert "enforce_eager=False" in log.read_text()  # (vLLM logs its config)
        stub = rollout_pb2_grpc.RolloutStub(channel)
        for version, update in ((1, encode_keyframe(sets[1], 1)), (2, encode_delta(sets[2], sets[1], 2, 1))):
            assert push(stub, update).version == version
            reply = stub.Generate(request([prompt], n=1, max_tokens=16, temperature=0.0), timeout=120)
            completion = reply.completions[0]
            got = torch.tensor(list(completion.logprobs))
            errors = []
            for state in (states[version], states[version - 1]):
                set_weights(reference, state, fp8=False)
                errors.append(
                    (reference_logprobs(reference, prompt, list(completion.token_ids)) - got).abs().max()
                )
            print(
                f"version {version}: max |logprob - float64| under its weights {errors[0]:.1e}, "
                f"under the version before {errors[1]:.1e}"
            )
            # float32 arithmetic in a compiled graph: ~1e-6 of float64; stale weights: ~1e-1 and more.
            assert errors[0] < 1e-4 < 1e-2 < errors[1], errors
