"""Exact consistency (``precision.consistency: exact``): the rollout's logprob of every token it sampled
equals the trainer's recompute bit for bit, at version 0 and after a refit, in every supported family
(random float32 models at realistic shapes with SmolLM2's tokenizer; real CPU vLLM in a child process,
the real trainer here); and a request's tokens and logprobs do not depend on what else is in the
engine's batch."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from fp8rl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2
from tests.families import FAMILIES, LLAMA_BF16_STORED, QWEN3_MOE, Family
from tests.integration.test_architectures import prompts
from tests.integration.test_consistency import mult_prob_errors
from tests.support import service_process, trainer_config
from trainer_service.service import TrainerService

EXACT = {"consistency": "exact"}
ROLLOUT_ARGS = ("--dtype", "float32", "--max-model-len", "256", "--set", "precision.consistency=exact")

# Every family under FP8 weights (FP8 block linears beside high-precision ones: the LM head, routers,
# and q/k/v off the 128-grid in the tied 576 model): Llama stored in bfloat16 as real checkpoints are,
# with the FP8 KV cache; Qwen3 with power-of-two scales; the others under fp8. The high-precision
# paths of a dense and an MoE model under bf16 (vLLM's unquantized experts are another method).
NAMED = {f.name: f for f in FAMILIES}
TIED = NAMED["llama-tied-576"]
CASES = [(LLAMA_BF16_STORED, "fp8-kv"), (NAMED["qwen3-tied"], "fp8-pow2")]
CASES += [(NAMED[name], "fp8") for name in ("llama-tied-576", "mistral", "qwen2", "qwen3-moe")]
CASES += [(TIED, "bf16"), (QWEN3_MOE, "bf16")]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "recipe"), CASES, ids=lambda x: getattr(x, "name", x))
def test_every_sampled_token_matches_bit_for_bit(
    family: Family,
    recipe: str,
    family_checkpoints: dict[str, Path],
    tmp_path: Path,
) -> None:
    model = family_checkpoints[family.name]
    with (
        service_process(
            "rollout_service.cli", model, tmp_path / "rollout.log", "--recipe", recipe, *ROLLOUT_ARGS
        ) as (
            _,
            address,
        ),
        grpc.insecure_channel(address) as channel,
    ):
        stub = rollout_pb2_grpc.RolloutStub(channel)
        if family is TIED and recipe == "fp8":  # (before any update: the replica holds the checkpoint)
            batch_invariance(stub, model, recipe)
        # (token_mult_prob_error is the mean of exp|prev - gen| >= 1: exactly 1.0 only if every token's is)
        errors = mult_prob_errors(
            recipe, model, stub, address, steps=2, prompts=prompts(model), precision=EXACT
        )
    print(f"{family.name} {recipe} exact: token_mult_prob_error at version 0 and after a refit: {errors}")
    assert errors == [1.0, 1.0]


def batch_invariance(stub: rollout_pb2_grpc.RolloutStub, model: Path, recipe: str) -> None:
    """One prompt alone, then the same prompt first among 16, 4 samples each (64 requests; its first
    sample has the lone request's seed): the same tokens and the same logprob bits, which the trainer
    (the checkpoint's weights, as the replica's) recomputes in either batch. The second time its samples
    take the prompt's whole KV blocks from the prefix cache (two blocks of 16 of its 42 tokens) that the
    lone request computed."""
    sampling = common_pb2.SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    texts = [[5 + (7 * i + j) % 900 for j in range(3 + i % 11)] for i in range(15)]
    target = [17, 401, 23, 99, 1024, 7] * 7

    def generate(batch: list[list[int]]) -> list[rollout_pb2.Completion]:
        reply = stub.Generate(
            rollout_pb2.GenerateRequest(
                prompts=[
                    rollout_pb2.Prompt(id=str(i), token_ids=rollout_pb2.TokenIds(ids=p))
                    for i, p in enumerate(batch)
                ],
                n=4 if len(batch) > 1 else 1,
                sampling=sampling,
            ),
            timeout=300,
        )
        return list(reply.completions)

    alone = generate([target])[0]
    crowd = [c for c in generate([target, *texts]) if c.prompt_id == "0"]
    assert len(alone.token_ids) > 3
    for c in crowd:  # (every sample of a prompt draws from its own seeded stream: the same first sample)
        assert list(c.prompt_token_ids) == target
    assert alone.cached_prompt_tokens == 0
    assert [c.cached_prompt_tokens for c in crowd] == [32] * 4
    first = next(c for c in crowd if c.sample_index == 0)
    assert list(first.token_ids) == list(alone.token_ids)
    assert list(first.logprobs) == list(alone.logprobs)
    trainer = TrainerService(trainer_config(model, recipe, precision=EXACT))
    scored = trainer.compute_logprobs(
        trainer_pb2.ComputeLogprobsRequest(
            sequences=[
                trainer_pb2.TokenSequence(
                    prompt_token_ids=c.prompt_token_ids, completion_token_ids=c.token_ids
                )
                for c in crowd
            ],
            sampling=sampling,
        )
    )
    assert [list(r.logprobs) for r in scored.results] == [list(c.logprobs) for c in crowd]
    assert len({tuple(c.token_ids) for c in crowd}) > 1  # (four samples, four seeds)
    trainer.publisher.close()
