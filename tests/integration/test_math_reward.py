"""math-verify as the dataset task's reward: it scores from the coordinator's reward threads (math-verify's
own timeouts work only on a main thread), a completion that would keep sympy busy for ever times out
after the deadline with its worker killed, and closing reaps every worker."""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.math_reward import math_verifier
from coordinator.problems import CallFailed
from coordinator.tasks import DatasetTask, build_task
from coordinator.user_code import WorkerPool
from fp8rl.config import load_config

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None, reason="math-verify is part of the dev extra"
)

# verify() of this against any number runs far past math-verify's 5 s (measured: > 60 s).
ENDLESS = "The answer is $\\boxed{9^{9^{9^{9}}}}$"


def gone(pid: int) -> bool:
    """The process has exited and been reaped (no zombie left)."""
    return not Path(f"/proc/{pid}").exists()


def test_the_dataset_reward_runs_math_verify_off_the_main_thread() -> None:
    config = load_config(
        CoordinatorConfig,
        dotted=["task=dataset", "dataset=gsm8k-sample", "prompt_key=question", "val_size=8"],
    )
    task = build_task(config)
    assert isinstance(task, DatasetTask) and isinstance(task._verify, WorkerPool)
    try:
        problems = task.val_problems()[:8]
        cases = [(p, f"So in all:\n#### {p.answer}", 1.0) for p in problems]
        cases += [(p, f"#### {int(p.answer) + 1}", 0.0) for p in problems]
        cases += [(p, f"That makes $\\boxed{{{p.answer}.0}}$.", 1.0) for p in problems]  # exact match: 0
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward") as threads:  # as batches.py
            scores = list(threads.map(lambda c: task.reward(c[0], c[1]), cases))
        assert scores == [want for _, _, want in cases]
        pids = task._verify.pids
        assert 1 <= len(pids) <= 4
    finally:
        task.close()
    assert all(gone(pid) for pid in pids)


def test_a_completion_past_the_deadline_times_out_and_its_worker_is_replaced() -> None:
    verifier = math_verifier(workers=2, deadline_s=1.0)
    try:
        assert verifier("46", "12+34=46") == 1.0  # starts a worker (imports sympy) before the clock
        first = verifier.pids
        start = time.monotonic()
        with pytest.raises(CallFailed, match=r"did not answer in 1.0 s"):
            verifier("46", ENDLESS)
        assert time.monotonic() - start < 5
        assert verifier.pids == [] and gone(first[0])  # killed and reaped
        with ThreadPoolExecutor(max_workers=2) as threads:  # the next calls start fresh workers
            assert list(threads.map(verifier, ["46", "7"], ["46", "#### 7"])) == [1.0, 1.0]
        pids = verifier.pids
    finally:
        verifier.close()
    assert pids and all(gone(pid) for pid in pids)


def test_a_worker_that_died_is_replaced_and_close_refuses_more() -> None:
    verifier = math_verifier(workers=1)
    try:
        assert verifier("3", "3") == 1.0
        (pid,) = verifier.pids
        os.kill(pid, signal.SIGKILL)  # the system killed it while idle
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # until it has died (the verifier reaps it)
        assert verifier("3", "three is 3") == 1.0 and verifier.pids != [pid]
    finally:
        verifier.close()
    with pytest.raises(RuntimeError, match="closed"):
        verifier("3", "3")
    assert verifier.pids == []
