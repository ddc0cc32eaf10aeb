"""Exact mode's rollout on the study's work: tokens/s with vLLM's default CPU KV block (128 tokens)
against exact mode's 16, where the samples of a prompt (and prompts opening alike) share its cached KV,
in one run.

Each block size gets its own engine (a child process, so each starts from the same memory) on the same
model under ``consistency: exact``; after a warm-up it generates, ``--repeats`` times from an empty prefix
cache, a GRPO step's batch (8 chat sums x 8 samples at temperature 1, up to 16 tokens) and a validation
batch (64 other sums, greedy), the shapes of ``bench/study.py``. Printed: the best tokens/s of each
batch, the ratio of 16 to 128, and the prompt tokens taken from the cache. Both compute the same bits
(tests/integration/test_exact.py); the bench checks that too, comparing their tokens and logprobs.

    python bench/exact_rollout.py [--model models/smollm2] [--recipe fp8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fp8rl.v1 import common_pb2, rollout_pb2

BLOCK_SIZES = {"block 128 (vLLM's CPU default)": 128, "block 16 (exact mode's)": 16}


def requests() -> dict[str, rollout_pb2.GenerateRequest]:
    def sums(first: int, count: int) -> list[rollout_pb2.Prompt]:
        return [
            rollout_pb2.Prompt(
                id=str(i),
                chat=rollout_pb2.ChatMessages(
                    messages=[
                        rollout_pb2.ChatMessage(role="user", content=f"What is {i % 50} + {7 * i % 50}?")
                    ]
                ),
            )
            for i in range(first, first + count)
        ]

    return {
        "step": rollout_pb2.GenerateRequest(
            prompts=sums(0, 8),
            n=8,
            weight_version=-1,
            sampling=common_pb2.SamplingParams(max_tokens=16, temperature=1.0, seed=1),
        ),
        "validation": rollout_pb2.GenerateRequest(
            prompts=sums(100, 64),
            n=1,
            weight_version=-1,
            sampling=common_pb2.SamplingParams(max_tokens=16, temperature=0.0),
        ),
    }


def run_variant(model: Path, recipe: str, block_size: int, repeats: int) -> dict[str, dict[str, Any]]:
    """One block size in this process: its engine, a warm-up, then each batch ``repeats`` times, the
    prefix cache emptied before each round."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from fp8rl.precision import PrecisionConfig
    from rollout_service import vllm_exact
    from rollout_service.config import RolloutConfig
    from rollout_service.engine import VllmEngine
    from rollout_service.service import RolloutService

    vllm_exact.BLOCK_SIZE = block_size  # (read when the engine is built)
    config = RolloutConfig(
        model=model, recipe=recipe, port=0, dtype="float32", precision=PrecisionConfig(consistency="exact")
    )
    service = RolloutService(config, VllmEngine(config))
    batches = requests()
    list(service.generate(batches["validation"]))  # warm-up
    out: dict[str, dict[str, Any]] = {batch: {"seconds": []} for batch in batches}
    for _ in range(repeats):
        service.engine.llm.reset_prefix_cache()
        for batch, request in batches.items():
            start = time.perf_counter()
            completions = sorted(service.generate(request), key=lambda c: (int(c.prompt_id), c.sample_index))
            seconds = time.perf_counter() - start
            out[batch] |= {
                "seconds": [*out[batch]["seconds"], seconds],
                "tokens": sum(len(c.token_ids) for c in completions),
                "cached": sum(c.cached_prompt_tokens for c in completions),
                "prompt": sum(len(c.prompt_token_ids) for c in completions),
                "ids": [list(c.token_ids) for c in completions],
                "logprobs": [list(c.logprobs) for c in completions],
            }
    service.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/smollm2"))
    parser.add_argument("--recipe", default="fp8")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--block-size", type=int, help=argparse.SUPPRESS)  # (a child's one engine)
    args = parser.parse_args()
    if args.block_size:
        json.dump(run_variant(args.model, args.recipe, args.block_size, args.repeats), sys.stdout)
        return
    results = {}
    for name, block_size in BLOCK_SIZES.items():
        child = [sys.executable, __file__, "--model", str(args.model), "--recipe", args.recipe]
        child += ["--repeats", str(args.repeats), "--block-size", str(block_size)]
        done = subprocess.run(child, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-4000:]}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    first = next(iter(results.values()))
    shape = f"{args.model} under {args.recipe}, consistency exact"
    print(f"{shape}: tokens/s, best of {args.repeats} (ratio to the first)")
    for name, result in results.items():
        cells = []
        for batch in ("step", "validation"):
            b, f = result[batch], first[batch]
            if (b["ids"], b["logprobs"]) != (f["ids"], f["logprobs"]):
                raise SystemExit(f"{name}: the {batch} batch's tokens or logprobs differ from the first's")
            rate = b["tokens"] / min(b["seconds"])
            ratio = rate / (f["tokens"] / min(f["seconds"]))
            cached = f"{b['cached']}/{b['prompt']} prompt tokens cached"
            cells.append(f"{batch} {rate:6.1f} ({ratio:.2f}x; {cached})")
        print(f"{name:>30}: " + ", ".join(cells))
    print("both: the same tokens and logprob bits")


if __name__ == "__main__":
    main()
