"""One target under atheris (libFuzzer), coverage-guided over fp8rl and the two services' code:

    python -m tests.fuzz.runner TARGET --seconds 40 [--work DIR] [--artifacts DIR]

Starts from the committed seed corpus ``tests/fuzz/corpus/TARGET`` (read, never written: new inputs go to
``--work``). A crash (an exception the target does not accept, a broken invariant), a hang (an input
running past --input-timeout seconds) or a memory blow-up (past --rss-mb) stops the run with a non-zero
exit status and writes the input to ``--artifacts`` (``crash-*``, ``timeout-*``, ``oom-*``); libFuzzer's
final statistics (``stat::number_of_executed_units``...) close its output.

Launched by a big process (a pytest session holding vLLM, several GB), the runner first starts itself
again, as its own child: libFuzzer's -rss_limit_mb reads the peak RSS from getrusage, and Linux carries
the peak of the image that exec replaced into it (exec_mmap keeps the old mm's high-water mark in the
process's maxrss; with vfork, as subprocess starts children, that is the launcher's whole peak). Every
run from the full suite then read pytest's 5-6 GB as its own and stopped as out of memory at its first
check. A child forked by the small runner inherits only the runner's few MB.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

INSTRUMENTED = ["fp8rl", "rollout_service", "trainer_service"]
RELAUNCHED = "FP8RL_FUZZ_RELAUNCHED"  # set in the runner's own child (it never starts another)
INHERITED_SLACK_MB = 64  # a peak above this process's own by more than this came with exec
PR_SET_PDEATHSIG = 1


def inherited_peak_mb() -> int:
    """How far the peak RSS getrusage reports (what libFuzzer's -rss_limit_mb reads) exceeds this
    process's own high-water mark (VmHWM in /proc/self/status), in MB: what it inherited across exec."""
    reported = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    found = re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    own = int(found.group(1)) if found else reported
    return (reported - own) >> 10


def relaunch() -> int:
    """This command again, in a child of this (small) process; its exit status. The child dies with
    this process (a launcher's timeout kills this one)."""
    env = {**os.environ, RELAUNCHED: str(os.getpid())}
    return subprocess.run([sys.executable, "-m", "tests.fuzz.runner", *sys.argv[1:]], env=env).returncode


def die_with_launcher() -> None:
    """In the relaunched child: be killed when the runner that started it goes (Linux's parent-death
    signal), so a killed runner leaves no fuzzer behind."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(os.environ[RELAUNCHED]):  # it went before the signal was set
        os._exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("target")
    parser.add_argument("--seconds", type=int, default=40)
    parser.add_argument("--work", help="where new inputs go (default: a temporary directory)")
    parser.add_argument("--artifacts", default=".", help="where a crashing input is written")
    parser.add_argument("--input-timeout", type=int, default=20)
    parser.add_argument("--rss-mb", type=int, default=4096)
    args = parser.parse_args()
    if RELAUNCHED in os.environ:
        die_with_launcher()
    elif (inherited := inherited_peak_mb()) > INHERITED_SLACK_MB:
        print(f"fuzz: {inherited} MB of peak RSS inherited across exec; fuzzing in a fresh child", flush=True)
        sys.exit(relaunch())

    import atheris

    with atheris.instrument_imports(include=INSTRUMENTED):
        from tests.fuzz.targets import CORPUS, DICTS, TARGETS, run_one

        target = TARGETS[args.target]
        for module in target.modules:
            importlib.import_module(module)
    seeds = sorted((CORPUS / target.name).iterdir())
    for seed in seeds:  # warm-up, outside the clock (a tokenizer to load, an app to build)
        run_one(target, seed.read_bytes())
    print(f"fuzz {target.name}: {len(seeds)} seed inputs replayed", flush=True)
    work = args.work or tempfile.mkdtemp(prefix=f"fuzz-{target.name}-")
    Path(work).mkdir(parents=True, exist_ok=True)
    Path(args.artifacts).mkdir(parents=True, exist_ok=True)
    libfuzzer = [
        sys.argv[0],
        f"-max_total_time={args.seconds}",
        f"-timeout={args.input_timeout}",
        f"-rss_limit_mb={args.rss_mb}",
        "-max_len=65536",
        "-print_final_stats=1",
        f"-artifact_prefix={args.artifacts.rstrip('/')}/",
        *([f"-dict={DICTS / target.dictionary}"] if target.dictionary else []),
        work,
        str(CORPUS / target.name),
    ]
    atheris.Setup(libfuzzer, lambda data: run_one(target, data))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
