"""The trainer on 1 rank (the model whole) and 2 (sharded; CPU, gloo): step time and memory per rank for
the same global batch, measured in one run and printed side by side.

A Qwen2-shaped model of about 30 M parameters (8 layers, hidden 512) is written to a temporary directory;
each rank count runs under torchrun (one thread per rank), trains 2 warm-up and 3 timed GRPO steps on the
same 32 samples, and reports per rank: the median step time, the bytes of its shards of the float32
weights, gradients and AdamW state (16 bytes per parameter over the ranks), and its peak resident memory.

    python bench/trainer_ranks.py [--recipe fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def write_model(out: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fp8rl.tiny import ARCHITECTURE, build_tokenizer

    torch.manual_seed(0)
    bigger = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8}
    config = Qwen2Config(**(ARCHITECTURE | bigger), vocab_size=4096)  # the tiny model's shape, grown
    Qwen2ForCausalLM(config).save_pretrained(out)
    build_tokenizer().save_pretrained(out)


def rank_main(model: Path, recipe: str, out: Path) -> None:
    from fp8rl.recipes import get_recipe
    from fp8rl.sampling import sampling_settings
    from fp8rl.v1 import common_pb2
    from trainer_service.config import TrainerConfig
    from trainer_service.distributed import join_group, leave_group
    from trainer_service.learner import Learner, SampleData

    ranks = join_group()
    config = TrainerConfig(model=model, recipe=recipe, compute_dtype="float32", port=0, micro_batch_size=8)
    learner = Learner(config, get_recipe(recipe), ranks)
    g = torch.Generator().manual_seed(0)
    samples = [
        SampleData(
            torch.randint(4, 4000, (32,), generator=g).tolist(),
            torch.randint(4, 4000, (32,), generator=g).tolist(),
            [-1.0] * 32,
            float(i % 2),
            f"g{i // 8}",
        )
        for i in range(32)
    ]
    sampling = sampling_settings(common_pb2.SamplingParams())
    times = []
    for step in range(5):
        start = time.perf_counter()
        learner.train(samples, sampling)
        if step >= 2:
            times.append(time.perf_counter() - start)
    local = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in learner.model.parameters()
    )
    report = {
        "rank": ranks.rank,
        "step_s": statistics.median(times),
        "state_bytes": local * 16,  # float32 weight + gradient + AdamW's two moments
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    (out / f"rank{ranks.world}-{ranks.rank}.json").write_text(json.dumps(report))
    leave_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="fp8")
    parser.add_argument("--rank", nargs=3, metavar=("MODEL", "RECIPE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(Path(args.rank[0]), args.rank[1], Path(args.rank[2]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model, out = Path(tmp) / "model", Path(tmp)
        write_model(model)
        for world in (1, 2):
            run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
            env = {**os.environ, "OMP_NUM_THREADS": str(2 // world), "PYTHONPATH": str(ROOT)}
            subprocess.run([*run, __file__, "--rank", str(model), args.recipe, str(out)], check=True, env=env)
        reports = {w: [json.loads((out / f"rank{w}-{r}.json").read_text()) for r in range(w)] for w in (1, 2)}
    params = reports[1][0]["state_bytes"] // 16
    print(f"model: {params / 1e6:.1f} M parameters, recipe {args.recipe}, 32 samples of 64 tokens, 2 cores")
    print(f"{'ranks':>5} {'threads/rank':>12} {'step s':>7} {'state MB/rank':>13} {'peak RSS MB/rank':>16}")
    for world, ranks in reports.items():
        step = max(r["step_s"] for r in ranks)
        state = max(r["state_bytes"] for r in ranks) / 1e6
        rss = max(r["peak_rss_bytes"] for r in ranks) / 1e6
        print(f"{world:5d} {2 // world:12d} {step:7.2f} {state:13.1f} {rss:16.1f}")
    one, two = reports[1][0], reports[2]
    print(
        f"2 ranks vs 1: step time {max(r['step_s'] for r in two) / one['step_s']:.2f}x, "
        f"state per rank {max(r['state_bytes'] for r in two) / one['state_bytes']:.2f}x, "
        f"peak RSS per rank {max(r['peak_rss_bytes'] for r in two) / one['peak_rss_bytes']:.2f}x"
    )


if __name__ == "__main__":
    main()
