"""One target under atheris (libFuzzer), coverage-guided over fp8rl and the two services' code:

    python -m tests.fuzz.runner TARGET --seconds 40 [--work DIR] [--artifacts DIR]

Starts from the committed seed corpus ``tests/fuzz/corpus/TARGET`` (read, never written: new inputs go to
``--work``). A crash (an exception the target does not accept, a broken invariant), a hang (an input
running past --input-timeout seconds) or a memory blow-up (past --rss-mb) stops the run with a non-zero
exit status and writes the input to ``--artifacts`` (``crash-*``, ``timeout-*``, ``oom-*``); libFuzzer's
final statistics (``stat::number_of_executed_units``...) close its output.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

INSTRUMENTED = ["fp8rl", "rollout_service", "trainer_service"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("target")
    parser.add_argument("--seconds", type=int, default=40)
    parser.add_argument("--work", help="where new inputs go (default: a temporary directory)")
    parser.add_argument("--artifacts", default=".", help="where a crashing input is written")
    parser.add_argument("--input-timeout", type=int, default=20)
    parser.add_argument("--rss-mb", type=int, default=4096)
    args = parser.parse_args()

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
