"""`rollout-service serve --model DIR --recipe fp8 ...`: parse and validate the config before vLLM is
imported (so --help and config errors are instant), then serve until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from fp8rl.config import add_config_flags, config_from_cli
from fp8rl.devices import prefer_huge_pages
from rollout_service.config import RolloutConfig


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, str]]:
    """The command line, and the flags that set config fields (argparse dest -> field: config_from_cli;
    scripts/config_reference.py documents them)."""
    parser = argparse.ArgumentParser(prog="rollout-service", description="vLLM rollout server (gRPC)")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="load the model and serve Rollout on host:port")
    flags = add_config_flags(serve_parser, RolloutConfig)
    return parser, flags


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, str]]:
    parser, flags = build_parser()
    return parser.parse_args(argv), flags


def main(argv: list[str] | None = None) -> None:
    prefer_huge_pages()
    args, flags = parse_args(argv)
    config = config_from_cli(RolloutConfig, "rollout-service", args, flags)
    from fp8rl.credentials import PASSWORD_IN_URL, has_password
    from fp8rl.security import is_loopback, refuse_exposure
    from rollout_service.engine import Platform, unsupported_reason

    if has_password(config.redis_url):
        print(PASSWORD_IN_URL.format(prog="rollout-service"), file=sys.stderr)
    refuse_exposure("rollout-service", config.security, config.host, applies_updates=True)
    refuse_unreadable_high_water(config)
    if config.http_port is not None and not is_loopback(config.host) and config.security.tokens_file is None:
        print(
            "rollout-service: the HTTP endpoint beyond loopback needs security.tokens_file (its callers send "
            "`Authorization: Bearer <token>`)",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        reason = unsupported_reason(config, Platform.here(config.device))
    except ValueError as exc:  # (device cuda where torch sees none)
        reason = str(exc)
    if reason:
        print(f"rollout-service: {reason}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rollout %(levelname)s %(message)s")
    serve(config)


def refuse_unreadable_high_water(config: RolloutConfig) -> None:
    """Exit with status 2 before vLLM loads when the high-water file is there but no mark."""
    from fp8rl.security import signer_id
    from rollout_service.high_water import read_mark

    public_key, path = config.security.update_public_key(), config.security.update_high_water_file
    if public_key is None or path is None:
        return
    try:
        read_mark(path, signer_id(public_key))
    except (ValueError, OSError) as exc:
        print(f"rollout-service: {exc}", file=sys.stderr)
        sys.exit(2)


def serve(config: RolloutConfig) -> None:
    from fp8rl import serving
    from fp8rl.v1 import rollout_pb2_grpc
    from rollout_service.engine import VllmEngine
    from rollout_service.service import RolloutService
    from rollout_service.servicer import SERVICE_NAME, RolloutServicer

    servicer = RolloutServicer(
        generate_slots=config.max_concurrent_generate,
        run_slots=config.run_generate_slots,
        wait_s=config.generate_wait_s,
    )
    http = None
    if config.http_port is not None:
        from rollout_service.openai_face import HttpServer

        http = HttpServer(config.host, config.http_port)  # bound now: a taken port fails before vLLM loads

    loaded: list[RolloutService] = []  # bound now, so a taken port fails before vLLM loads
    metrics = serving.metrics_server(
        "rollout-service", config.host, config.metrics_port, lambda: loaded[0].prometheus() if loaded else []
    )

    def load(port: int) -> tuple[str, Callable[[], None]]:
        address = config.advertise or f"{config.host}:{port}"
        service = RolloutService(config, VllmEngine(config), address)
        servicer.attach(service)
        loaded.append(service)
        heartbeat = None
        if config.redis_url:
            from fp8rl.redis_link import connect
            from fp8rl.registry import Heartbeat

            # (No registration proof here: one expires within minutes; GetStatus makes a fresh one.)
            info = {"model": str(config.model), "recipe": config.recipe}
            from fp8rl.credentials import redis_url_with_password

            # Each beat fails within one interval rather than hang on a Redis that vanished without a
            # word (a killed container), and the next beat dials again.
            url = redis_url_with_password(config.redis_url)
            client = connect(url, timeout_s=config.heartbeat_s, retries=0)
            heartbeat = Heartbeat(client, str(config.advertise), info, config.heartbeat_s)
        if http:
            from rollout_service.openai_face import build_app

            http.serve(build_app(service, config.model_name, config.security), config.security)
            host = config.advertise.rsplit(":", 1)[0] if config.advertise else config.host
            service.http_address = f"{host}:{http.port}"
            print(f"rollout-service OpenAI-compatible HTTP on {config.host}:{http.port}", flush=True)

        def close() -> None:
            if heartbeat:
                heartbeat.stop()
            if http:
                http.stop()
            if metrics:
                metrics.stop()
            service.close()

        return "", close

    # Oversized requests reach the handler, which names the field (INVALID_ARGUMENT).
    serving.serve(
        "rollout-service",
        lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, s),
        [SERVICE_NAME],
        config.host,
        config.port,
        load,
        max_receive_bytes=64 * 1024 * 1024,
        max_workers=serving.SERVER_THREADS + servicer.generating.waiting,  # (the waiting calls' own)
        security=config.security,
        health_port=config.health_port,
    )


if __name__ == "__main__":
    main()
