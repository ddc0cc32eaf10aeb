"""Code the coordinator does not own, run in worker processes: a ``--reward`` function, an ``--env``
environment's episodes, and math-verify. Code that hangs, crashes, leaks or raises then costs the one
sample it was computing (the caller scores it 0, counts it and records an event), never the run.

A pool's worker is ``python -m coordinator.user_code`` in a session of its own (a terminal's Ctrl-C is
the coordinator's), talking over two pipes. It calls ``module:factory(*args)`` once, then answers calls
of what the factory returned, one at a time. A worker is started when a call finds none idle (at most
``workers``), stopped by PID and reaped, and dies with the pool's one spawning thread (PR_SET_PDEATHSIG
follows the thread that started a process: the callers' threads come and go), so a killed coordinator
leaves none behind. Each call is bounded:

* in time: the caller waits ``deadline_s`` for the reply, then kills and reaps the worker (the next call
  starts a fresh one);
* in memory: the worker's data (heap and private mappings, RLIMIT_DATA) is capped at ``memory_mb``; an
  allocation past it raises MemoryError there, and the worker is replaced;
* in what comes back: a worker that dies mid-call (a segfault, ``os._exit``, the kernel's OOM killer)
  is reaped and replaced.

Each of these raises :class:`CallFailed` in the caller, saying which. A factory that fails (an import
error) is the run's configuration, not a sample's: RuntimeError.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import math
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

from coordinator.problems import CallFailed

RewardFn = Callable[[str, str, str], float]

STARTUP_S = 120.0  # a worker imports its factory's module (sympy, openai...) before it answers
PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])


class WorkerPool:
    """``pool(*args)``: ``module:factory(*factory_args)(*args)`` in a worker process, from any thread, at
    most ``workers`` at a time. Raises :class:`CallFailed`. ``close()`` kills the workers."""

    def __init__(
        self,
        factory: str,
        factory_args: tuple[Any, ...] = (),
        *,
        name: str,
        workers: int,
        deadline_s: float,
        memory_mb: int,
    ) -> None:
        self.factory, self.factory_args, self.name = factory, factory_args, name
        self.deadline_s, self.memory_mb = deadline_s, memory_mb
        self._slots = threading.BoundedSemaphore(workers)
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="user-code-spawner")

    def spawn(
        self, argv: list[str], pass_fds: tuple[int, ...], env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        """Start a worker's process from the pool's own thread, which lives as long as the pool."""
        return self._spawner.submit(
            subprocess.Popen,
            argv,
            stdin=subprocess.DEVNULL,
            pass_fds=pass_fds,
            start_new_session=True,
            env=env,
        ).result()

    def __call__(self, *args: Any) -> Any:
        with self._slots:
            worker = self._take()
            try:
                result = worker.call(args, self.deadline_s)
            except BaseException:
                self._drop(worker)
                raise
            with self._lock:
                kept = worker in self._live  # not if close() came meanwhile
            if kept:
                self._idle.put(worker)
            else:
                worker.stop()
            return result

    def _take(self) -> _Worker:
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                break
            if worker.alive():
                return worker
            self._drop(worker)  # the system killed it
        with self._lock:
            closed = self._closed
        if not closed:
            worker = _Worker(self)
            with self._lock:
                closed = self._closed
                if not closed:
                    self._live.add(worker)
            if closed:  # (close() came while it started)
                worker.stop()
        if closed:
            raise RuntimeError(f"the {self.name} workers are closed")
        return worker

    def _drop(self, worker: _Worker) -> None:
        with self._lock:
            self._live.discard(worker)
        worker.stop()

    @property
    def pids(self) -> list[int]:
        """The live workers' process ids."""
        with self._lock:
            return [w.proc.pid for w in self._live]

    def close(self) -> None:
        """Kill every worker and reap it; a call under way raises CallFailed."""
        with self._lock:
            self._closed, live, self._live = True, self._live, set()
        for worker in live:
            worker.kill()
        while True:
            try:
                self._idle.get_nowait().stop()
            except queue.Empty:
                break
        self._spawner.shutdown(wait=False)


