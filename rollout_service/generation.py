"""The engine loop: one thread owns the engine, batches whatever requests are pending, and runs weight
updates only between batches.

Admission and weight changes share one condition variable, which gives the two guarantees the service
promises: a request is admitted only while the replica holds the version it asks for, and an update
waits for every admitted request to finish (new ones wait for the update), so no completion ever mixes
weight versions.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from fp8rl.errors import Cancelled, NotReady, Overloaded, PreconditionFailed
from rollout_service.engine import EngineRequest, FinishedSample, Progress

log = logging.getLogger(__name__)
ANY_VERSION = -1


class Engine(Protocol):
    def add(self, request: EngineRequest) -> None: ...
    def step(self) -> list[FinishedSample | Progress]: ...
    def has_unfinished(self) -> bool: ...
    def abort(self, request_ids: list[str]) -> None: ...


@dataclass
class Ticket:
    """The completions of one submission, delivered as each finishes; with ``stream``, each one's new
    tokens too, as they are generated."""

    version: int
    expected: int
    _results: queue.Queue[FinishedSample | Progress | BaseException] = field(default_factory=queue.Queue)
    request_ids: list[str] = field(default_factory=list)
    stream: bool = False
    run: bool = False  # the run's own (before outside readers: GenerationLoop)

    def __iter__(self) -> Iterator[FinishedSample]:
        return (e for e in self.events() if isinstance(e, FinishedSample))

    def events(self) -> Iterator[FinishedSample | Progress]:
        """Every piece (streamed submissions) and every finished sample, in the order they came."""
        finished = 0
        while finished < self.expected:
            item = self._results.get()
            if isinstance(item, BaseException):
                raise item
            finished += isinstance(item, FinishedSample)
            yield item


@dataclass
class _Job:
    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class GenerationLoop:
    """Owns the engine. The run's own requests (``submit(..., run=True)``) come first: while any is queued
    or generating, outside requests join the engine's batch only while fewer than
    ``outside_during_run`` of theirs are in it, and the rest wait here (vLLM also schedules the run's
    before waiting outside ones). With none of the run's in flight, outside requests take the engine."""

    def __init__(
        self,
        engine: Engine,
        version: int = ANY_VERSION,
        max_queued: int = 1 << 62,
        outside_during_run: int = 1 << 62,
    ) -> None:
        self.engine = engine
        self.max_queued = max_queued  # samples queued or generating; beyond it submit() is refused
        self.outside_during_run = outside_during_run
        self.version = version
        self.needs_keyframe = False
        self.tokens_generated = 0
        self._cond = threading.Condition()
        self._pending: list[tuple[EngineRequest, Ticket]] = []
        self._active: dict[str, Ticket] = {}
        self._aborts: list[str] = []
        self._job: _Job | None = None
        self._updating = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._pending)

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._pending) + len(self._active)

    def submit(self, requests: list[EngineRequest], required_version: int, run: bool = False) -> Ticket:
        """Admit requests for generation under ``required_version`` (or any version with -1); ``run``:
        the run's own."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating or self._stopped)
            if self._stopped:
                raise NotReady("the rollout service is shutting down")
            if self.needs_keyframe:
                raise PreconditionFailed("a weight update failed midway: replica needs keyframe")
            if required_version not in (ANY_VERSION, self.version):
                raise PreconditionFailed(
                    f"replica holds weight version {self.version}, not {required_version}"
                )
            waiting = len(self._pending) + len(self._active)
            if waiting + len(requests) > self.max_queued:
                raise Overloaded(
                    f"{waiting} samples are queued or generating; {len(requests)} more would pass the "
                    f"replica's limit of {self.max_queued} (max_queued_samples); retry later"
                )
            ticket = Ticket(
                self.version,
                len(requests),
                request_ids=[r.request_id for r in requests],
                stream=any(r.stream for r in requests),
                run=run,
            )
            self._pending += [(r, ticket) for r in requests]
            self._cond.notify_all()
            return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Abort what is left of a submission (its client went away); its iterator raises Cancelled."""
        with self._cond:
            self._pending = [(r, t) for r, t in self._pending if t is not ticket]
            self._aborts += [rid for rid in ticket.request_ids if rid in self._active]
            self._cond.notify_all()
        ticket._results.put(Cancelled("generation cancelled by the client"))

    def run_exclusive(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread once no admitted request is left; admissions wait meanwhile."""
        job = _Job(fn)
        with self._cond:
            self._cond.wait_for(lambda: not self._updating or self._stopped)
            if self._stopped:
                raise NotReady("the rollout service is shutting down")
            self._updating, self._job = True, job
            self._cond.notify_all()
        job.done.wait()
        with self._cond:
            self._updating, self._job = False, None
            self._cond.notify_all()
        if job.error is not None:
            raise job.error
        return job.result

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._stopped
                        or self._pending
                        or self._active
                        or self._aborts
                        or self._job is not None
                    )
                )
                if self._stopped:
                    job, self._job = self._job, None
                    break
                admitted, self._pending = self._admissible()
                aborts, self._aborts = self._aborts, []
                job = self._job if not admitted and not self._active and not self._pending else None
            self._serve(admitted, aborts, job)
        self._fail_all(NotReady("the rollout service is shutting down"))
        if job is not None and not job.done.is_set():  # an update that never ran must not wait forever
            job.error = NotReady("the rollout service is shutting down")
            job.done.set()

    def _admissible(self) -> tuple[list[tuple[EngineRequest, Ticket]], list[tuple[EngineRequest, Ticket]]]:
        """(what joins the engine now, the run's first; what waits): every pending request, but that
        while the run has requests in flight, outside ones join only up to ``outside_during_run`` in the
        engine. (Under the lock.)"""
        pending = self._pending
        if not any(t.run for t in self._active.values()) and not any(t.run for _, t in pending):
            return pending, []
        room = self.outside_during_run - sum(not t.run for t in self._active.values())
        admitted = [(r, t) for r, t in pending if t.run]
        held = []
        for request, ticket in pending:
            if ticket.run:
                continue
            if room > 0:
                admitted.append((request, ticket))
                room -= 1
            else:
                held.append((request, ticket))
        return admitted, held

    def _serve(
        self, admitted: list[tuple[EngineRequest, Ticket]], aborts: list[str], job: _Job | None
    ) -> None:
        try:
            failed: set[int] = set()
            for request, ticket in admitted:
                if id(ticket) in failed:
                    continue
                try:
                    self.engine.add(request)
                except Exception as exc:  # the engine refused it: fail that submission only
                    log.warning("engine refused request %s: %s", request.request_id, exc)
                    failed.add(id(ticket))
                    self._fail_ticket(ticket, exc)
                    continue
                self._active[request.request_id] = ticket
            if aborts:
                self.engine.abort(aborts)
                for rid in aborts:
                    if rid in self._active:  # it may have finished since the client cancelled
                        del self._active[rid]
            if job is not None and not job.done.is_set():
                self._run_job(job)
            if self._active:
                for event in self.engine.step():
                    if event.request_id not in self._active:
                        continue
                    if isinstance(event, Progress):
                        self._active[event.request_id]._results.put(event)
                        continue
                    ticket = self._active.pop(event.request_id)
                    self.tokens_generated += len(event.token_ids)
                    ticket._results.put(event)
        except Exception as exc:  # an engine failure fails the requests it held, not the loop
            log.exception("engine step failed")
            self._fail_all(exc)

    def _run_job(self, job: _Job) -> None:
        start = time.perf_counter()
        try:
            job.result = job.fn()
        except BaseException as exc:
            job.error = exc
        finally:
            log.info("exclusive engine job took %.3fs", time.perf_counter() - start)
            job.done.set()

    def _fail_ticket(self, ticket: Ticket, exc: BaseException) -> None:
        """Fail one submission: abort what of it the engine already holds; its iterator raises ``exc``."""
        held = [rid for rid, t in self._active.items() if t is ticket]
        for rid in held:
            del self._active[rid]
        if held:
            self.engine.abort(held)
        ticket._results.put(exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            tickets = {id(t): t for t in self._active.values()} | {id(t): t for _, t in self._pending}
            self._active.clear()
            self._pending = []
        for ticket in tickets.values():
            for _ in range(ticket.expected):
                ticket._results.put(exc)
