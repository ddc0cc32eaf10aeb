"""Thin clients for the trainer and the rollout replicas: named deadlines, bounded retries on UNAVAILABLE
(and on a replica's RESOURCE_EXHAUSTED that says it is only busy), and failover of prompts from a replica
that fails to one that works."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from fp8rl.security import SecurityConfig
from fp8rl.serving import BUSY_METADATA, FENCE_METADATA
from fp8rl.transport import channel
from fp8rl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

STATUS_DEADLINE_S = 10.0
GENERATE_DEADLINE_S = 900.0
TRAIN_DEADLINE_S = 3600.0
PUBLISH_DEADLINE_S = 1800.0
# A trainer restarting (killed, rescheduled, its container recreated) is waited for this long: it loads
# its model and checkpoint before it serves, minutes for a real checkpoint. An embedded run's own trainer
# that stops answering has died, and the supervisor restarts the run's processes: it waits less.
UNAVAILABLE_WAIT_S = 300.0
EMBEDDED_UNAVAILABLE_WAIT_S = 15.0
# A replica at its capacity (other callers' Generate calls fill its slots or queue) is asked again, with a
# growing pause, for this long before its prompts move elsewhere: busy is not failed.
BUSY_WAIT_S = 300.0


def with_retries(call: Callable[[], T], what: str, wait_s: float = UNAVAILABLE_WAIT_S) -> T:
    """Retry only while the peer is UNAVAILABLE (restarting, not yet up), with a growing pause, until
    ``wait_s`` has passed since the first failure."""
    first_failure: float | None = None
    for attempt in itertools.count():
        try:
            return call()
        except grpc.RpcError as exc:
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            waited = now - first_failure
            if exc.code() != grpc.StatusCode.UNAVAILABLE or waited >= wait_s:
                raise
            log.warning(
                "%s: unavailable (%s); retry %d, %.0f s of %.0f",
                what,
                exc.details(),
                attempt + 1,
                waited,
                wait_s,
            )
            time.sleep(min(0.5 * 2**attempt, 8.0, max(0.0, wait_s - waited)))
    raise AssertionError("unreachable")


class FencedOut(RuntimeError):
    """The trainer refused our fencing token: another coordinator took the run's lease since."""


def fenced(call: Callable[[], T]) -> T:
    """``call``, with the trainer's refusal of a stale fencing token raised as :class:`FencedOut`."""
    try:
        return call()
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "is stale" in (exc.details() or ""):
            raise FencedOut(f"the trainer refused this coordinator: {exc.details()}") from None
        raise


# Batches and replies of real runs (hundreds of samples x thousands of tokens) outgrow gRPC's default
# 4 MiB receive limit; both directions of every channel take up to this.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A peer that comes back at another address (a recreated container) is found at the next failure:
    # gRPC's default waits 30 s between DNS lookups, while each connect to the old address times out.
    ("grpc.dns_min_time_between_resolutions_ms", 1000),
]


class TrainerClient:
    def __init__(
        self, address: str, security: SecurityConfig | None = None, wait_s: float = UNAVAILABLE_WAIT_S
    ) -> None:
        """``wait_s``: how long an UNAVAILABLE trainer is asked again before a call fails."""
        self.address, self.wait_s = address, wait_s
        self.channel = channel(address, security, "trainer", CHANNEL_OPTIONS)
        self.stub = trainer_pb2_grpc.TrainerStub(self.channel)
        self.fence = ""  # set once the coordinator holds the run's lease

    @property
    def _metadata(self) -> list[tuple[str, str]]:
        return [(FENCE_METADATA, self.fence)] if self.fence else []

    def status(self) -> trainer_pb2.TrainerStatus:
        return with_retries(
            lambda: self.stub.GetStatus(common_pb2.GetStatusRequest(), timeout=STATUS_DEADLINE_S),
            "trainer status",
            self.wait_s,
        )

    def train(self, request: trainer_pb2.TrainStepRequest) -> trainer_pb2.TrainStepResponse:
        return fenced(
            lambda: with_retries(
                lambda: self.stub.TrainStep(request, timeout=TRAIN_DEADLINE_S, metadata=self._metadata),
                f"TrainStep({request.step})",
                self.wait_s,
            )
        )

    def publish(
        self, version: int, held: dict[str, int], proofs: dict[str, str] | None = None
    ) -> trainer_pb2.PublishWeightsResponse:
        """``proofs``: each replica's registration proof (its status shows it), which the trainer checks."""
        proofs = proofs or {}
        targets = [
            trainer_pb2.PublishTarget(address=a, held_version=v, proof=proofs.get(a, ""))
            for a, v in held.items()
        ]
        request = trainer_pb2.PublishWeightsRequest(version=version, targets=targets)
        return fenced(
            lambda: with_retries(
                lambda: self.stub.PublishWeights(
                    request, timeout=PUBLISH_DEADLINE_S, metadata=self._metadata
                ),
                f"PublishWeights({version})",
                self.wait_s,
            )
        )

    def close(self) -> None:
        self.channel.close()


class ReplicaFailed(RuntimeError):
    pass


