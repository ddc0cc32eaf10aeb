"""The common edge of every gRPC server: bind, health service, reflection.

Servers bind loopback unless told otherwise; port 0 asks the OS for a free port and the bound port is
returned, so tests never race for fixed ports.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fp8rl.errors import (
    BaseMismatchError,
    Cancelled,
    CorruptUpdateError,
    InvalidRequest,
    NotReady,
    Overloaded,
    PermissionDenied,
    PreconditionFailed,
    Unauthenticated,
)

if TYPE_CHECKING:
    from fp8rl.prometheus import MetricsServer, Sample
    from fp8rl.security import SecurityConfig

log = logging.getLogger(__name__)

# Domain error -> gRPC status, most specific first. Anything else is INTERNAL (and logged).
STATUS_OF: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (CorruptUpdateError, grpc.StatusCode.INVALID_ARGUMENT),
    (BaseMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (PreconditionFailed, grpc.StatusCode.FAILED_PRECONDITION),
    (NotReady, grpc.StatusCode.UNAVAILABLE),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Cancelled, grpc.StatusCode.CANCELLED),
]

Method = TypeVar("Method", bound=Callable[..., Any])
T = TypeVar("T")


def status_of(exc: BaseException) -> grpc.StatusCode:
    return next((code for kind, code in STATUS_OF if isinstance(exc, kind)), grpc.StatusCode.INTERNAL)


# What a handler lets through unanswered: the process is stopping, or a stream's generator is being closed.
# Any other BaseException (torch.distributed.checkpoint's CheckpointException is one) is answered
# INTERNAL: grpc answers nothing for one, and the caller would wait out its deadline.
_EXITS = (KeyboardInterrupt, SystemExit, GeneratorExit)


def _abort(context: grpc.ServicerContext, exc: BaseException) -> None:
    code = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error")
    if isinstance(exc, Overloaded) and exc.transient:
        context.set_trailing_metadata(((BUSY_METADATA, "1"),))
    context.abort(code, str(exc) or type(exc).__name__)


def map_errors(method: Method) -> Method:
    """Servicer-method decorator: domain exceptions become their gRPC status; works for unary and
    server-streaming methods alike."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            try:
                yield from method(self, request, context)
            except _EXITS:
                raise
            except BaseException as exc:
                _abort(context, exc)

        return stream  # type: ignore[return-value]

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except _EXITS:
            raise
        except BaseException as exc:
            _abort(context, exc)

    return unary  # type: ignore[return-value]


