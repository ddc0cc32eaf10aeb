"""The rollout's orchestration with a scripted engine (no vLLM: this is pure scheduling and state logic;
the real engine is exercised in test_rollout.py): updates wait for in-flight requests, a failed apply
makes the replica refuse work until a keyframe lands."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fp8rl.codec.schema import build_weight_set
from fp8rl.codec.stream import header_of
from fp8rl.codec.testing import encode_keyframe, to_bytes
from fp8rl.errors import NotReady, Overloaded, PreconditionFailed
from fp8rl.v1 import common_pb2, rollout_pb2
from rollout_service.config import RolloutConfig
from rollout_service.engine import EngineRequest, FinishedSample
from rollout_service.generation import GenerationLoop
from rollout_service.service import RolloutService


class ScriptedEngine:
    """Finishes each request after ``steps`` engine steps; ``fail_loads`` makes the next refits fail."""

    version, device, max_model_len, vocab_size = "scripted", "cpu", 64, 320
    has_chat_template = False  # chat prompts are refused by validation, before the engine
    longest_token_bytes = 1
    refused_prompt = (9, 9)  # add() raises for it, as an engine that rejects a request on its own thread

    def __init__(self, steps: int = 3) -> None:
        self.steps, self.fail_loads, self.loads = steps, 0, 0
        self.running: dict[str, list[Any]] = {}
        self.events: list[str] = []

    def tokenize(self, text: str) -> list[int]:
        return [4 + b for b in text.encode()]

    def add(self, request: EngineRequest) -> None:
        if tuple(request.prompt_token_ids) == self.refused_prompt:
            raise ValueError("the engine refuses this request")
        self.running[request.request_id] = [request, 0]
        self.events.append(f"add {request.request_id}")

    def step(self) -> list[FinishedSample]:
        time.sleep(0.01)
        done = []
        for rid, entry in list(self.running.items()):
            entry[1] += 1
            if entry[1] >= self.steps:
                del self.running[rid]
                done.append(FinishedSample(rid, [5, 6], [-0.5, -0.5], "ab", "length"))
                self.events.append(f"finish {rid}")
        return done

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.running.pop(rid, None)

    def restart(self) -> None:
        self.events.append("restart")

    def load_weights(self, tensors: Any) -> None:
        self.events.append("load")
        self.loads += 1
        if self.fail_loads:
            self.fail_loads -= 1
            raise RuntimeError("engine failed midway through the refit")


def engine_request(rid: str, prompt: list[int] | None = None) -> EngineRequest:
    from rollout_service.engine import Sampling

    return EngineRequest(rid, prompt or [5], Sampling(1.0, 1.0, 0, 2, (), None))


def test_an_engine_rejection_fails_only_its_own_submission() -> None:
    """Requests already taken off the queue in one batch: the refused one's submission fails, its other
    samples are dropped (or aborted), and the neighbours' submissions complete."""
    engine = ScriptedEngine(steps=5)
    loop = GenerationLoop(engine)
    release = threading.Event()
    blocker = threading.Thread(target=loop.run_exclusive, args=(lambda: release.wait(5),))
    blocker.start()  # hold the loop so the three submissions below are admitted as one batch
    time.sleep(0.05)
    tickets: dict[str, Any] = {}

    def submit(name: str, requests: list[EngineRequest]) -> None:
        tickets[name] = loop.submit(requests, -1)

    clients = [
        threading.Thread(target=submit, args=("good", [engine_request("g1"), engine_request("g2")])),
        threading.Thread(target=submit, args=("bad", [engine_request("b1"), engine_request("b2", [9, 9])])),
        threading.Thread(target=submit, args=("after", [engine_request("a1")])),
    ]
    for c in clients:
        c.start()
    time.sleep(0.05)
    release.set()
    blocker.join()
    for c in clients:
        c.join()
    with pytest.raises(ValueError, match="refuses"):
        list(tickets["bad"])
    assert len(list(tickets["good"])) == 2 and len(list(tickets["after"])) == 1
    assert "b1" not in engine.running  # the refused submission's admitted sample was aborted
    loop.stop()