class RolloutPool:
    """The replicas of one run. ``addresses`` is called before each step (static list or Redis discovery)."""

    def __init__(
        self,
        addresses: Callable[[], list[str]],
        security: SecurityConfig | None = None,
        wait_s: float = UNAVAILABLE_WAIT_S,
    ) -> None:
        """``wait_s``: how long a step waits for a replica it can use (partitioned, restarting) before it
        fails (coordinator.publishing)."""
        self._addresses = addresses
        self.security, self.wait_s = security, wait_s
        self._stubs: dict[str, rollout_pb2_grpc.RolloutStub] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self.proofs: dict[str, str] = {}  # address -> registration proof, as its last status showed
        self.http: dict[str, str] = {}  # address -> its OpenAI-compatible face's, as its last status showed

    def stub(self, address: str) -> rollout_pb2_grpc.RolloutStub:
        if address not in self._stubs:
            self._channels[address] = channel(address, self.security, "rollout", CHANNEL_OPTIONS)
            self._stubs[address] = rollout_pb2_grpc.RolloutStub(self._channels[address])
        return self._stubs[address]

    def held_versions(self) -> dict[str, int]:
        """Version each reachable replica holds; unreachable ones are left out (dropped for the step)."""
        held = {}
        for address in self._addresses():
            try:
                status = self.stub(address).GetStatus(
                    common_pb2.GetStatusRequest(), timeout=STATUS_DEADLINE_S
                )
                held[address], self.proofs[address] = status.weight_version, status.registration_proof
                self.http[address] = status.http_address
            except grpc.RpcError as exc:
                log.warning("replica %s unreachable (%s): dropped for this step", address, exc.code().name)
            except ValueError as exc:  # our security settings forbid talking to it (e.g. plaintext)
                log.warning("replica %s: %s: dropped for this step", address, exc)
        if not held:
            raise ReplicaFailed("no rollout replica is reachable")
        return held

    def generate(
        self,
        prompts: Sequence[rollout_pb2.Prompt],
        n: int,
        sampling: common_pb2.SamplingParams,
        version: int,
        replicas: Sequence[str],
        on_failure: Callable[[str, grpc.RpcError], None],
        routed_experts: bool = False,
    ) -> list[rollout_pb2.Completion]:
        """Split ``prompts`` across ``replicas``; a chunk whose replica fails moves to a healthy one.
        ``routed_experts``: ask for each completion's routed experts (an MoE model)."""
        healthy = list(replicas)
        chunks = [list(prompts[i :: len(healthy)]) for i in range(len(healthy))]
        completions: list[rollout_pb2.Completion] = []
        pending = [(chunk, healthy[i]) for i, chunk in enumerate(chunks) if chunk]
        while pending:
            with ThreadPoolExecutor(max_workers=len(pending)) as pool:
                results = list(
                    pool.map(
                        lambda job: self._try(job[1], job[0], n, sampling, version, routed_experts), pending
                    )
                )
            retry: list[tuple[list[rollout_pb2.Prompt], str]] = []
            for (chunk, address), result in zip(pending, results, strict=True):
                if isinstance(result, grpc.RpcError):
                    on_failure(address, result)
                    if address in healthy:
                        healthy.remove(address)
                    if not healthy:
                        raise ReplicaFailed(f"every replica failed; last: {address}: {result.details()}")
                    retry.append((chunk, healthy[len(retry) % len(healthy)]))
                else:
                    completions.extend(result)
            pending = retry
        return completions

    def _try(
        self,
        address: str,
        prompts: list[rollout_pb2.Prompt],
        n: int,
        sampling: common_pb2.SamplingParams,
        version: int,
        routed_experts: bool = False,
    ) -> list[rollout_pb2.Completion] | grpc.RpcError:
        # In calls of at most SAMPLES_PER_CALL samples: under a replica's per-request cap (4096 by
        # default) and its reply size, whatever prompts_per_step x group_size is.
        per_call = max(1, SAMPLES_PER_CALL // n)
        completions: list[rollout_pb2.Completion] = []
        for start in range(0, len(prompts), per_call):
            request = rollout_pb2.GenerateRequest(
                prompts=prompts[start : start + per_call],
                n=n,
                sampling=sampling,
                weight_version=version,
                return_routed_experts=routed_experts,
            )
            try:
                reply = self._generate(address, request)
            except grpc.RpcError as exc:
                return exc
            completions.extend(reply.completions)
        return completions

    def _generate(self, address: str, request: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse:
        """One Generate call, asked again while the replica answers that it is busy (for at most
        BUSY_WAIT_S seconds of pauses)."""
        waited, pause = 0.0, 0.25
        while True:
            try:
                return self.stub(address).Generate(request, timeout=GENERATE_DEADLINE_S)
            except grpc.RpcError as exc:
                if not is_busy(exc) or waited >= BUSY_WAIT_S:
                    raise
                if waited == 0:
                    log.warning(
                        "replica %s busy (%s); asking again for up to %g s",
                        address,
                        exc.details(),
                        BUSY_WAIT_S,
                    )
            time.sleep(pause)
            waited, pause = waited + pause, min(2 * pause, 4.0)

    def close(self) -> None:
        for chan in self._channels.values():
            chan.close()


SAMPLES_PER_CALL = 1024


def is_busy(exc: grpc.RpcError) -> bool:
    """A server's RESOURCE_EXHAUSTED that the same call may be served later (fp8rl.serving.BUSY_METADATA)."""
    trailing = getattr(exc, "trailing_metadata", lambda: None)() or ()
    return exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and any(k == BUSY_METADATA for k, _ in trailing)


def rpc_code(exc: Any) -> str:
    return exc.code().name if isinstance(exc, grpc.RpcError) else type(exc).__name__
