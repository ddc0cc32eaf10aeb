"""`trainer-service serve --model DIR --recipe fp8 ...`: parse and validate the config before the model
loads (so --help and config errors are instant), then serve until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from fp8rl.config import add_config_flags, config_from_cli
from fp8rl.devices import prefer_huge_pages
from fp8rl.security import refuse_exposure
from trainer_service.config import TrainerConfig

if TYPE_CHECKING:
    from trainer_service.distributed import Ranks


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, str]]:
    """The command line, and the flags that set config fields (argparse dest -> field: config_from_cli;
    scripts/config_reference.py documents them)."""
    parser = argparse.ArgumentParser(
        prog="trainer-service", description="GRPO learner with FP8 linears (gRPC)"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="load the model and serve Trainer on host:port")
    serve_parser.add_argument(
        "--nproc-per-node",
        type=int,
        help="ranks on this machine (one per GPU): starts them through torchrun, the model fully sharded "
        "(FSDP2) over more than one; rank 0 serves. Any number of ranks resumes any checkpoint. "
        "Several machines: `torchrun --nnodes M ... -m trainer_service.cli serve`.",
    )
    flags = add_config_flags(serve_parser, TrainerConfig)
    return parser, flags


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, str]]:
    parser, flags = build_parser()
    return parser.parse_args(argv), flags


def main(argv: list[str] | None = None) -> None:
    prefer_huge_pages()
    args, flags = parse_args(argv)
    config = config_from_cli(TrainerConfig, "trainer-service", args, flags)
    refuse_exposure("trainer-service", config.security, config.host)
    if args.nproc_per_node is not None and not launched_by_torchrun():
        start_ranks(args.nproc_per_node, sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    if config.checkpoint_dir is None:
        logging.warning(
            "no --checkpoint-dir: nothing is checkpointed, and a restarted trainer takes the run back to "
            "step 0; give it one (with --resume) for a run that survives restarts"
        )
    if launched_by_torchrun():
        from trainer_service.distributed import join_group

        ranks = join_group(config.device)
        if not ranks.is_root:
            follow_root(config, ranks)
            return
        serve(config, ranks)
        return
    serve(config)


def start_ranks(nproc: int, argv: list[str]) -> None:
    """Become torchrun, which starts ``nproc`` ranks of this same command (on a free port, this machine
    only). They watch torchrun as their parent: it is this process."""
    from fp8rl.serving import PARENT_ENV

    args = [a for i, a in enumerate(argv) if not _is_nproc_flag(argv, i)]
    os.environ[PARENT_ENV] = str(os.getpid())  # exec keeps the PID: the ranks' parent is torchrun
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    os.execv(sys.executable, [*torchrun, "-m", "trainer_service.cli", *args])


def _is_nproc_flag(argv: list[str], i: int) -> bool:
    """Whether argv[i] is --nproc-per-node or its value."""
    flag = "--nproc-per-node"
    return argv[i] == flag or argv[i].startswith(flag + "=") or (i > 0 and argv[i - 1] == flag)


def launched_by_torchrun() -> bool:
    """torchrun's agent sets TORCHELASTIC_RUN_ID for the ranks it starts (RANK / WORLD_SIZE alone may be
    inherited from a job around the coordinator)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def follow_root(config: TrainerConfig, ranks: Ranks) -> None:
    """A rank > 0: load and shard the model with the others, then run rank 0's commands until it stops.
    With ``health_port``, the first rank of each machine answers gRPC health there meanwhile (SERVING
    once loaded: its pod's probes); torchrun numbers a machine's ranks by LOCAL_RANK."""
    from trainer_service.service import TrainerService

    service = TrainerService(config, ranks=ranks)
    probes = None
    if config.health_port is not None and os.environ.get("LOCAL_RANK", "0") == "0":
        from grpc_health.v1 import health, health_pb2

        from fp8rl.serving import health_server

        status = health.HealthServicer()
        status.set("", health_pb2.HealthCheckResponse.SERVING)
        probes, bound = health_server(status, config.host, config.health_port)
        print(
            f"trainer-service rank {ranks.rank} health probes (plaintext) on {config.host}:{bound}",
            flush=True,
        )  # fp8rl.serving.HEALTH_LINE
    try:
        service.follow()
    finally:
        if probes is not None:
            probes.stop(None)


TRAINER_THREADS = 8  # calls wait for one model anyway; 4 of them stay with health and status


def serve(config: TrainerConfig, ranks: Ranks | None = None) -> None:
    """Serve Trainer: as the only process (``ranks`` None), or as rank 0 of torchrun's group."""
    from fp8rl import serving
    from fp8rl.v1 import trainer_pb2_grpc
    from trainer_service.distributed import ONE_PROCESS
    from trainer_service.service import TrainerService
    from trainer_service.servicer import SERVICE_NAME, TrainerServicer

    if config.shared_memory_updates:
        from fp8rl.codec.segments import raise_open_file_limit

        raise_open_file_limit()  # a publish holds a shared-memory segment per part of the update
    servicer = TrainerServicer(threads=TRAINER_THREADS)
    loaded: list[TrainerService] = []  # bound now, so a taken port fails before the model loads
    metrics = serving.metrics_server(
        "trainer-service", config.host, config.metrics_port, lambda: loaded[0].prometheus() if loaded else []
    )

    def load(port: int) -> tuple[str, Callable[[], None]]:
        service = TrainerService(config, ranks=ranks or ONE_PROCESS)
        servicer.attach(service)
        loaded.append(service)

        def close() -> None:
            service.stop_ranks()
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
        health_port=config.health_port,
    )


if __name__ == "__main__":
    main()
