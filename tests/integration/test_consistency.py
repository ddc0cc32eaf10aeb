"""Trainer and rollout stay numerically consistent: after PublishWeights the rollout's logprobs of its
own samples match the trainer's prev_logprobs (float32 tiny model, real CPU vLLM)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc
import torch

from fp8rl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2
from tests.conftest import InProcessRollout
from tests.support import service_process, trainer_config
from trainer_service.service import TrainerService

SAMPLING = common_pb2.SamplingParams(max_tokens=16, temperature=1.0, seed=11)


def mult_prob_errors(
    recipe: str,
    model: Path,
    stub: rollout_pb2_grpc.RolloutStub,
    address: str,
    steps: int = 1,
    kv_scales: torch.Tensor | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    **learner: object,
) -> list[float]:
    """Publish the trainer's version 0 to the rollout; then, step by step, sample from the version the
    rollout holds, train on the samples (the step's token_mult_prob_error) and publish the next version
    (a delta against what the replica holds, which must apply). ``kv_scales``: the KV-cache scales of
    every version (none calibrated). ``prompts``: token ids (default: four short texts in the tiny model's
    byte-level ids)."""
    config = trainer_config(model, recipe, **learner)  # type: ignore[arg-type]
    trainer = TrainerService(config)
    if kv_scales is not None:
        assert trainer.learner.kv_cache is not None
        trainer.learner.kv_cache.load(kv_scales)
        trainer.learner.kv_cache.calibrated = False
    held = stub.GetStatus(common_pb2.GetStatusRequest(), timeout=10).weight_version
    published = trainer.publish(
        trainer_pb2.PublishWeightsRequest(
            version=0, targets=[trainer_pb2.PublishTarget(address=address, held_version=held)]
        )
    )
    assert published.results[0].ok, published.results[0].error
    if prompts is None:
        prompts = [[4 + ord(c) for c in text] for text in ("12+34=", "7*8=", "hello", "abc")]
    errors = []
    for step in range(steps):
        reply = stub.Generate(
            rollout_pb2.GenerateRequest(
                prompts=[
                    rollout_pb2.Prompt(id=str(i), token_ids=rollout_pb2.TokenIds(ids=p))
                    for i, p in enumerate(prompts)
                ],
                n=4,
                weight_version=step,
                sampling=SAMPLING,
            ),
            timeout=120,
        )
        batch = [
            trainer_pb2.Sample(
                prompt_token_ids=c.prompt_token_ids,
                completion_token_ids=c.token_ids,
                gen_logprobs=c.logprobs,
                reward=float(c.sample_index % 2),
                group_id=c.prompt_id,
            )
            for c in reply.completions
        ]
        result = trainer.train_step(
            trainer_pb2.TrainStepRequest(run_id="consistency", step=step, samples=batch, sampling=SAMPLING)
        )
        errors.append(result.metrics.token_mult_prob_error)
        delta = trainer.publish(
            trainer_pb2.PublishWeightsRequest(
                version=step + 1, targets=[trainer_pb2.PublishTarget(address=address, held_version=step)]
            )
        )
        assert delta.results[0].ok and delta.results[0].encoding == "delta", delta.results[0]
        assert stub.GetStatus(common_pb2.GetStatusRequest(), timeout=10).weight_version == step + 1
    trainer.publisher.close()
    return errors


def mult_prob_error(recipe: str, model: Path, stub: rollout_pb2_grpc.RolloutStub, address: str) -> float:
    return mult_prob_errors(recipe, model, stub, address)[0]


def test_trainer_matches_rollout_per_recipe(
    rollout_fp8: InProcessRollout, tiny_model_dir_f32: Path, tmp_path: Path
) -> None:
    errors = {
        "fp8": mult_prob_error("fp8", tiny_model_dir_f32, rollout_fp8.stub, rollout_fp8.server.address),
        "fp8-rollout": mult_prob_error(
            "fp8-rollout", tiny_model_dir_f32, rollout_fp8.stub, rollout_fp8.server.address
        ),
    }
    bf16 = ("--recipe", "bf16", "--dtype", "float32", "--max-model-len", "256")
    with (
        service_process("rollout_service.cli", tiny_model_dir_f32, tmp_path / "bf16.log", *bf16) as (
            _,
            address,
        ),
        grpc.insecure_channel(address) as channel,
    ):
        stub = rollout_pb2_grpc.RolloutStub(channel)
        errors["bf16"] = mult_prob_error("bf16", tiny_model_dir_f32, stub, address)
    print("token_mult_prob_error per recipe:", {k: round(v, 6) for k, v in errors.items()})
    assert errors["fp8"] < 1.01 and errors["bf16"] < 1.01
    # FP8 generation with a high-precision trainer: the mismatch the FP8 trainer removes.
    assert errors["fp8-rollout"] - 1 > 5 * (errors["fp8"] - 1)


def test_fp8_kv_trainer_matches_a_replica_with_an_fp8_kv_cache(
    tiny_model_dir_f32: Path, tmp_path: Path
) -> None:
    """A replica serving fp8-kv rounds Q, K and V through E4M3 with the scales each update ships: version
    0's (1.0), then those the trainer calibrated on step 0's sequences. A trainer that attends the same way
    matches it at both; one that attends in high precision does not."""
    kv = ("--recipe", "fp8-kv", "--dtype", "float32", "--max-model-len", "256")
    with (
        service_process("rollout_service.cli", tiny_model_dir_f32, tmp_path / "kv.log", *kv) as (_, address),
        grpc.insecure_channel(address) as channel,
    ):
        stub = rollout_pb2_grpc.RolloutStub(channel)
        emulated = mult_prob_errors("fp8-kv", tiny_model_dir_f32, stub, address, steps=2)
        plain = mult_prob_errors("fp8-kv", tiny_model_dir_f32, stub, address, steps=2, emulate_kv_cache=False)
        # Scales so small that most of Q, K and V saturate: matched only if the replica uses those shipped.
        saturated = mult_prob_errors(
            "fp8-kv", tiny_model_dir_f32, stub, address, kv_scales=torch.full((2, 3), 0.002)
        )
    print("fp8-kv token_mult_prob_error:", {"emulated": emulated, "plain": plain, "saturated": saturated})
    assert all(e < 1.01 for e in emulated + saturated)
    assert min(plain) - 1 > 5 * (max(emulated) - 1)