def test_queue_depth_is_capped() -> None:
    engine = ScriptedEngine(steps=50)
    loop = GenerationLoop(engine, max_queued=3)
    first = loop.submit([engine_request("a"), engine_request("b")], -1)
    with pytest.raises(Overloaded, match="limit of 3"):
        loop.submit([engine_request("c"), engine_request("d")], -1)
    assert len(list(loop.submit([engine_request("e")], -1))) == 1
    assert len(list(first)) == 2
    loop.stop()


def test_update_waits_for_admitted_requests() -> None:
    engine = ScriptedEngine(steps=20)
    loop = GenerationLoop(engine)
    ticket = loop.submit([engine_request("a"), engine_request("b")], required_version=-1)
    time.sleep(0.05)
    loop.run_exclusive(lambda: engine.events.append("update"))
    assert engine.events.index("update") > max(
        engine.events.index("finish a"), engine.events.index("finish b")
    )
    assert len(list(ticket)) == 2
    loop.stop()


def test_admission_waits_for_an_update_and_checks_the_new_version() -> None:
    engine = ScriptedEngine()
    loop = GenerationLoop(engine, version=1)
    release = threading.Event()

    def slow_update() -> None:
        release.wait(5)
        loop.version = 2

    updater = threading.Thread(target=loop.run_exclusive, args=(slow_update,))
    updater.start()
    time.sleep(0.05)
    admitted: list[Any] = []
    client = threading.Thread(target=lambda: admitted.append(loop.submit([engine_request("c")], 2)))
    client.start()
    time.sleep(0.1)
    assert not admitted  # held back while weights change
    release.set()
    updater.join()
    client.join()
    assert admitted and admitted[0].version == 2
    with pytest.raises(PreconditionFailed, match="holds weight version 2, not 1"):
        loop.submit([engine_request("d")], 1)
    loop.stop()


def test_failed_apply_refuses_work_until_a_keyframe(tiny_model_dir: Path) -> None:
    engine = ScriptedEngine()
    service = RolloutService(RolloutConfig(model=tiny_model_dir, recipe="fp8"), engine)  # type: ignore[arg-type]
    from safetensors.torch import load_file

    weights = build_weight_set(load_file(tiny_model_dir / "model.safetensors"), "fp8-block128")
    keyframe = encode_keyframe(weights, 1)
    engine.fail_loads = 1
    with pytest.raises(RuntimeError, match="midway"):
        service.update_weights([(header_of(keyframe), bytearray(to_bytes(keyframe)))])
    assert service.status().needs_keyframe and service.held is None
    assert engine.events[-2:] == ["load", "restart"]  # a half-refitted engine is replaced at once
    request = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(id="p", text="1+1=")],
        n=1,
        weight_version=-1,
        sampling=common_pb2.SamplingParams(max_tokens=2),
    )
    with pytest.raises(PreconditionFailed, match="needs keyframe"):
        service.generate(request)
    result = service.update_weights([(header_of(keyframe), bytearray(to_bytes(keyframe)))])
    assert (result.version, result.encoding) == (1, "keyframe") and not service.status().needs_keyframe
    assert [c.weight_version for c in service.generate(request)] == [1]
    service.close()


def test_stopping_releases_an_update_that_never_ran() -> None:
    engine = ScriptedEngine(steps=1000)
    loop = GenerationLoop(engine)
    loop.submit([engine_request("long")], required_version=-1)
    outcome: list[BaseException] = []

    def update() -> None:
        try:
            loop.run_exclusive(lambda: None)
        except BaseException as exc:
            outcome.append(exc)

    updater = threading.Thread(target=update)
    updater.start()
    time.sleep(0.1)  # the update waits for the long request
    loop.stop()
    updater.join(timeout=10)
    assert not updater.is_alive() and isinstance(outcome[0], NotReady)


