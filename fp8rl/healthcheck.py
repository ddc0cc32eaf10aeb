"""`python -m fp8rl.healthcheck HOST:PORT [SERVICE]`: exit 0 when the gRPC health service says SERVING.

Used by container health checks (the services answer NOT_SERVING until their model is loaded).
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def serving(address: str, service: str = "", timeout: float = 3.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        raise SystemExit("usage: python -m fp8rl.healthcheck HOST:PORT [SERVICE]")
    address, service = args[0], args[1] if len(args) == 2 else ""
    raise SystemExit(0 if serving(address, service) else 1)


if __name__ == "__main__":
    main()
