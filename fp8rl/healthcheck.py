"""`python -m fp8rl.healthcheck HOST:PORT [SERVICE] [--config YAML]`: exit 0 when the gRPC health service
says SERVING.

Used by container health checks (the services answer NOT_SERVING until their model is loaded). With
``--config``, the ``security`` section of that service config (the service's own) says how to connect:
its CA, certificate and token.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fp8rl.config import read_yaml
from fp8rl.security import SecurityConfig
from fp8rl.transport import channel


def serving(
    address: str,
    service: str = "",
    timeout: float = 3.0,
    security: SecurityConfig | None = None,
    server: Literal["trainer", "rollout"] = "rollout",
) -> bool:
    with channel(address, security, server) as chan:
        try:
            reply = health_pb2_grpc.HealthStub(chan).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fp8rl.healthcheck")
    parser.add_argument("address", help="HOST:PORT")
    parser.add_argument("service", nargs="?", default="", help="e.g. fp8rl.v1.Trainer (default: the server)")
    parser.add_argument("--config", type=Path, help="the service's YAML config: connect with its security")
    parser.add_argument(
        "--server",
        choices=["trainer", "rollout"],
        help="which kind of server (the name its certificate must show); default: from SERVICE, else rollout",
    )
    args = parser.parse_args(argv)
    security = (
        SecurityConfig.model_validate(read_yaml(args.config).get("security") or {}) if args.config else None
    )
    server: Literal["trainer", "rollout"] = args.server or (
        "trainer" if args.service.endswith("Trainer") else "rollout"
    )
    raise SystemExit(0 if serving(args.address, args.service, security=security, server=server) else 1)


if __name__ == "__main__":
    main()