@pytest.mark.parametrize("share", [2, 0])
def test_the_runs_requests_go_first_and_outside_ones_wait_past_their_share(share: int) -> None:
    """While the run's samples are in flight, outside samples join the engine only up to
    ``outside_during_run`` at once (the rest wait in the loop, not in the engine's batch; 0: none join);
    with none of the run's in flight, outside requests take the engine whole."""
    engine = ScriptedEngine(steps=4)
    loop = GenerationLoop(engine, outside_during_run=share)
    try:
        outside = loop.submit([engine_request(f"o{i}") for i in range(3)], -1)  # no run in flight: all in
        while len(engine.events) < 3:
            time.sleep(0.001)
        run = loop.submit([engine_request(f"r{i}") for i in range(4)], -1, run=True)
        late = loop.submit([engine_request(f"late{i}") for i in range(4)], -1)
        assert len(list(run)) == 4 and len(list(outside)) == 3 and len(list(late)) == 4
        adds = [e.removeprefix("add ") for e in engine.events if e.startswith("add")]
        assert adds[:3] == ["o0", "o1", "o2"] and set(adds[3:7]) == {"r0", "r1", "r2", "r3"}
        # The late outside requests joined only once the engine held fewer than ``share`` outside ones, or
        # the run had none in flight: never more than ``share`` outside beside the run's.
        most = 0
        running_outside: set[str] = set()
        run_left = {"r0", "r1", "r2", "r3"}
        for event in engine.events:
            kind, rid = event.split(" ")
            if kind == "add" and not rid.startswith("r"):
                running_outside.add(rid)
                if run_left and rid.startswith("late"):
                    most = max(most, len(running_outside))
            elif kind == "finish":
                running_outside.discard(rid)
                run_left.discard(rid)
        assert most <= share, engine.events
    finally:
        loop.stop()


def test_a_flood_of_outside_calls_leaves_the_runs_slots() -> None:
    from fp8rl.serving import Capacity

    capacity = Capacity("Generate", 4, reserved=1)

    def refused(run: bool) -> str | None:
        try:
            with capacity.slot(run):
                return None
        except Overloaded as exc:
            return str(exc)

    with capacity.slot(), capacity.slot(), capacity.slot():
        assert refused(False) == "Generate: 3 calls in flight already (1 kept for the run's own); retry later"
        assert refused(True) is None  # the run's own call gets the kept slot
        with capacity.slot(run=True):
            assert refused(True) is not None and refused(False) is not None
    with capacity.slot(run=True), capacity.slot(), capacity.slot():  # the run may take any free slot
        assert refused(False) is not None and refused(True) is None
    assert capacity.in_use == 0
    with pytest.raises(ValueError, match="leave outside callers one"):
        Capacity("Generate", 2, reserved=2)


def test_outside_calls_wait_a_while_for_a_slot_and_the_runs_never_wait() -> None:
    from fp8rl.serving import Capacity

    capacity = Capacity("Generate", 2, reserved=1, waiting=1, wait_s=30)
    outcomes: list[str] = []

    def outside_call() -> None:
        try:
            with capacity.slot():
                outcomes.append("served")
        except Overloaded:
            outcomes.append("refused")

    with capacity.slot():  # the one outside slot is taken
        waiter = threading.Thread(target=outside_call)
        waiter.start()
        deadline = time.monotonic() + 10
        while capacity._waiters == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(Overloaded), capacity.slot():  # past the one waiter allowed: refused at once
            pass
        with capacity.slot(run=True), pytest.raises(Overloaded), capacity.slot(run=True):
            pass  # (the run's own takes its kept slot; the next is refused at once)
        assert time.monotonic() - started < 5 and outcomes == []  # (not the waiter's 30 s)
    waiter.join(timeout=10)
    assert outcomes == ["served"]  # it got the slot once freed, well before its 30 s

    brief = Capacity("Generate", 1, waiting=1, wait_s=0.3)
    with brief.slot():
        started = time.monotonic()
        with pytest.raises(Overloaded, match="1 calls in flight already; retry later"), brief.slot():
            pass
        assert 0.3 <= time.monotonic() - started < 5
    assert brief.in_use == 0
