"""Trainer step time with emulated FP8 linears against the same step without them, on the same batch.

One Learner per recipe (``bf16``: no FP8; ``fp8``: every block linear fake-quantized — weights 128x128,
activations and output gradients 1x128) on the same model and samples, float32 compute, learning rate
small enough that the weights barely move. Printed: seconds per TrainStep of each (median of the
interleaved repeats, after a warm-up) and their ratio, measured in this one run. Only the CPU emulation is
measured here; on CUDA the ``te`` backend runs real FP8 GEMMs.

    python bench/fp8_train_step.py [--model DIR] [--samples 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from fp8rl import arith
from fp8rl.recipes import get_recipe
from fp8rl.sampling import SamplingSettings
from fp8rl.tiny import encode, write_tiny_model
from trainer_service.config import TrainerConfig
from trainer_service.learner import Learner, SampleData


def arith_samples(count: int) -> list[SampleData]:
    """Right answers with made-up logprobs and rewards: the step's cost does not depend on them."""
    pairs = arith.train_pairs(random.Random(0), count)
    out = []
    for i, (a, b) in enumerate(pairs):
        completion = encode(arith.answer(a, b) + "\n")
        prompt = encode(arith.prompt(a, b))
        out.append(SampleData(prompt, completion, [-0.5] * len(completion), float(i % 3 == 0), str(i // 8)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = args.model or write_tiny_model(Path(tempfile.mkdtemp()) / "tiny", dtype="float32")
    samples = arith_samples(args.samples)
    learners = {
        recipe: Learner(
            TrainerConfig(
                model=model,
                recipe=recipe,
                compute_dtype="float32",
                micro_batch_size=args.micro_batch_size,
                optimizer={"lr": 1e-9},
            ),
            get_recipe(recipe),
        )
        for recipe in ("bf16", "fp8")
    }
    seconds: dict[str, list[float]] = {recipe: [] for recipe in learners}
    for learner in learners.values():
        learner.train(samples, SamplingSettings())  # warm-up
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits both alike
        for recipe, learner in learners.items():
            start = time.perf_counter()
            learner.train(samples, SamplingSettings())
            seconds[recipe].append(time.perf_counter() - start)
    median = {recipe: statistics.median(times) for recipe, times in seconds.items()}
    tokens = sum(len(s.completion) for s in samples)
    print(f"batch: {args.samples} samples, {tokens} completion tokens, micro-batch {args.micro_batch_size}")
    print(f"  no FP8 (bf16 recipe, float32 compute): {median['bf16']:.3f} s/step")
    print(f"  emulated FP8 (fp8 recipe):             {median['fp8']:.3f} s/step")
    print(f"emulated FP8 / no FP8 step time: {median['fp8'] / median['bf16']:.2f}")


if __name__ == "__main__":
    main()
