"""``make test``'s runner: the suite as two pytest sessions side by side, each line prefixed with its lane.

On a 2-core machine one session kept about one core busy (1.06 of 2): the end-to-end tests wait (on child
processes starting, heartbeats, leases, links), while the component tests compute. So the end-to-end tier runs
in one lane (less a file that evens the lanes' times) and everything else in the other, each in its own
temporary root, TMPDIR and pytest cache (pytest keeps only its last three roots: two sessions sharing one
would remove each other's files), and each with one OpenMP thread per process: two sessions of 2-thread OpenMP
on 2 cores spin against each other at every barrier (measured: the base-model builder, 91 s alone, passed its
400 s deadline beside the engine tests). ``python -m tests.lanes [pytest options]`` passes the options to
both. It exits 0 only if both lanes pass (a lane that a selection leaves empty counts as passed, unless both
are), and ends with the failed tests' last error lines, their summary lines and one line of both sessions'
counts. Ctrl-C or SIGTERM reaches both sessions (their own cleanup runs); one that has not ended a minute
later is killed with its process group, and the runner exits 128 + the signal. Plain ``pytest`` (``make
test-one-session``) runs one session."""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
GRACE_S = 60.0
NO_TESTS = 5  # (pytest's exit status when a selection leaves a lane nothing to run)


@dataclass(frozen=True)
class Lane:
    name: str
    selection: tuple[str, ...]
    """pytest arguments that choose the lane's tests; together the lanes cover ``testpaths`` once."""


E2E = ROOT / "tests" / "e2e"
E2E_BESIDE_THE_REST = ("test_ray_run.py",)
"""End-to-end files that run in the other lane, so the two take about as long: on ef8c16b the e2e lane
took 34:20 and the rest 27:42, and the Ray node-loss tests (mostly waits, as the rest's engine tests are)
about 3.5 minutes."""


def files_pytest_collects(folder: Path) -> list[Path]:
    """The test files pytest collects under ``folder`` (its default ``python_files``, which
    pyproject.toml keeps)."""
    return sorted({*folder.rglob("test_*.py"), *folder.rglob("*_test.py")})


def _ignored(files: list[Path]) -> tuple[str, ...]:
    return tuple(f"--ignore={file.relative_to(ROOT)}" for file in files)


def _lanes() -> tuple[Lane, Lane]:
    """The end-to-end tier, less :data:`E2E_BESIDE_THE_REST`, and everything else. (pytest's ``--ignore``
    drops a path named on the command line too: the rest lane ignores every other e2e file instead.)"""
    e2e_files = files_pytest_collects(E2E)
    moved = [file for file in e2e_files if file.name in E2E_BESIDE_THE_REST]
    kept = [file for file in e2e_files if file.name not in E2E_BESIDE_THE_REST]
    return Lane("e2e", ("tests/e2e", *_ignored(moved))), Lane("rest", ("tests", *_ignored(kept)))


