"""The coordinator's gRPC clients against a stand-in replica (a real gRPC server on port 0 whose Generate
returns a canned reply): replies of real runs exceed gRPC's default 4 MiB receive limit."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from coordinator.clients import ReplicaFailed, RolloutPool
from fp8rl.errors import Overloaded
from fp8rl.serving import Capacity, map_errors, start_server
from fp8rl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc


class LargeReplies(rollout_pb2_grpc.RolloutServicer):
    """Stand-in replica: every prompt gets one completion of ``tokens`` tokens."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def Generate(self, request, context):  # type: ignore[no-untyped-def]
        completions = [
            rollout_pb2.Completion(
                prompt_id=p.id,
                token_ids=[1000 + i % 1000 for i in range(self.tokens)],
                logprobs=[-0.5] * self.tokens,
                text="x" * self.tokens,
                finish_reason="length",
            )
            for p in request.prompts
        ]
        return rollout_pb2.GenerateResponse(completions=completions)


@pytest.fixture
def replica() -> Iterator[str]:
    running = start_server(
        lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(LargeReplies(300_000), s),
        ["fp8rl.v1.Rollout"],
        port=0,
    )
    try:
        yield running.address
    finally:
        running.stop(0)


def test_a_generate_reply_over_4_mib_reaches_the_coordinator(replica: str) -> None:
    pool = RolloutPool(lambda: [replica])
    failures: list[str] = []
    try:
        prompts = [rollout_pb2.Prompt(id=str(i), text="1+1=") for i in range(4)]
        sampling = common_pb2.SamplingParams(max_tokens=8)
        completions = pool.generate(prompts, 1, sampling, 0, [replica], lambda a, e: failures.append(a))
    finally:
        pool.close()
    reply_bytes = rollout_pb2.GenerateResponse(completions=completions).ByteSize()
    assert failures == [] and len(completions) == 4 and reply_bytes > 8 * 1024 * 1024
    with grpc.insecure_channel(replica) as plain:  # what gRPC's default limit does with the same reply
        stub = rollout_pb2_grpc.RolloutStub(plain)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(rollout_pb2.GenerateRequest(prompts=prompts), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


class Failing(rollout_pb2_grpc.RolloutServicer):
    """Stand-in replica whose engine fails every Generate."""

    def Generate(self, request, context):  # type: ignore[no-untyped-def]
        context.abort(grpc.StatusCode.INTERNAL, "engine died")


def test_a_failing_replica_s_prompts_move_to_a_healthy_one() -> None:
    servers = [
        start_server(
            lambda s, servicer=servicer: rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, s),
            ["fp8rl.v1.Rollout"],
            port=0,
        )
        for servicer in (LargeReplies(3), Failing(), Failing())
    ]
    good, bad, worse = (s.address for s in servers)
    pool = RolloutPool(lambda: [good, bad, worse])
    failures: list[tuple[str, str]] = []
    prompts = [rollout_pb2.Prompt(id=str(i), text="1+1=") for i in range(7)]
    sampling = common_pb2.SamplingParams(max_tokens=3)
    try:
        completions = pool.generate(
            prompts, 1, sampling, 0, [good, bad, worse], lambda a, e: failures.append((a, e.code().name))
        )
        assert sorted(int(c.prompt_id) for c in completions) == list(range(7))
        assert sorted(failures) == sorted([(bad, "INTERNAL"), (worse, "INTERNAL")])
        with pytest.raises(ReplicaFailed, match="every replica failed"):
            pool.generate(prompts, 1, sampling, 0, [bad, worse], lambda a, e: None)
    finally:
        pool.close()
        for server in servers:
            server.stop(0)


class Busy(rollout_pb2_grpc.RolloutServicer):
    """Stand-in replica with the real Generate slots (one) and error mapping: a caller the test lets hold
    the slot makes every other Generate answer RESOURCE_EXHAUSTED, flagged busy; ``cap`` refuses every
    request as over a per-request cap, which asking again never changes."""

    def __init__(self, cap: bool = False) -> None:
        self.generating, self.cap, self.refused = Capacity("Generate", 1), cap, 0

    @map_errors
    def Generate(self, request, context):  # type: ignore[no-untyped-def]
        try:
            with self.generating.slot():
                if self.cap:
                    raise Overloaded("prompts x n: over the per-request limit", transient=False)
                return LargeReplies(3).Generate(request, context)
        except Overloaded:
            self.refused += 1
            raise


@pytest.mark.parametrize("cap", [False, True])
def test_a_busy_replica_is_asked_again_and_a_capped_request_fails_at_once(cap: bool) -> None:
    """Found by bench/sustained_load.py: readers flooding the replica's Generate slots got the coordinator's
    own call RESOURCE_EXHAUSTED, which counted as a failed replica and ended the run (ReplicaFailed)."""
    servicer = Busy(cap)
    server = start_server(
        lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, s), ["fp8rl.v1.Rollout"], port=0
    )
    pool = RolloutPool(lambda: [server.address])
    failures: list[str] = []
    prompts = [rollout_pb2.Prompt(id=str(i), text="1+1=") for i in range(3)]
    sampling = common_pb2.SamplingParams(max_tokens=3)
    held, release = threading.Event(), threading.Event()

    def other_caller() -> None:  # holds the replica's one slot for a second
        with servicer.generating.slot():
            held.set()
            release.wait(1.0)

    holder = threading.Thread(target=other_caller)
    holder.start()
    held.wait()
    try:
        if cap:
            with pytest.raises(ReplicaFailed, match="per-request limit"):
                pool.generate(prompts, 1, sampling, 0, [server.address], lambda a, e: failures.append(a))
            assert failures == [server.address]
        else:
            completions = pool.generate(
                prompts, 1, sampling, 0, [server.address], lambda a, e: failures.append(a)
            )
            assert sorted(int(c.prompt_id) for c in completions) == [0, 1, 2] and failures == []
            assert servicer.refused >= 2  # refused while the slot was held, served once it was free
    finally:
        release.set()
        holder.join()
        pool.close()
        server.stop(0)


class _Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_stale_fencing_token_ends_the_run_as_a_lost_lease() -> None:
    """The trainer's refusal of an older coordinator's token is FencedOut (exit 3, like LeaseLost); any
    other refusal stays what it was."""
    from coordinator.clients import FencedOut, fenced

    def stale() -> None:
        raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "fencing token 1 is stale: a coordinator ...")

    def other() -> None:
        raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "step 3 was trained from another batch")

    with pytest.raises(FencedOut, match="fencing token 1 is stale"):
        fenced(stale)
    with pytest.raises(grpc.RpcError):
        fenced(other)
