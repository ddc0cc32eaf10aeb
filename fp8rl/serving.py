"""The common edge of every gRPC server: bind, health service, reflection.

Servers bind loopback unless told otherwise; port 0 asks the OS for a free port and the bound port is
returned, so tests never race for fixed ports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer
    service_names: Sequence[str]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_serving(self, serving: bool = True) -> None:
        """Health status of the whole server and of each named service."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            self.health.set(name, status)

    def stop(self, grace: float | None = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()


def start_server(
    register: Callable[[grpc.Server], None],
    service_names: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 16,
) -> RunningServer:
    """Start a server with ``register(server)``'s servicers plus health and reflection.

    Health starts as NOT_SERVING: the caller flips it once its engine is ready.
    """
    # Default 4 MiB message limit: weight streams are chunked to fit it (fp8rl.weights.CHUNK_BYTES).
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    server.start()
    running = RunningServer(server, bound, health_servicer, service_names)
    running.set_serving(False)
    return running