class InsecureBinding(ValueError):
    """A server asked to bind beyond loopback without a way to identify its callers (or without TLS)."""


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


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def enable_reflection(server: grpc.Server, service_names: Sequence[str]) -> None:
    """Server reflection as v1alpha and v1 (some clients try v1 first). grpcio-reflection ships only
    v1alpha; v1's messages are the same on the wire, so one servicer answers both method paths. The
    listing names v1alpha only: v1's own descriptor is not in this process, so it could not be described."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    servicer = reflection.ReflectionServicer([*service_names, reflection.SERVICE_NAME])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": v1}),)
    )


class Capacity:
    """At most ``limit`` concurrent calls of one kind, so that slow or stalled calls never hold every server
    thread and health and status always get one. The last ``reserved`` slots are kept for the run's own
    calls (``slot(run=True)``): outside callers filling every other slot never make the run wait for one.

    A call that finds no slot open to it is refused (RESOURCE_EXHAUSTED), the run's at once; up to
    ``waiting`` outside calls first wait ``wait_s`` for a slot (holding a server thread each, asleep).
    Refusing at once let a flood that asks again at once cost the server a refusal per round trip:
    measured, 0.45 ms of CPU each, 340-760 a second from 12 clients, beside the engine. Waiting, a caller
    costs at most one refusal per ``wait_s`` while callers number no more than the open slots and the
    waiters (beyond that, the rest are refused at once, as before), and a well-behaved one is served
    instead. Waiters are not served in order of arrival."""

    def __init__(
        self, what: str, limit: int, reserved: int = 0, waiting: int = 0, wait_s: float = 0.0
    ) -> None:
        if not 0 <= reserved < limit:
            raise ValueError(f"{what}: {reserved} reserved slots of {limit}: leave outside callers one")
        self.what, self.limit, self.reserved = what, limit, reserved
        self.waiting, self.wait_s = waiting, wait_s
        self._free = threading.Condition()
        self._in_use = 0
        self._waiters = 0

    @property
    def in_use(self) -> int:
        return self._in_use

    def _open(self, run: bool) -> bool:
        return self._in_use < (self.limit if run else self.limit - self.reserved)

    @contextlib.contextmanager
    def slot(self, run: bool = False) -> Iterator[None]:
        with self._free:
            if not self._open(run):
                waits = not run and self._waiters < self.waiting and self.wait_s > 0
                if waits:
                    self._waiters += 1
                    try:
                        waits = self._free.wait_for(lambda: self._open(run), timeout=self.wait_s)
                    finally:
                        self._waiters -= 1
                if not waits:
                    kept = f" ({self.reserved} kept for the run's own)" if self.reserved and not run else ""
                    in_flight = f"{self.what}: {self._in_use} calls in flight already{kept}"
                    raise Overloaded(f"{in_flight}; retry later")
            self._in_use += 1
        try:
            yield
        finally:
            with self._free:
                self._in_use -= 1
                self._free.notify_all()  # (a waiter for an outside slot may not take a kept one)


def idle_limited(items: Iterable[T], context: grpc.ServicerContext, idle_s: float) -> Iterator[T]:
    """``items`` of a client stream; the RPC is cancelled (freeing its thread) when the client sends
    nothing for ``idle_s`` seconds. Only the wait for the client counts, not the time spent on an item."""
    timer: threading.Timer | None = None
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        context.cancel()

    def arm() -> None:
        nonlocal timer
        timer = threading.Timer(idle_s, expire)
        timer.daemon = True
        timer.start()

    try:
        arm()
        iterator = iter(items)
        while True:
            try:
                item = next(iterator)
            except StopIteration:
                return
            except Exception:
                if expired.is_set():  # our own cancellation: say why, without an INTERNAL traceback
                    raise Cancelled(f"the client sent nothing for {idle_s:g} s; stream cancelled") from None
                raise
            assert timer is not None
            timer.cancel()
            yield item
            arm()
    finally:
        if timer is not None:
            timer.cancel()


def read_ahead(items: Iterable[T], depth: int = 1) -> Generator[T, None, None]:
    """``items``, read on a thread of their own up to ``depth`` items ahead of the consumer: a weight
    stream's next part arrives while this one is applied. An error reading them is raised to the consumer
    in its turn; the reader stops at its next item once the consumer closes this generator (an RPC that
    ends, ends its request stream, so that item comes at once)."""
    ready: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=depth)
    stopped = threading.Event()

    def put(entry: tuple[bool, Any]) -> None:
        while not stopped.is_set():
            try:
                ready.put(entry, timeout=0.1)
                return
            except queue.Full:
                continue

    def read() -> None:
        try:
            for item in items:
                put((True, item))
                if stopped.is_set():
                    return
            put((False, None))
        except BaseException as exc:
            put((False, exc))

    threading.Thread(target=read, name="read-ahead", daemon=True).start()
    try:
        while True:
            more, value = ready.get()
            if not more:
                if value is not None:
                    raise value
                return
            yield value
    finally:
        stopped.set()


BUSY_METADATA = "fp8rl-busy"
"""Trailing metadata of a RESOURCE_EXHAUSTED answer that the same call may get served later (the server
was at a capacity, :class:`Overloaded` with ``transient``), as opposed to a request over a fixed cap or a
message over gRPC's size limit."""

