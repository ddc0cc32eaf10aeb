"""math-verify as a reward, callable from any thread and bounded in time.

math-verify's ``parse``/``verify`` time out with ``signal.alarm``, which works only on a process's main
thread (off it they raise), and the coordinator scores completions on a thread pool. So each score runs
in a user-code worker (coordinator/user_code.py), with math-verify's own timeouts off
(``parsing_timeout=None``, ``timeout_seconds=None``): past the run's reward deadline the worker is killed
and the call raises :class:`CallFailed`, which the batch scores 0 and counts. A completion that makes
sympy compute for ever (``\\boxed{9^{9^{9^{9}}}}``) costs one deadline, never a hung coordinator.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from coordinator.user_code import WorkerPool

DEADLINE_S = 5.0  # per completion (math-verify's own default is 5 s per parse and per comparison)
MEMORY_MB = 2048
MAX_CHARS = 8192  # a completion is cut to its tail: math-verify reads the rightmost answer first
WORKERS = 4  # the coordinator's reward threads (coordinator/batches.py)


def score(answer: str, completion: str) -> float:
    """1.0 if math-verify finds ``completion``'s answer equal to ``answer``, else 0.0. No timeout: call it
    where the caller bounds the time (a worker)."""
    from math_verify import parse, verify

    gold, target = parse(answer, parsing_timeout=None), parse(completion, parsing_timeout=None)
    return float(verify(gold, target, timeout_seconds=None))


def scorer() -> Callable[[str, str], float]:
    """A worker's callable: math-verify imported once, its errors scored as no match."""
    # The time is bounded by the caller; math-verify's warning that it is not would only be noise.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401  (an import error fails the worker's start, not a sample)

    def one(answer: str, completion: str) -> float:
        try:
            return score(answer, completion[-MAX_CHARS:])
        except Exception:  # math-verify swallows its own errors; anything else is no match
            return 0.0

    return one


def math_verifier(
    workers: int = WORKERS, deadline_s: float = DEADLINE_S, memory_mb: int = MEMORY_MB
) -> WorkerPool:
    """``verifier(answer, completion) -> 1.0 | 0.0`` from any thread; raises CallFailed after
    ``deadline_s``. ``close()`` kills the workers."""
    return WorkerPool(
        "coordinator.math_reward:scorer",
        name="math-verify",
        workers=workers,
        deadline_s=deadline_s,
        memory_mb=memory_mb,
    )
