"""The trainer client's retries: only UNAVAILABLE is asked again, for a time budget, not a count."""

from __future__ import annotations

import time

import grpc
import pytest

from coordinator.clients import with_retries


class Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name


def failing(code: grpc.StatusCode, times: int) -> tuple[list[float], object]:
    calls: list[float] = []

    def call() -> str:
        calls.append(time.monotonic())
        if len(calls) <= times:
            raise Refusal(code)
        return "served"

    return calls, call


def test_an_unavailable_peer_is_asked_again_until_it_serves() -> None:
    calls, call = failing(grpc.StatusCode.UNAVAILABLE, 3)  # 0.5 + 1 + 2 s of pauses
    assert with_retries(call, "test", wait_s=10.0) == "served"  # type: ignore[arg-type]
    assert len(calls) == 4


def test_the_wait_is_bounded_by_time() -> None:
    calls, call = failing(grpc.StatusCode.UNAVAILABLE, 1000)
    started = time.monotonic()
    with pytest.raises(Refusal):
        with_retries(call, "test", wait_s=2.0)  # type: ignore[arg-type]
    assert 2.0 <= time.monotonic() - started < 3.0
    assert calls[-1] - calls[0] >= 2.0


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_any_other_refusal_fails_at_once(code: grpc.StatusCode) -> None:
    calls, call = failing(code, 1)
    with pytest.raises(Refusal):
        with_retries(call, "test", wait_s=10.0)  # type: ignore[arg-type]
    assert len(calls) == 1
