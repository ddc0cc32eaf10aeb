"""`trainer-service serve --model DIR --recipe fp8 ...`: parse and validate the config before the model
loads (so --help and config errors are instant), then serve until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from fp8rl.config import add_config_flags, config_from_cli
from fp8rl.security import refuse_exposure
from trainer_service.config import TrainerConfig


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, str]]:
    parser = argparse.ArgumentParser(
        prog="trainer-service", description="GRPO learner with FP8 linears (gRPC)"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="load the model and serve Trainer on host:port")
    flags = add_config_flags(serve_parser, TrainerConfig)
    return parser.parse_args(argv), flags


def main(argv: list[str] | None = None) -> None:
    args, flags = parse_args(argv)
    config = config_from_cli(TrainerConfig, "trainer-service", args, flags)
    refuse_exposure("trainer-service", config.security, config.host)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    if config.checkpoint_dir is None:
        logging.warning(
            "no --checkpoint-dir: nothing is checkpointed, and a restarted trainer takes the run back to "
            "step 0; give it one (with --resume) for a run that survives restarts"
        )
    serve(config)


TRAINER_THREADS = 8  # calls wait for one model anyway; 4 of them stay with health and status


def serve(config: TrainerConfig) -> None:
    from fp8rl import serving
    from fp8rl.v1 import trainer_pb2_grpc
    from trainer_service.service import TrainerService
    from trainer_service.servicer import SERVICE_NAME, TrainerServicer

    servicer = TrainerServicer(threads=TRAINER_THREADS)
    loaded: list[TrainerService] = []  # bound now, so a taken port fails before the model loads
    metrics = serving.metrics_server(
        "trainer-service", config.host, config.metrics_port, lambda: loaded[0].prometheus() if loaded else []
    )

    def load(port: int) -> tuple[str, Callable[[], None]]:
        service = TrainerService(config)
        servicer.attach(service)
        loaded.append(service)

        def close() -> None:
            service.publisher.close()
            if metrics:
                metrics.stop()

        return f" at step {service.step}", close

    serving.serve(
        "trainer-service",
        lambda s: trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, s),
        [SERVICE_NAME],
        config.host,
        config.port,
        load,
        max_workers=TRAINER_THREADS,
        max_receive_bytes=256 * 1024 * 1024,  # TrainStep batches may exceed 4 MiB; the handler checks them
        security=config.security,
    )


if __name__ == "__main__":
    main()
