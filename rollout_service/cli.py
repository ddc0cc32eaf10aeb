"""`rollout-service serve --model DIR --recipe fp8 ...`: parse and validate the config before vLLM is
imported (so --help and config errors are instant), then serve until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from fp8rl.config import config_from_cli
from fp8rl.recipes import RECIPE_NAMES
from rollout_service.config import RolloutConfig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rollout-service", description="vLLM rollout server (gRPC)")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="load the model and serve Rollout on host:port")
    serve.add_argument("--config", type=Path, help="YAML file with RolloutConfig fields")
    serve.add_argument("--model", type=Path)
    serve.add_argument("--recipe", choices=RECIPE_NAMES)
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--dtype")
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--kv-cache-gib", type=float)
    serve.add_argument("--tensor-parallel-size", type=int)
    serve.add_argument("--redis-url")
    serve.add_argument("--advertise", help="host:port other processes use to reach this replica")
    serve.add_argument("--http-port", type=int, help="serve the OpenAI-compatible HTTP API on this port")
    serve.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="any other config field"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    fields = (
        "model",
        "recipe",
        "host",
        "port",
        "dtype",
        "max_model_len",
        "kv_cache_gib",
        "tensor_parallel_size",
        "redis_url",
        "advertise",
        "http_port",
    )
    config = config_from_cli(RolloutConfig, "rollout-service", args, fields)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rollout %(levelname)s %(message)s")
    serve(config)


def serve(config: RolloutConfig) -> None:
    from fp8rl.serving import exit_deadline, shutdown_event, start_server
    from fp8rl.v1 import rollout_pb2_grpc
    from rollout_service.engine import VllmEngine
    from rollout_service.service import RolloutService
    from rollout_service.servicer import SERVICE_NAME, RolloutServicer

    servicer = RolloutServicer()
    # Oversized requests reach the handler, which names the field (INVALID_ARGUMENT).
    running = start_server(
        lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, s),
        [SERVICE_NAME],
        config.host,
        config.port,
        max_receive_bytes=64 * 1024 * 1024,
    )
    print(f"rollout-service bound to {config.host}:{running.port}; loading the engine", flush=True)
    http = None
    if config.http_port is not None:
        from rollout_service.openai_api import HttpServer, build_app

        http = HttpServer(config.host, config.http_port)  # bound now: a taken port fails before vLLM loads
    service = RolloutService(config, VllmEngine(config))
    stop = shutdown_event()  # after the engine: vLLM installs signal handlers of its own while it starts
    servicer.attach(service)
    heartbeat = None
    if config.redis_url:
        import redis

        from fp8rl.registry import Heartbeat

        info = {"model": str(config.model), "recipe": config.recipe}
        heartbeat = Heartbeat(
            redis.Redis.from_url(config.redis_url), str(config.advertise), info, config.heartbeat_s
        )
    if http:
        http.serve(build_app(service, config.model_name))
        print(f"rollout-service OpenAI-compatible HTTP on {config.host}:{http.port}", flush=True)
    running.set_serving()  # health turns SERVING only now, with the engine loaded
    print(f"rollout-service serving on {config.host}:{running.port}", flush=True)
    stop.wait()
    exit_deadline()
    if heartbeat:
        heartbeat.stop()
    if http:
        http.stop()
    running.stop(grace=5)
    service.loop.stop()


if __name__ == "__main__":
    main()
