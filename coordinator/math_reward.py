"""math-verify as a reward, callable from any thread and bounded in time.

math-verify's ``parse``/``verify`` time out with ``signal.alarm``, which works only on a process's main
thread (off it they raise), and the coordinator scores completions on a thread pool. So each score runs
in a worker process, with math-verify's own timeouts off (``parsing_timeout=None``,
``timeout_seconds=None``), and the caller waits for the reply at most ``deadline_s``: a worker that has
not answered by then is killed and reaped (the next call starts a fresh one), and the call raises
:class:`RewardTimeout`, which the batch scores 0 and counts. A completion that makes sympy compute for
ever (``\\boxed{9^{9^{9^{9}}}}``) costs one deadline, never a hung coordinator.

A worker is ``python -m coordinator.math_reward`` in a session of its own (a terminal's Ctrl-C is the
coordinator's), talking over two pipes; it is started when a call finds none idle (at most ``workers``),
stopped by PID and reaped, and dies with the thread that started it (PR_SET_PDEATHSIG), so a killed
coordinator leaves none behind; a worker found dead when taken is replaced.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from coordinator.problems import RewardTimeout

DEADLINE_S = 5.0  # per completion (math-verify's own default is 5 s per parse and per comparison)
STARTUP_S = 120.0  # a worker imports sympy and math-verify before it answers
MAX_CHARS = 8192  # a completion is cut to its tail: math-verify reads the rightmost answer first
WORKERS = 4  # the coordinator's reward threads (coordinator/batches.py)


def score(answer: str, completion: str) -> float:
    """1.0 if math-verify finds ``completion``'s answer equal to ``answer``, else 0.0. No timeout: call it
    where the caller bounds the time (a worker)."""
    from math_verify import parse, verify

    gold, target = parse(answer, parsing_timeout=None), parse(completion, parsing_timeout=None)
    return float(verify(gold, target, timeout_seconds=None))


def _serve(requests: Connection, replies: Connection) -> None:
    """A worker's loop: (answer, completion) in, score out, until the coordinator closes the pipe."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the coordinator, even a SIGKILLed one
    # The time is bounded by the caller; math-verify's warning that it is not would only be noise.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        import math_verify  # noqa: F401
    except Exception as exc:
        replies.send(("error", f"cannot import math_verify: {exc}"))
        return
    replies.send(("ready", ""))
    while True:
        try:
            answer, completion = requests.recv()
        except EOFError:
            return
        try:
            replies.send(score(answer, completion))
        except Exception:  # math-verify swallows its own errors; anything else is no match
            replies.send(0.0)


class _Worker:
    def __init__(self) -> None:
        down_r, down_w = os.pipe()  # requests: coordinator -> worker
        up_r, up_w = os.pipe()  # replies: worker -> coordinator
        path = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "coordinator.math_reward", str(down_r), str(up_w)],
                stdin=subprocess.DEVNULL,
                pass_fds=(down_r, up_w),
                start_new_session=True,
                # this very package, whatever else is installed
                env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))},
            )
        finally:
            os.close(down_r)
            os.close(up_w)
        self.requests, self.replies = Connection(down_w, readable=False), Connection(up_r, writable=False)
        try:
            kind, detail = self._reply(STARTUP_S, "start")
        except RewardTimeout as exc:  # not the completion's fault: no reward can be computed
            self.stop()
            raise RuntimeError(str(exc)) from None
        if kind != "ready":
            self.stop()
            raise RuntimeError(f"math-verify worker: {detail}")

    def _reply(self, deadline_s: float, doing: str) -> Any:
        if not self.replies.poll(deadline_s):
            raise RewardTimeout(f"math-verify worker (pid {self.proc.pid}) did not {doing} in {deadline_s} s")
        try:
            return self.replies.recv()
        except EOFError:
            try:
                status = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                status = None
            raise RewardTimeout(
                f"math-verify worker (pid {self.proc.pid}) died (exit status {status})"
            ) from None

    def score(self, answer: str, completion: str, deadline_s: float) -> float:
        with contextlib.suppress(BrokenPipeError):  # it died since it was taken: the reply's EOF says how
            self.requests.send((answer, completion))
        return float(self._reply(deadline_s, "answer"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """Kill and reap the process; a thread waiting for its reply wakes (the pipe closes)."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        """Kill it and close the pipes: only by the thread that holds it (never under another's wait)."""
        self.kill()
        self.requests.close()
        self.replies.close()


class MathVerifier:
    """``verifier(answer, completion) -> 1.0 | 0.0`` from any thread, at most ``workers`` at a time; raises
    :class:`RewardTimeout` after ``deadline_s``. ``close()`` kills the workers."""

    def __init__(self, workers: int = WORKERS, deadline_s: float = DEADLINE_S) -> None:
        self.deadline_s = deadline_s
        self._slots = threading.BoundedSemaphore(workers)
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False

    def __call__(self, answer: str, completion: str) -> float:
        with self._slots:
            worker = self._take()
            try:
                result = worker.score(answer, completion[-MAX_CHARS:], self.deadline_s)
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
            self._drop(worker)  # its starting thread ended, or the system killed it
        worker = _Worker()
        with self._lock:
            if self._closed:
                worker.stop()
                raise RuntimeError("the math-verify reward is closed")
            self._live.add(worker)
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
        """Kill every worker and reap it; a call under way raises RewardTimeout."""
        with self._lock:
            self._closed, live, self._live = True, self._live, set()
        for worker in live:
            worker.kill()
        while True:
            try:
                self._idle.get_nowait().stop()
            except queue.Empty:
                return


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
