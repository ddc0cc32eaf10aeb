"""Generate throughput over gRPC against the same engine called in-process, on the same batch.

Both paths drive one engine (the tiny model unless --model is given): first the handler is called
directly, then the same request goes through a real gRPC server on loopback. Printed: tokens/s of each
and their ratio (target >= 0.97), measured in this one run after a warm-up.

    python bench/rollout_throughput.py [--model DIR] [--recipe fp8] [--prompts 32] [--n 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from fp8rl.serving import start_server
from fp8rl.tiny import write_tiny_model
from fp8rl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from rollout_service.config import RolloutConfig
from rollout_service.engine import VllmEngine
from rollout_service.service import RolloutService
from rollout_service.servicer import SERVICE_NAME, RolloutServicer


def batch(prompts: int, n: int, max_tokens: int) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(id=str(i), text=f"{i}+{2 * i + 7}=") for i in range(prompts)],
        n=n,
        weight_version=-1,
        # ignore_eos is not on the wire: a fixed seed and a fixed batch give both paths the same work.
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1),
    )


def tokens_per_s(run: Callable[[], list[rollout_pb2.Completion]]) -> tuple[float, int]:
    start = time.perf_counter()
    completions = run()
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in completions)
    return tokens / seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--recipe", default="fp8")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = args.model or write_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    config = RolloutConfig(model=model, recipe=args.recipe, port=0)
    service = RolloutService(config, VllmEngine(config))
    servicer = RolloutServicer(service)
    running = start_server(
        lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, s), [SERVICE_NAME]
    )
    request = batch(args.prompts, args.n, args.max_tokens)
    with grpc.insecure_channel(running.address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        in_process = lambda: list(service.generate(request))  # noqa: E731
        over_grpc = lambda: list(stub.Generate(request).completions)  # noqa: E731
        in_process(), over_grpc()  # warm-up
        results: dict[str, list[float]] = {"in-process": [], "gRPC": []}
        for _ in range(args.repeats):  # interleaved, so drift in machine load hits both alike
            for name, run in (("in-process", in_process), ("gRPC", over_grpc)):
                rate, tokens = tokens_per_s(run)
                results[name].append(rate)
    best = {name: max(rates) for name, rates in results.items()}
    shape = f"{args.prompts} prompts x n={args.n}, max_tokens={args.max_tokens}"
    print(f"batch: {shape}, {tokens} tokens, recipe {args.recipe}")
    for name, rate in best.items():
        print(f"{name:>10}: {rate:8.1f} tokens/s (best of {args.repeats})")
    print(f"ratio gRPC / in-process: {best['gRPC'] / best['in-process']:.3f}")
    running.stop(0)
    service.loop.stop()


if __name__ == "__main__":
    main()
