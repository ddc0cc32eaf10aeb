"""How closely the two engines agree: the rollout's logprob of each token it sampled against the
trainer's recompute of it, per recipe and setting, at version 0 and after refits.

For each configuration it starts a replica (``rollout-service serve``, real vLLM on CPU, in a child
process) and a trainer in this process, publishes version 0, then for ``--steps`` steps samples chat sums
("What is 7 + 12?") at temperature 1, trains on the samples and publishes the next version as a delta.
Printed, one row per configuration and step, all measured in this run: median and mean
``token_mult_prob_error``, ``gen_kl_error``, the largest |trainer - rollout| logprob and the share of
tokens whose logprobs are bit-identical, with the rollout's tokens/s and the trainer's step time.

    python bench/consistency.py --model models/smollm2 --recipes bf16,fp8 [--steps 2]
        [--consistency default,exact] [--dtype float32] [--layers 0,1,2,4]

``--layers N,...`` keeps the first N and the last N decoder layers in high precision, one setting per N
(``--first-layers`` / ``--last-layers`` set either alone); the table's FP8 share is the fraction of the
block linears' weights that then run in FP8.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAMPLING: dict[str, Any] = {"temperature": 1.0, "max_tokens": 16, "seed": 7}


@dataclass(frozen=True)
class Setting:
    recipe: str
    consistency: str
    dtype: str
    first_layers: int
    last_layers: int

    def label(self) -> str:
        knobs = f" first={self.first_layers} last={self.last_layers}"
        return f"{self.recipe} {self.consistency} {self.dtype}" + (
            knobs if self.first_layers or self.last_layers else ""
        )

    def precision(self) -> dict[str, Any]:
        return {
            "consistency": self.consistency,
            "high_precision_first_layers": self.first_layers,
            "high_precision_last_layers": self.last_layers,
        }


def prompts(count: int, seed: int) -> list[list[dict[str, str]]]:
    import random

    rng = random.Random(seed)
    return [
        [{"role": "user", "content": f"What is {rng.randrange(20)} + {rng.randrange(20)}?"}]
        for _ in range(count)
    ]


def measure(setting: Setting, model: Path, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    import grpc
    import torch

    from coordinator.embedded import as_sets
    from coordinator.processes import Child, python_module, wait_healthy
    from fp8rl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2
    from trainer_service.config import TrainerConfig
    from trainer_service.service import TrainerService

    log = work / f"rollout-{time.monotonic_ns()}.log"
    precision = setting.precision()
    rollout = Child(
        "rollout",
        python_module(
            "rollout_service.cli",
            "serve",
            "--model",
            str(model),
            "--recipe",
            setting.recipe,
            "--dtype",
            setting.dtype,
            "--port",
            "0",
            "--max-model-len",
            "512",
            *as_sets({"precision": precision}),
        ),
        log,
    )
    rows = []
    from fp8rl.architectures import fp8_share, read_config
    from fp8rl.precision import PrecisionConfig
    from fp8rl.recipes import get_recipe

    plan = PrecisionConfig.model_validate(precision).plan(model)
    share = fp8_share(read_config(model), plan) if get_recipe(setting.recipe).fp8_rollout else 0.0
    try:
        address = rollout.bound_address()
        wait_healthy(rollout, address, "rollout")
        trainer = TrainerService(
            TrainerConfig(
                model=model,
                recipe=setting.recipe,
                compute_dtype=setting.dtype,
                port=0,
                micro_batch_size=args.micro_batch,
                precision=precision,
            )
        )
        sampling = common_pb2.SamplingParams(**SAMPLING)
        with grpc.insecure_channel(address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            held = stub.GetStatus(common_pb2.GetStatusRequest(), timeout=10).weight_version
            target = trainer_pb2.PublishTarget(address=address, held_version=held)
            published = trainer.publish(trainer_pb2.PublishWeightsRequest(version=0, targets=[target]))
            if not published.results[0].ok:
                raise RuntimeError(published.results[0].error)
            for step in range(args.steps):
                request = rollout_pb2.GenerateRequest(
                    prompts=[
                        rollout_pb2.Prompt(id=str(i), chat=rollout_pb2.ChatMessages(messages=m))
                        for i, m in enumerate(prompts(args.prompts, seed=step))
                    ],
                    n=args.n,
                    weight_version=step,
                    sampling=sampling,
                )
                start = time.perf_counter()
                reply = stub.Generate(request, timeout=1800)
                generate_s = time.perf_counter() - start
                tokens = sum(len(c.token_ids) for c in reply.completions)
                samples = [
                    trainer_pb2.Sample(
                        prompt_token_ids=c.prompt_token_ids,
                        completion_token_ids=c.token_ids,
                        gen_logprobs=c.logprobs,
                        reward=float(c.sample_index % 2),
                        group_id=c.prompt_id,
                    )
                    for c in reply.completions
                ]
                scored = trainer.compute_logprobs(
                    trainer_pb2.ComputeLogprobsRequest(
                        sequences=[
                            trainer_pb2.TokenSequence(
                                prompt_token_ids=c.prompt_token_ids, completion_token_ids=c.token_ids
                            )
                            for c in reply.completions
                        ],
                        sampling=sampling,
                    )
                )
                gen = torch.tensor([lp for c in reply.completions for lp in c.logprobs], dtype=torch.float32)
                prev = torch.tensor([lp for r in scored.results for lp in r.logprobs], dtype=torch.float32)
                start = time.perf_counter()
                request = trainer_pb2.TrainStepRequest(
                    run_id="consistency", step=step, samples=samples, sampling=sampling
                )
                result = trainer.train_step(request)
                train_s = time.perf_counter() - start
                delta = (prev.double() - gen.double()).abs()
                per_token = torch.exp(delta)
                rows.append(
                    {
                        "setting": setting.label(),
                        "fp8_share": share,
                        "version": step,
                        "median_mult": float(per_token.median()),
                        "mean_mult": result.metrics.token_mult_prob_error,
                        "gen_kl": result.metrics.gen_kl_error,
                        "max_abs": float(delta.max()),
                        "identical": float((prev == gen).double().mean()),
                        "tokens": tokens,
                        "rollout_tok_s": tokens / generate_s,
                        "train_s": train_s,
                    }
                )
                print(_format(rows[-1]), flush=True)
                update = trainer.publish(
                    trainer_pb2.PublishWeightsRequest(
                        version=step + 1,
                        targets=[trainer_pb2.PublishTarget(address=address, held_version=step)],
                    )
                )
                if not update.results[0].ok:
                    raise RuntimeError(update.results[0].error)
        trainer.publisher.close()
    finally:
        rollout.stop()
    return rows


HEADER = (
    "| setting | FP8 share | version | median token_mult_prob_error | mean | gen_kl_error | "
    "max abs Δ logprob | bit-identical tokens | tokens | rollout tok/s | train step (s) |\n"
    + "| --- " * 11
    + "|"
)


def _format(row: dict[str, Any]) -> str:
    return (
        f"| {row['setting']} | {row['fp8_share']:.3f} | {row['version']} | {row['median_mult']:.6f} | "
        f"{row['mean_mult']:.6f} | "
        f"{row['gen_kl']:.3g} | {row['max_abs']:.3g} | {row['identical']:.4f} | {row['tokens']} | "
        f"{row['rollout_tok_s']:.1f} | {row['train_s']:.1f} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=Path("models/smollm2"))
    parser.add_argument("--recipes", default="bf16,fp8")
    parser.add_argument("--consistency", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", help="N,...: the first and the last N layers in high precision")
    parser.add_argument("--first-layers", default="0")
    parser.add_argument("--last-layers", default="0")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        sys.exit(f"{args.model}: no config.json (make smollm2 converts SmolLM2-135M-Instruct there)")
    knobs = (
        [(int(n), int(n)) for n in args.layers.split(",")]
        if args.layers
        else [(int(f), int(la)) for f in args.first_layers.split(",") for la in args.last_layers.split(",")]
    )
    settings = [
        Setting(r, c, d, first, last)
        for r, c, d, (first, last) in itertools.product(
            args.recipes.split(","), args.consistency.split(","), args.dtype.split(","), knobs
        )
    ]
    rows = []
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="fp8rl-consistency-") as work:
        for setting in settings:
            rows += measure(setting, args.model, args, Path(work))
    print("\n" + HEADER)
    for row in rows:
        print(_format(row))
    medians: dict[str, list[float]] = {r["setting"]: [] for r in rows}
    for r in rows:
        medians[r["setting"]].append(r["mean_mult"])
    median = {k: round(statistics.median(v), 6) for k, v in medians.items()}
    print("\nmedian token_mult_prob_error over versions:", median)


if __name__ == "__main__":
    main()
