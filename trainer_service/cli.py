"""`trainer-service serve --model DIR --recipe fp8 ...`: parse and validate the config before the model
loads (so --help and config errors are instant), then serve until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from fp8rl.config import config_from_cli
from fp8rl.recipes import RECIPE_NAMES
from trainer_service.config import TrainerConfig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="trainer-service", description="GRPO learner with FP8 linears (gRPC)"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="load the model and serve Trainer on host:port")
    serve.add_argument("--config", type=Path, help="YAML file with TrainerConfig fields")
    serve.add_argument("--model", type=Path)
    serve.add_argument("--recipe", choices=RECIPE_NAMES)
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--compute-dtype", choices=["bfloat16", "float32"])
    serve.add_argument("--checkpoint-dir", type=Path)
    serve.add_argument("--resume", action="store_true", default=None, help="restore the latest checkpoint")
    serve.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="any other config field"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    fields = ("model", "recipe", "host", "port", "compute_dtype", "checkpoint_dir", "resume")
    config = config_from_cli(TrainerConfig, "trainer-service", args, fields)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    serve(config)


def serve(config: TrainerConfig) -> None:
    from fp8rl.serving import exit_deadline, shutdown_event, start_server
    from fp8rl.v1 import trainer_pb2_grpc
    from trainer_service.service import TrainerService
    from trainer_service.servicer import SERVICE_NAME, TrainerServicer

    stop = shutdown_event()
    servicer = TrainerServicer()
    # TrainStep batches may exceed 4 MiB; the handler validates what it receives.
    running = start_server(
        lambda s: trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, s),
        [SERVICE_NAME],
        config.host,
        config.port,
        max_workers=8,
        max_receive_bytes=256 * 1024 * 1024,
    )
    print(f"trainer-service bound to {config.host}:{running.port}; loading the model", flush=True)
    service = TrainerService(config)
    servicer.attach(service)
    running.set_serving()  # health turns SERVING only now, with the model loaded (and resumed)
    print(f"trainer-service serving on {config.host}:{running.port} at step {service.step}", flush=True)
    stop.wait()
    exit_deadline()
    running.stop(grace=5)
    service.publisher.close()


if __name__ == "__main__":
    main()