LANES = _lanes()
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def inductor_cache() -> str:
    """Where inductor keeps compiled kernels (vLLM's sampler compiles one at every engine start): the
    directory set for it, else torch's default, in the TMPDIR the lanes change: so the machine's cache
    stays shared by both lanes and by runs to come, not one lane's scratch."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # (no name for this uid: torch's own fallback)
        user = f"uid_{os.getuid()}"
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(
        Path(tempfile.gettempdir()) / f"torchinductor_{user}"
    )


def command(lane: Lane, root: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        *lane.selection,
        f"--basetemp={root / lane.name}",
        "-o",
        f"cache_dir=.pytest_cache/{lane.name}",
        "-v",  # (one line per test: the lanes' progress interleaves readably)
        *extra,
    ]


SUMMARY = re.compile(r"^=+ (.+) in [\d.]+s")  # pytest's closing line: "== 3 passed, 1 skipped in 2.1s =="
SHORT_SUMMARY = re.compile(r"^=+ short test summary info =+$")
FAILURE = re.compile(r"^(FAILED|ERROR) ")  # in the short summary: "FAILED tests/x.py::test - why"
REPORTS = re.compile(r"^=+ (FAILURES|ERRORS) =+$")  # the long reports' sections
# "____ test_two[param] ____" opens one test's report ("_ long_name _" when the name fills the line; not
# "_ _ _ _", which parts a traceback's entries)
REPORT_HEADER = re.compile(r"^_+ ([A-Za-z].*?) _+$")
ERROR_LINE = re.compile(r"^E\s")  # pytest's lines of the error itself ("E   assert 1 == 2")
ERROR_LINES_KEPT = 40  # a test's last error lines replayed at the end (a subprocess's tail, say)


def relay(
    lane: Lane,
    stream: IO[str],
    lock: threading.Lock,
    counts: Counter[str],
    failures: list[str],
    errors: list[tuple[str, deque[str]]],
) -> None:
    """Copies the session's lines, prefixed; adds its closing line's counts to ``counts``, its
    short-summary lines of failed tests to ``failures`` (only there: captured logs have ERROR lines), and
    each failed test's last error lines (its report's ``E`` lines) to ``errors``, a report each: a summary
    line holds only an error's first line, which for a subprocess's output is often blank."""
    width = max(len(lane.name) for lane in LANES)
    in_short_summary = in_reports = False
    current: deque[str] | None = None  # (this lane's report now: the other lane appends to errors too)
    for line in stream:
        prefixed = f"[{lane.name:<{width}}] {line}"
        bare = line.rstrip("\n")
        with lock:
            if summary := SUMMARY.match(line):
                in_short_summary = False
                for number, outcome in re.findall(r"(\d+) (\w+)", summary.group(1)):
                    counts[outcome] += int(number)
            elif SHORT_SUMMARY.match(bare):
                in_short_summary, in_reports = True, False
            elif REPORTS.match(bare):
                in_reports = True
            elif in_reports and (header := REPORT_HEADER.match(bare)):
                # (a report per header: two files' tests of one name are two reports)
                current = deque(maxlen=ERROR_LINES_KEPT)
                errors.append((f"[{lane.name}] {header.group(1)}", current))
            elif in_reports and current is not None and ERROR_LINE.match(line):
                current.append(bare)
            elif in_short_summary and FAILURE.match(line):
                failures.append(prefixed.rstrip("\n"))
            sys.stdout.write(prefixed)
            sys.stdout.flush()


def signal_all(procs: list[subprocess.Popen[str]], sig: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # (ended meanwhile)
                os.killpg(proc.pid, sig)


def end(procs: list[subprocess.Popen[str]], sig: int) -> None:
    """``sig`` to every session still running (its process group), SIGKILL after ``GRACE_S``."""
    signal_all(procs, sig)
    deadline = time.monotonic() + GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_all([proc], signal.SIGKILL)
            proc.wait()


def run(extra: list[str]) -> int:
    root = Path(tempfile.mkdtemp(prefix="fp8rl-tests-"))
    lock = threading.Lock()
    procs: list[subprocess.Popen[str]] = []
    relays = []
    counts: Counter[str] = Counter()
    failures: list[str] = []
    errors: list[tuple[str, deque[str]]] = []
    started = time.monotonic()

    interrupted: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        # Passed on only: the main thread's waits return as the sessions end (a handler that exits
        # would unwind from whatever the main thread was doing, which once left the runner hanging).
        if not interrupted:
            # (SIGINT: pytest's own KeyboardInterrupt path, so fixtures tear down; SIGKILL a minute on)
            signal_all(procs, signal.SIGINT)
            killer = threading.Timer(GRACE_S, signal_all, (procs, signal.SIGKILL))
            killer.daemon = True
            killer.start()
        else:  # (asked again: at once)
            signal_all(procs, signal.SIGKILL)
        interrupted.append(signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        for lane in LANES:
            if interrupted:  # (before the second lane started: it never starts)
                break
            # Each lane's scratch files (vLLM's rendezvous files and sockets, torchrun's logs: a killed
            # process leaves its own) go in a TMPDIR under the root, removed with it.
            scratch = root / f"{lane.name}-tmp"
            scratch.mkdir()
            proc = subprocess.Popen(
                command(lane, root, extra),
                cwd=ROOT,
                # (a thread count set by hand stands)
                env={
                    **ONE_THREAD,
                    **os.environ,
                    "TORCHINDUCTOR_CACHE_DIR": inductor_cache(),
                    "TMPDIR": str(scratch),
                },
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # (its own group: a signal reaches the session and its children)
            )
            procs.append(proc)
            assert proc.stdout is not None
            relays.append(
                threading.Thread(
                    target=relay, args=(lane, proc.stdout, lock, counts, failures, errors), daemon=True
                )
            )
            relays[-1].start()
        codes = [proc.wait() for proc in procs]
        for thread in relays:
            thread.join()
    finally:
        end(procs, signal.SIGTERM)
    if interrupted:
        print(f"lanes: interrupted; their files stay in {root}")
        return 128 + interrupted[0]
    minutes = (time.monotonic() - started) / 60
    summary = ", ".join(f"{lane.name} exit {code}" for lane, code in zip(LANES, codes, strict=True))
    # (both sessions' counts on one plain line, as a reader of the output expects a runner to end)
    failing = sum(code not in (0, NO_TESTS) for code in codes)
    failed = max(counts["failed"] + counts["error"] + counts["errors"], failing)  # (one died unsummed)
    # (the failed tests again at the very end: a log read from its tail, as CI's is, must name them; the
    # other lane's output can bury a lane's own summary), each failed test's error lines first
    for test, lines in errors:
        for line in lines:
            print(f"lanes: {test}: {line}")
    for failure in failures:
        print(f"lanes: {failure}")
    print(f"lanes: {counts['passed']} passed, {failed} failed, {counts['skipped']} skipped")
    if failing or all(code == NO_TESTS for code in codes):
        print(f"lanes: {summary} in {minutes:.1f} min; their files stay in {root}")
        return 1
    shutil.rmtree(root, ignore_errors=True)
    print(f"lanes: {summary} in {minutes:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