FENCE_METADATA = "fp8rl-fence"
"""Call metadata carrying the coordinator's fencing token: a trainer refuses calls with an older one."""

SERVER_THREADS = 16
RESERVED_THREADS = 4
"""Server threads no capacity-limited call kind may take: health, status and reflection keep them."""


def start_server(
    register: Callable[[grpc.Server], None],
    service_names: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = SERVER_THREADS,
    max_receive_bytes: int = 4 * 1024 * 1024,
    security: SecurityConfig | None = None,
) -> RunningServer:
    """Start a server with ``register(server)``'s servicers plus health and reflection, behind
    ``security`` (TLS, caller identities and roles: :mod:`fp8rl.security`; none: loopback only).

    Health starts as NOT_SERVING: the caller flips it once its engine is ready. A server that wants to
    answer oversized messages itself (INVALID_ARGUMENT naming the field, instead of gRPC's
    RESOURCE_EXHAUSTED) raises ``max_receive_bytes`` and checks sizes in its handlers.
    """
    from fp8rl.security import (
        AccessControl,
        SecurityConfig,
        exposure_problem,
        server_credentials,
    )
    from fp8rl.transport import SERVER_KEEPALIVE

    security = security or SecurityConfig()
    problem = exposure_problem(security, host)
    if problem:
        raise InsecureBinding(problem)
    options = [("grpc.max_receive_message_length", max_receive_bytes), *SERVER_KEEPALIVE]
    # Calls beyond the threads wait in gRPC's queue, up to a bound; past it gRPC answers RESOURCE_EXHAUSTED.
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=options,
        maximum_concurrent_rpcs=4 * max_workers,
        interceptors=[AccessControl(security)],
    )
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, [*service_names, health.SERVICE_NAME])
    credentials = server_credentials(security)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    server.start()
    running = RunningServer(server, bound, health_servicer, service_names)
    running.set_serving(False)
    return running


BOUND_LINE = r"bound to (\S+:\d+);"
"""What :func:`serve` prints once bound (group 1: HOST:PORT): a parent that started a service on port 0
reads its port there, so no other process could take a port picked free beforehand."""
HEALTH_LINE = r"health probes \(plaintext\) on (\S+:\d+)\n"
"""What :func:`serve` (and a trainer rank > 0) prints for its plaintext health probes (group 1: HOST:PORT)."""


def serve(
    prog: str,
    register: Callable[[grpc.Server], None],
    service_names: Sequence[str],
    host: str,
    port: int,
    load: Callable[[int], tuple[str, Callable[[], None]]],
    max_workers: int = SERVER_THREADS,
    max_receive_bytes: int = 4 * 1024 * 1024,
    security: SecurityConfig | None = None,
    health_port: int | None = None,
) -> None:
    """The life of a service process. Bind first ("PROG bound to HOST:PORT", which a parent reads to learn
    a port-0 choice; health NOT_SERVING), then ``load(port)`` the engine and attach it (returning a line to
    print and a cleanup), then serve ("PROG serving on ...") until SIGINT/SIGTERM or the parent process is
    gone, and stop within a deadline. ``health_port``: the same health statuses also in plaintext there
    (:func:`health_server`)."""
    running = start_server(register, service_names, host, port, max_workers, max_receive_bytes, security)
    probes = None
    if health_port is not None:
        probes, bound = health_server(running.health, host, health_port)
        print(f"{prog} health probes (plaintext) on {host}:{bound}", flush=True)  # HEALTH_LINE
    print(f"{prog} bound to {host}:{running.port}; loading", flush=True)  # BOUND_LINE
    stop = shutdown_event()  # a signal while loading stops the process once loading is done
    try:
        detail, cleanup = load(running.port)
        stop.install_handlers()  # again: vLLM installs signal handlers of its own while it starts
        stop.serving = True
        running.set_serving()
        print(f"{prog} serving on {host}:{running.port}{detail}", flush=True)
        stop.wait()
        exit_deadline()
    finally:
        running.stop(grace=5)
        if probes is not None:
            probes.stop(None)
    cleanup()


