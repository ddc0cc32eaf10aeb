"""`rollout-service serve` as a real child process: health only once the engine is loaded, reflection,
status, bf16 numerics, Redis registration with an expiring heartbeat, clean exit on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import urllib.request
from pathlib import Path

import grpc
import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fp8rl.registry import live_replicas
from fp8rl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from tests.support import child_process, free_port, load_reference, redis_server, wait_for_line


def test_serve_bf16_with_registration(tiny_model_dir_f32: Path, tmp_path: Path) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    with redis_server(tmp_path) as redis_url:
        args = [
            sys.executable,
            "-m",
            "rollout_service.cli",
            "serve",
            "--model",
            str(tiny_model_dir_f32),
            "--recipe",
            "bf16",
            "--dtype",
            "float32",
            "--port",
            str(port),
            "--max-model-len",
            "256",
            "--redis-url",
            redis_url,
            "--advertise",
            address,
            "--http-port",
            "0",
            "--metrics-port",
            "0",
        ]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        log = tmp_path / "rollout.log"
        with child_process(args, log, env) as proc, grpc.insecure_channel(address) as channel:
            wait_for_line(proc, log, r"bound to")
            health = health_pb2_grpc.HealthStub(channel)
            stub = rollout_pb2_grpc.RolloutStub(channel)
            if "serving on" not in log.read_text():  # still loading: not yet serving
                status = health.Check(
                    health_pb2.HealthCheckRequest(service="fp8rl.v1.Rollout"), timeout=5
                ).status
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            wait_for_line(proc, log, r"serving on")
            http_port = re.search(r"OpenAI-compatible HTTP on 127.0.0.1:(\d+)", log.read_text()).group(1)  # type: ignore[union-attr]
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=10) as models:
                assert [m["id"] for m in json.load(models)["data"]] == [tiny_model_dir_f32.name]
            assert (
                health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                == health_pb2.HealthCheckResponse.SERVING
            )

            status = stub.GetStatus(common_pb2.GetStatusRequest(), timeout=10)
            assert (status.recipe, status.weight_format, status.device, status.weight_version) == (
                "bf16",
                "bf16",
                "cpu",
                -1,
            )
            assert status.engine.startswith("vllm ")

            client = redis.Redis.from_url(redis_url)
            replicas = live_replicas(client)
            assert replicas[address]["recipe"] == "bf16"

            prompts = [[4 + ord(c) for c in s] for s in ("12+34=", "hello")]
            req = rollout_pb2.GenerateRequest(
                prompts=[
                    rollout_pb2.Prompt(id=str(i), token_ids=rollout_pb2.TokenIds(ids=p))
                    for i, p in enumerate(prompts)
                ],
                n=2,
                weight_version=-1,
                sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0.7, top_k=50, seed=4),
            )
            metrics_url = re.search(r"Prometheus metrics on (http://\S+)", log.read_text()).group(1)  # type: ignore[union-attr]
            before = scrape(metrics_url)
            reply = stub.Generate(req, timeout=120)
            after = scrape(metrics_url)
            assert after["fp8rl_rollout_requests_total"] == before["fp8rl_rollout_requests_total"] + 1
            tokens = sum(len(c.token_ids) for c in reply.completions)
            assert (
                after["fp8rl_rollout_tokens_generated_total"] - before["fp8rl_rollout_tokens_generated_total"]
                == tokens
            )
            assert (
                after["fp8rl_rollout_weight_version"] == -1 and after["fp8rl_rollout_requests_in_flight"] == 0
            )
            reference = load_reference(tiny_model_dir_f32, fp8=False)
            errors = []
            for c in reply.completions:
                # Logprobs of the distribution sampled from: temperature 0.7, then top-50 renormalised.
                with torch.no_grad():
                    logits = (
                        reference(torch.tensor([list(c.prompt_token_ids) + list(c.token_ids)]))
                        .logits[0]
                        .double()
                    )
                logits = logits[len(c.prompt_token_ids) - 1 : -1] / 0.7
                kth = logits.topk(50, dim=-1).values[:, -1:]
                renorm = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
                ref = renorm.gather(1, torch.tensor(list(c.token_ids))[:, None]).squeeze(1)
                errors.append((ref - torch.tensor(list(c.logprobs), dtype=torch.float64)).abs())
            mean = torch.cat(errors).mean().item()
            print(f"bf16 recipe: mean |logprob - transformers| = {mean:.2e}")
            assert mean < 1e-4

            os.killpg(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
            assert address not in live_replicas(client)


def scrape(url: str) -> dict[str, float]:
    """A /metrics page's samples, by name."""
    with urllib.request.urlopen(url, timeout=10) as page:
        lines = page.read().decode().splitlines()
    return {line.split()[0]: float(line.split()[1]) for line in lines if line and not line.startswith("#")}
