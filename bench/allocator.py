"""Trainer step time with glibc's malloc, which hands freed memory back to the kernel, and with jemalloc.

A CPU trainer step allocates and frees gigabytes. glibc maps every block of 32 MiB or more on its own, and
a pool thread's arena (gRPC runs each call on one) maps whatever exceeds its 64 MiB heaps: freed, they go
back to the kernel, and the next step faults them in again, 4 KiB at a time, each page zeroed (``perf``:
the kernel's ``clear_page_erms``, a fifth of a step). Each setting is one child process started with its
environment (``LD_PRELOAD`` takes effect only at a process's start):

- ``shipped``: glibc, with huge pages as the entry points ask (fp8rl.devices.prefer_huge_pages);
- ``jemalloc``: jemalloc preloaded, never purging what is freed (where the library is installed, as
  redis-server's package installs it).

Neither keeps memory well yet. glibc told to keep it (one arena, no mappings, no trimming) fragmented:
the same step's process grew past 11 GB and was killed; on smaller shapes it grew 2 to 7 times its live
memory. jemalloc never purging, SmolLM2 bf16 on 2 cores (2026-12-07): 0.83x the step time (27.6 s against
33.4; system CPU 2.6 s against 12.9) and the same weights, but resident after each step 11.3, 12.6,
13.8 GB (glibc: 6.0, 7.2, 7.9; ``narenas:1`` changed nothing): kept growing, so it is not shipped.

Each child loads the model, runs a warm-up and ``--steps`` timed GRPO steps (Learner.train, on a pool
thread as the gRPC service runs them) on the same random batch, and reports per step: wall seconds, user
and system CPU seconds, minor page faults, resident memory after it; its peak; and a hash of the weights
after the last step, which both must share (the allocator changes no arithmetic). Printed: each
setting's figures and its step time over ``shipped``'s, measured in this one run. Run it alone: a
trainer step of SmolLM2 holds several GB.

    python bench/allocator.py --model models/smollm2 [--recipe bf16] [--samples 64] [--steps 3]
"""

from __future__ import annotations

import argparse
import ctypes.util
import hashlib
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

JEMALLOC = ctypes.util.find_library("jemalloc")  # (its soname, which LD_PRELOAD finds; None: not installed)
BASE_ENV = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}  # as `make` and the Dockerfile start processes
SETTINGS: dict[str, dict[str, str]] = {
    "shipped": {},
    "jemalloc": {"LD_PRELOAD": JEMALLOC or "", "MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"},
}


def child(args: argparse.Namespace) -> None:
    from fp8rl.devices import prefer_huge_pages

    prefer_huge_pages()  # first thing, as the services do
    from transformers import AutoConfig

    from fp8rl.recipes import get_recipe
    from fp8rl.sampling import SamplingSettings
    from trainer_service.config import TrainerConfig
    from trainer_service.learner import Learner, SampleData

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    draw = random.Random(0)
    samples = [  # the study's shape: 8 prompts x 8 samples, a ~40-token chat prompt, 16 new tokens
        SampleData(
            [draw.randrange(vocab) for _ in range(40)],
            [draw.randrange(vocab) for _ in range(16)],
            [-1.0] * 16,
            reward=float(draw.random() < 0.5),
            group=str(i // 8),
        )
        for i in range(args.samples)
    ]
    config = TrainerConfig(
        model=args.model, recipe=args.recipe, compute_dtype="float32", micro_batch_size=64, seed=0
    )
    learner = Learner(config, get_recipe(args.recipe))
    pool = ThreadPoolExecutor(4)  # gRPC runs each call on one of its pool's threads

    def step() -> dict[str, float]:
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        pool.submit(learner.train, samples, SamplingSettings()).result()
        after = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "wall_s": time.perf_counter() - start,
            "user_s": after.ru_utime - before.ru_utime,
            "sys_s": after.ru_stime - before.ru_stime,
            "faults": after.ru_minflt - before.ru_minflt,
            "rss_gb": int(Path("/proc/self/statm").read_text().split()[1])
            * os.sysconf("SC_PAGE_SIZE")
            / 2**30,
        }

    step()  # warm-up
    steps = [step() for _ in range(args.steps)]
    weights = hashlib.sha256()
    for name, tensor in sorted(learner.model.state_dict().items()):
        weights.update(name.encode() + tensor.detach().float().contiguous().numpy().tobytes())
    report: dict = {
        key: statistics.median(s[key] for s in steps) for key in ("wall_s", "user_s", "sys_s", "faults")
    }
    report["rss_gb"] = [round(s["rss_gb"], 2) for s in steps]  # after each step: does it keep growing?
    report["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    report["weights"] = weights.hexdigest()[:16]
    print("REPORT " + json.dumps(report), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--recipe", default="bf16")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    settings = [s for s in args.settings.split(",") if s != "jemalloc" or JEMALLOC]
    unset = ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_CONF", "THP_MEM_ALLOC_ENABLE")
    reports = {}
    for setting in settings:
        env = {k: v for k, v in os.environ.items() if k not in unset} | BASE_ENV | SETTINGS[setting]
        command = [sys.executable, __file__, "--child", "--model", str(args.model)]
        command += ["--recipe", args.recipe]
        command += ["--samples", str(args.samples), "--steps", str(args.steps)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
        if done.returncode != 0 or not lines:
            raise SystemExit(f"{setting}: exit {done.returncode}\n{done.stderr[-3000:]}")
        reports[setting] = json.loads(lines[-1].removeprefix("REPORT "))
    base = reports[settings[0]]["wall_s"]
    print(f"{args.recipe}, {args.samples} samples, median of {args.steps} steps after a warm-up:")
    for setting, r in reports.items():
        print(
            f"  {setting:9} {r['wall_s']:6.2f} s/step ({r['wall_s'] / base:.2f}x)  user {r['user_s']:6.2f} s"
            f"  sys {r['sys_s']:5.2f} s  {r['faults']:>9,.0f} faults  peak {r['peak_rss_gb']:.2f} GB"
            f"  weights {r['weights']}  resident after each step (GB): {r['rss_gb']}"
        )
    if len({r["weights"] for r in reports.values()}) != 1:
        raise SystemExit("the settings' weights differ: an allocator must not change the arithmetic")


if __name__ == "__main__":
    main()