class _CheckOnly(health_pb2_grpc.HealthServicer):
    """Health's Check, answered from another servicer's statuses; no Watch (a stream per caller, and a
    status kept for every name asked about: not for callers nobody identified)."""

    def __init__(self, statuses: health.HealthServicer) -> None:
        self.statuses = statuses

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.statuses.Check(request, context)

    def Watch(self, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "this port answers Check only")


def health_server(servicer: health.HealthServicer, host: str, port: int) -> tuple[grpc.Server, int]:
    """A plaintext server answering gRPC health's Check alone, with ``servicer``'s statuses (the main
    server's), for probes that speak no TLS, such as Kubernetes' native gRPC probes. Nothing else is
    served there and no identity is asked: whether a service is SERVING is all it tells. Returns it and
    its port."""
    from fp8rl.transport import SERVER_KEEPALIVE

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        options=[("grpc.max_receive_message_length", 4096), *SERVER_KEEPALIVE],
        maximum_concurrent_rpcs=64,  # past that a caller is refused at once; a Check takes microseconds
    )
    health_pb2_grpc.add_HealthServicer_to_server(_CheckOnly(servicer), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the health server to {host}:{port}")
    server.start()
    return server, bound


def metrics_server(
    prog: str, host: str, port: int | None, samples: Callable[[], list[Sample]]
) -> MetricsServer | None:
    """Prometheus /metrics on host:port when a port is configured (printed: 0 picks one)."""
    if port is None:
        return None
    from fp8rl.prometheus import MetricsServer

    server = MetricsServer(host, port, samples)
    print(f"{prog} Prometheus metrics on http://{host}:{server.port}/metrics", flush=True)
    return server


PARENT_ENV = "FP8RL_PARENT_PID"


class Shutdown:
    """Set by SIGINT / SIGTERM or by a watcher thread; ``wait`` returns once either happened.

    The signal handler only flips a flag: setting a ``threading.Event`` from a handler can deadlock, as
    the handler may interrupt the main thread while it holds that very Event's lock.
    """

    def __init__(self) -> None:
        self.signalled = False
        self.serving = False  # until then, a dead parent ends the process at once (nothing to drain)
        self._event = threading.Event()

    def install_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: setattr(self, "signalled", True))

    def request(self) -> None:
        self._event.set()

    def wait(self) -> None:
        while not self.signalled and not self._event.wait(0.5):
            pass


def shutdown_event() -> Shutdown:
    """What a server waits on to stop cleanly (install from the main thread).

    A process started by a coordinator (``FP8RL_PARENT_PID`` in its environment) also stops when that
    parent is gone, whatever happened to the signal it was sent meanwhile: no orphan outlives its run.
    """
    stop = Shutdown()
    stop.install_handlers()
    parent = os.environ.get(PARENT_ENV)
    if parent:
        threading.Thread(
            target=_watch_parent, args=(int(parent), stop), name="parent-watch", daemon=True
        ).start()
    return stop


def exit_deadline(seconds: float = 20.0) -> None:
    """Once shutdown has begun, end the process after ``seconds`` even if something still blocks."""

    def force() -> None:
        log.error("shutdown did not finish within %.0fs; exiting now", seconds)
        os._exit(1)

    timer = threading.Timer(seconds, force)
    timer.daemon = True
    timer.start()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch_parent(parent: int, stop: Shutdown) -> None:
    while not stop.signalled:
        if os.getppid() != parent:
            log.warning("parent process %d is gone; shutting down", parent)
            if not stop.serving:  # still loading: no request to finish, and loading may take minutes
                os._exit(1)
            stop.request()
            return
        time.sleep(1.0)