class _Worker:
    def __init__(self, pool: WorkerPool) -> None:
        self.name = pool.name
        down_r, down_w = os.pipe()  # calls: coordinator -> worker
        up_r, up_w = os.pipe()  # replies: worker -> coordinator
        # this very package, and whatever the coordinator imports user code from
        path = [PACKAGE_ROOT, *(p or os.getcwd() for p in sys.path)]
        try:
            self.proc = pool.spawn(
                [sys.executable, "-m", "coordinator.user_code", str(down_r), str(up_w)],
                (down_r, up_w),
                {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path))},
            )
        finally:
            os.close(down_r)
            os.close(up_w)
        self.calls, self.replies = Connection(down_w, readable=False), Connection(up_r, writable=False)
        self.calls.send((pool.factory, pool.factory_args, pool.memory_mb))
        try:
            kind, detail = self._reply(STARTUP_S, "start")
        except CallFailed as exc:  # not a sample's fault: nothing can be computed
            self.stop()
            raise RuntimeError(str(exc)) from None
        if kind != "ready":
            self.stop()
            raise RuntimeError(f"{self.name} worker: {detail}")

    def _reply(self, deadline_s: float, doing: str) -> tuple[str, Any]:
        if not self.replies.poll(deadline_s):
            raise CallFailed(
                "timed out", f"{self.name} (pid {self.proc.pid}) did not {doing} in {deadline_s} s"
            )
        try:
            reply: tuple[str, Any] = self.replies.recv()
            return reply
        except EOFError:
            try:
                status = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                status = None
            raise CallFailed(
                "crashed", f"{self.name} (pid {self.proc.pid}) died (exit status {status})"
            ) from None

    def call(self, args: tuple[Any, ...], deadline_s: float) -> Any:
        with contextlib.suppress(BrokenPipeError):  # it died since it was taken: the reply's EOF says how
            self.calls.send(args)
        kind, value = self._reply(deadline_s, "answer")
        if kind == "ok":
            return value
        reason = "out of memory" if kind == "memory" else "raised"
        raise CallFailed(reason, f"{self.name}: {value}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """Kill and reap the process; a thread waiting for its reply wakes (the pipe closes)."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        """Kill it and close the pipes: only by the thread that holds it (never under another's wait)."""
        self.kill()
        self.calls.close()
        self.replies.close()


def _serve(calls: Connection, replies: Connection) -> None:
    """A worker's loop: the factory first, then args in, ("ok", result) or what went wrong out, until the
    coordinator closes the pipe. A MemoryError ends the worker (its heap is where the cap left it)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the coordinator, even a SIGKILLed one
    factory, factory_args, memory_mb = calls.recv()
    cap = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    try:
        function: Callable[..., Any] = load_plugin(factory, "factory")(*factory_args)
    except Exception as exc:
        replies.send(("error", f"{factory}: {type(exc).__name__}: {exc}"))
        return
    replies.send(("ready", ""))
    while True:
        try:
            args = calls.recv()
        except EOFError:
            return
        try:
            replies.send(("ok", function(*args)))
        except MemoryError:
            replies.send(("memory", f"MemoryError past its cap of {memory_mb} MiB"))
            return
        except Exception as exc:
            replies.send(("raised", f"{type(exc).__name__}: {exc}"))


def load_plugin(spec: str, what: str, form: str = "module:function") -> Callable[..., Any]:
    """The callable a ``module:name`` setting names (``what``: the setting, for the message), found on the
    path or in the working directory (as ``python -m`` would; a console script's path lacks it). Raises
    ValueError saying what is wrong."""
    module, sep, name = spec.partition(":")
    if not sep:
        raise ValueError(f"{what} {spec!r} is not of the form {form}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # (after what is installed: a local file shadows nothing)
    try:
        loaded = importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"{what} {spec!r}: cannot import {module}: {exc}") from None
    found = getattr(loaded, name, None)
    if not callable(found):
        raise ValueError(f"{what} {spec!r}: {module} has no callable {name}")
    return cast(Callable[..., Any], found)


def reward_function(spec: str) -> RewardFn:
    """A ``--reward`` worker's callable: the user's ``function(prompt, completion, answer)``, its result
    checked to be a finite number."""
    fn = load_plugin(spec, "reward")

    def checked(prompt: str, completion: str, answer: str) -> float:
        value = fn(prompt, completion, answer)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"returned {value!r}: a reward must be a finite number")
        return float(value)

    return checked


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
