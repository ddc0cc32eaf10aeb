"""Sustained load: an embedded training run while a bounded client pool floods the replica's Generate.

Runs ``coordinator start`` (embedded: redis-server, trainer, one replica; the shipped tiny model unless
--model is given) for --minutes, while --clients threads (by default more than the replica's 10 Generate
slots, so its caps are met) call the replica's Generate over real gRPC with the run's reader token, as
fast as it answers: half good requests, half bad ones (invalid fields, a weight version the replica does
not hold, an oversized prompt, an oversized request, too many samples, no token, a wrong token). Then
`coordinator stop` ends the run at a step boundary. Printed, from this one run:

- p50 / p99 latency of the good requests served (queued behind the run's own generation);
- answers by gRPC status code, per request kind. Each bad kind has the code it must get
  (INVALID_ARGUMENT, FAILED_PRECONDITION, UNAUTHENTICATED, RESOURCE_EXHAUSTED), and any request may get
  RESOURCE_EXHAUSTED while the replica is at capacity; any other answer (INTERNAL, UNAVAILABLE,
  DEADLINE_EXCEEDED, OK to a bad request) is a failure;
- the run's steps (each committed exactly once, in order; no supervisor restart; exit status 0);
- the step time under the flood against the same run's clean steps before it (--clean-minutes): the
  median step_s of each, and their ratio (bound: <= --max-slowdown, 1.2: the run's own Generate calls
  come first, rollout_service/generation.py);
- the RSS of every process of the run (coordinator, redis-server, trainer, replica, any children such
  as a vLLM engine core), sampled every --sample-s during the load: after a warm-up (its first fifth),
  the median of the last third over the median of the first third, per process. Bound: each ratio
  <= --max-growth (1.10), or growth <= --max-growth-mib (16 MiB; redis-server holds a few MiB).

Exit status 1 on any failure.

The clients run in a child process: on the run's cores (the default), or with --clients-idle under
SCHED_IDLE, where they take only CPU the run leaves, as clients on other machines would; on a machine of
few cores that separates what the replica pays for a flood from what the flooding clients themselves use.

With --pin-replica the replica runs on a CPU of its own and the rest of the run on the others (clean
steps and flooded alike), as a replica on its own accelerator host would; the flooding clients then run
on the replica's CPU, where such a host would handle its callers' traffic. The CPU each process of the run
used per step, clean and under the flood, is printed too: where the flood's cost lands.

    python bench/sustained_load.py [--minutes 10] [--clean-minutes 2] [--clients 12] [--clients-idle]
        [--pin-replica] [--model DIR] [--recipe fp8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from fp8rl.run_secrets import security_for
from fp8rl.security import SecurityConfig
from fp8rl.transport import channel
from fp8rl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

ROLES = {"redis-server": "redis-server", "trainer_service": "trainer", "rollout_service": "replica"}
BUSY = frozenset({"RESOURCE_EXHAUSTED"})  # any request may be refused while the replica is at capacity
DEADLINE_S = 120.0  # a good request that waits longer than this counts as a failure (DEADLINE_EXCEEDED)


@dataclass(frozen=True)
class Kind:
    """One kind of request the clients send, the identity it is sent with, and the codes it may get."""

    name: str
    request: rollout_pb2.GenerateRequest
    allowed: frozenset[str]
    caller: str = "reader"  # "reader": the run's reader token; "anonymous": none; "forged": a wrong one


def prompt(text: str) -> rollout_pb2.Prompt:
    return rollout_pb2.Prompt(text=text)


def bad_kinds() -> list[Kind]:
    invalid = frozenset({"INVALID_ARGUMENT"})
    one, twice = [prompt("1+1=")], rollout_pb2.Prompt(id="a", text="1+1=")
    return [
        Kind("n=0", rollout_pb2.GenerateRequest(prompts=one, n=0), invalid),
        Kind("no prompts", rollout_pb2.GenerateRequest(), invalid),
        Kind(
            "temperature inf",
            rollout_pb2.GenerateRequest(prompts=one, sampling=common_pb2.SamplingParams(temperature=1e999)),
            invalid,
        ),
        Kind(
            "token id out of vocab",
            rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt(token_ids=rollout_pb2.TokenIds(ids=[1 << 30]))]
            ),
            invalid,
        ),
        Kind("duplicate ids", rollout_pb2.GenerateRequest(prompts=[twice, twice]), invalid),
        Kind(
            "max_tokens past context",
            rollout_pb2.GenerateRequest(prompts=one, sampling=common_pb2.SamplingParams(max_tokens=1 << 20)),
            invalid,
        ),
        Kind(
            "a future weight version",
            rollout_pb2.GenerateRequest(prompts=one, weight_version=1 << 40),
            frozenset({"FAILED_PRECONDITION"}),
        ),
        Kind("100 kB prompt", rollout_pb2.GenerateRequest(prompts=[prompt("9" * 100_000)]), invalid),
        # Past the 4 MiB request limit: the replica names the field, or gRPC refuses the message.
        Kind(
            "5 MiB request",
            rollout_pb2.GenerateRequest(prompts=[prompt("7" * 1000 + str(i)) for i in range(5000)]),
            invalid,
        ),
        Kind(
            "6400 samples",
            rollout_pb2.GenerateRequest(prompts=[prompt(f"{i}+1=") for i in range(100)], n=64),
            BUSY,
        ),
        Kind("no token", good_request(random.Random(0)), frozenset({"UNAUTHENTICATED"}), "anonymous"),
        Kind("wrong token", good_request(random.Random(0)), frozenset({"UNAUTHENTICATED"}), "forged"),
    ]


def good_request(rng: random.Random) -> rollout_pb2.GenerateRequest:
    a, b = rng.randrange(100), rng.randrange(100)
    return rollout_pb2.GenerateRequest(
        prompts=[prompt(f"{a}+{b}=")], n=2, sampling=common_pb2.SamplingParams(max_tokens=8, temperature=1.0)
    )


@dataclass
class Tally:
    """What the clients saw: answers per (kind, code), good-request latencies (s), the unexpected."""

    codes: Counter[tuple[str, str]]
    latencies: list[float]
    failures: Counter[tuple[str, str]]
    lock: threading.Lock

    def record(self, kind: Kind, code: str, seconds: float) -> None:
        with self.lock:
            self.codes[kind.name, code] += 1
            if kind.name == "good" and code == "OK":
                self.latencies.append(seconds)
            if code not in kind.allowed | BUSY:
                self.failures[kind.name, code] += 1


def client(
    stubs: dict[str, rollout_pb2_grpc.RolloutStub], seed: int, tally: Tally, stop: threading.Event
) -> None:
    rng, bad = random.Random(seed), bad_kinds()
    while not stop.is_set():
        kind = Kind("good", good_request(rng), frozenset({"OK"})) if rng.random() < 0.5 else rng.choice(bad)
        started = time.perf_counter()
        try:
            stubs[kind.caller].Generate(kind.request, timeout=DEADLINE_S)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
        tally.record(kind, code, time.perf_counter() - started)


def flood_process(args: argparse.Namespace) -> int:
    """``--flood-only ADDRESS``: the clients, in a process of their own, until SIGTERM; then what they saw,
    as JSON on stdout."""
    tally, stop = Tally(Counter(), [], Counter(), threading.Lock()), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.clients_idle:  # before any thread starts: gRPC's threads and the clients' inherit it
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    if args.clients_cpu is not None:
        os.sched_setaffinity(0, {args.clients_cpu})
    finish = flood(args.flood_only, Path(args.secrets), args.clients, tally, stop)
    while not stop.wait(0.5):
        pass
    finish()
    counts = {name: [[*key, n] for key, n in getattr(tally, name).items()] for name in ("codes", "failures")}
    print(json.dumps(counts | {"latencies": tally.latencies}))
    return 0


class FloodProcess:
    """:func:`flood`'s clients in a child process (:func:`flood_process`). ``idle``: under SCHED_IDLE,
    gRPC's own threads included, so they take only CPU the run leaves (as clients on other machines
    would); otherwise they compete with the run on the same cores."""

    def __init__(self, address: str, secrets: Path, clients: int, idle: bool, cpu: int | None) -> None:
        command = [sys.executable, __file__, "--flood-only", address, "--secrets", str(secrets)]
        command += ["--clients", str(clients), *(["--clients-idle"] if idle else [])]
        command += ["--clients-cpu", str(cpu)] if cpu is not None else []
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)

    def finish(self) -> Tally:
        """Stop the clients (each ends its call in flight) and read what they saw."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=DEADLINE_S + 60)
        if not out.strip():
            raise SystemExit(f"the flooding process ended with status {self.proc.returncode} and no tally")
        seen = json.loads(out)
        codes, failures = (Counter({(k, c): n for k, c, n in seen[name]}) for name in ("codes", "failures"))
        return Tally(codes, seen["latencies"], failures, threading.Lock())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def flood(
    address: str, secrets: Path, clients: int, tally: Tally, stop: threading.Event
) -> Callable[[], None]:
    """Start ``clients`` threads against the replica at ``address``; returns what waits for them to finish
    their last call (after ``stop``) and closes their channels."""
    forged = secrets.parent / "forged.token"
    forged.write_text("not-the-reader-token\n")
    callers = {
        "reader": security_for(secrets, "reader", tls=False),
        "anonymous": SecurityConfig(),
        "forged": SecurityConfig(token_file=forged),
    }
    channels = {name: channel(address, security, "rollout") for name, security in callers.items()}
    stubs = {name: rollout_pb2_grpc.RolloutStub(chan) for name, chan in channels.items()}
    threads = [threading.Thread(target=client, args=(stubs, i, tally, stop)) for i in range(clients)]
    for thread in threads:
        thread.start()

    def finish() -> None:
        for thread in threads:
            thread.join()
        for chan in channels.values():
            chan.close()

    return finish


# -- memory ----------------------------------------------------------------------------------------------


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from /proc."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):  # (a process that has just exited)
                todo += [int(c) for c in (task / "children").read_text().split()]
    return found


def rss_and_name(pid: int, root: int) -> tuple[int, str] | None:
    """(resident bytes, a name for the process: its role in the run, else its executable)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    rss = next(
        (int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), None
    )
    if rss is None:  # (a zombie: exited, not yet reaped)
        return None
    if pid == root:
        return rss, "coordinator"
    name = next((role for key, role in ROLES.items() if key in cmdline), "")
    comm = next(line.split(None, 1)[1] for line in status.splitlines() if line.startswith("Name:"))
    return rss, name or f"{comm.strip()} ({pid})"


def watch_memory(
    root: int, every_s: float, samples: list[tuple[float, dict[str, int]]], stop: threading.Event
) -> None:
    started = time.monotonic()
    while not stop.wait(every_s):
        now: dict[str, int] = defaultdict(int)
        for pid in tree(root):
            found = rss_and_name(pid, root)
            if found:
                now[found[1]] += found[0]
        samples.append((time.monotonic() - started, dict(now)))


def growth(samples: list[tuple[float, dict[str, int]]], warm_up_s: float) -> dict[str, tuple[float, float]]:
    """Per process: (median RSS of the first third after warm-up, of the last third), bytes."""
    kept = [s for t, s in samples if t >= warm_up_s]
    third = max(1, len(kept) // 3)
    first, last = kept[:third], kept[-third:]
    names = set().union(*first, *last) if kept else set()
    return {
        name: (
            statistics.median(s.get(name, 0) for s in first),
            statistics.median(s.get(name, 0) for s in last),
        )
        for name in sorted(names)
    }


def cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) each process of the run has used so far, by name; and, as
    "replica: <thread name>", by the replica's threads (gRPC core's threads are named; Python's are not)."""
    tick = os.sysconf("SC_CLK_TCK")
    used: dict[str, float] = defaultdict(float)

    def seconds(stat_path: Path) -> tuple[float, str] | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = stat_path.read_text()
            name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
            return (int(fields[11]) + int(fields[12])) / tick, name  # (utime, stime: fields 14 and 15)
        return None

    for pid in tree(root):
        found, process = rss_and_name(pid, root), seconds(Path(f"/proc/{pid}/stat"))
        if not found or not process:
            continue
        used[found[1]] += process[0]
        if found[1] == "replica":
            for task in Path(f"/proc/{pid}/task").glob("*"):
                if thread := seconds(task / "stat"):
                    used[f"replica: {thread[1]}"] += thread[0]
    return dict(used)


def pin_replica(root: int) -> str:
    """The replica (every thread, and its children) on the last CPU, the rest of the run on the others: each
    side then has cores of its own, as a replica on its own accelerator host has (threads started later
    inherit their creator's CPUs)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin-replica needs two CPUs or more")
    replica_cpus, run_cpus = {cpus[-1]}, set(cpus[:-1])
    replica = [p for p in tree(root) if (found := rss_and_name(p, root)) and found[1] == "replica"]
    if not replica:
        raise SystemExit("--pin-replica: no replica process found")
    on_replica = set().union(*(tree(p) for p in replica))
    for pid in tree(root):
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError):  # (a thread that has just exited)
                os.sched_setaffinity(int(task.name), replica_cpus if pid in on_replica else run_cpus)
    return f"replica on CPU {cpus[-1]}, the rest of the run on CPUs {','.join(map(str, sorted(run_cpus)))}"


# -- the run ---------------------------------------------------------------------------------------------


def wait_for(what: str, ready: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 900
    while not ready():
        if proc.poll() is not None:
            raise SystemExit(f"coordinator exited with {proc.returncode} before {what}; log: {log}")
        if time.monotonic() > deadline:
            raise SystemExit(f"no {what} after 900 s; log: {log}")
        time.sleep(0.5)


def records(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    found = []
    for line in lines:
        with contextlib.suppress(json.JSONDecodeError):  # (a line being written)
            found.append(json.loads(line))
    return found


def committed(run_dir: Path) -> list[int]:
    return [int(r["step"]) for r in records(run_dir)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--minutes", type=float, default=10.0, help="load time, from the first committed step"
    )
    parser.add_argument(
        "--clients", type=int, default=12, help="flooding threads (more than the replica's 10 Generate slots)"
    )
    parser.add_argument(
        "--clean-minutes", type=float, default=2.0, help="clean steps first, the baseline of the step time"
    )
    parser.add_argument("--max-slowdown", type=float, default=1.2, help="bound: step time flood / clean")
    parser.add_argument("--model", type=Path, help="HF checkpoint (default: the shipped tiny model)")
    parser.add_argument("--recipe", default="fp8")
    parser.add_argument("--sample-s", type=float, default=2.0, help="seconds between RSS samples")
    parser.add_argument("--max-growth", type=float, default=1.10)
    parser.add_argument("--max-growth-mib", type=float, default=16.0)
    parser.add_argument(
        "--clients-idle",
        action="store_true",
        help="run the clients under SCHED_IDLE: the CPU they take is then only what the run leaves, as "
        "with clients on other machines (on one machine, they otherwise compete for the same cores)",
    )
    parser.add_argument(
        "--pin-replica",
        action="store_true",
        help="the replica (and the flooding clients) on the last CPU and the rest of the run on the others, "
        "from the first step on (clean and flooded alike): as with a replica on a host of its own",
    )
    parser.add_argument("--flood-only", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--secrets", help=argparse.SUPPRESS)
    parser.add_argument("--clients-cpu", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flood_only:
        return flood_process(args)
    work = Path(tempfile.mkdtemp(prefix="fp8rl-load-"))
    run_dir, log = work / "run", work / "coordinator.log"
    coordinator = [sys.executable, "-m", "coordinator.cli"]
    command = [*coordinator, "start", "--recipe", args.recipe, "--steps", "1000000", "--run-id", "load"]
    command += ["--run-dir", str(run_dir), "--val-every", "0", "--progress", "plain"]
    command += ["--model", str(args.model)] if args.model else []
    samples: list[tuple[float, dict[str, int]]] = []
    stop_memory = threading.Event()
    flooding: FloodProcess | None = None
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_for("a first step", lambda: len(committed(run_dir)) >= 2, proc, log)
        if args.pin_replica:
            print(pin_replica(proc.pid))
        clean_from, cpu = committed(run_dir)[-1], [cpu_seconds(proc.pid)]
        time.sleep(args.clean_minutes * 60)
        address = json.loads((run_dir / "run.json").read_text())["rollouts"][0]
        watcher = threading.Thread(target=watch_memory, args=(proc.pid, args.sample_s, samples, stop_memory))
        watcher.start()
        # (pinned: the clients on the replica's CPU, where a replica host handles its callers' traffic)
        clients_cpu = max(os.sched_getaffinity(0)) if args.pin_replica else None
        flooding = FloodProcess(address, run_dir / "secrets", args.clients, args.clients_idle, clients_cpu)
        started, first_step = time.monotonic(), committed(run_dir)[-1]
        cpu.append(cpu_seconds(proc.pid))
        while time.monotonic() - started < args.minutes * 60 and proc.poll() is None:
            time.sleep(1)
        cpu.append(cpu_seconds(proc.pid))
        last_step = committed(run_dir)[-1]
        stop_memory.set()
        load_s = time.monotonic() - started
        tally = flooding.finish()
        if proc.poll() is None:
            subprocess.run([*coordinator, "stop", "--run-id", "load", "--run-dir", str(run_dir)], check=True)
        status = proc.wait(timeout=600)
        watcher.join()
    finally:
        stop_memory.set()
        if flooding:
            flooding.kill()
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    step_s = {int(r["step"]): float(r["step_s"]) for r in records(run_dir) if "step_s" in r}
    clean = [t for k, t in step_s.items() if clean_from < k <= first_step]
    loaded = [t for k, t in step_s.items() if k > first_step + 1]  # (not the step the flood began in)
    print_cpu(
        (
            Phase("clean", cpu=(cpu[0], cpu[1]), steps=first_step - clean_from),
            Phase("flood", cpu=(cpu[1], cpu[2]), steps=last_step - first_step),
        )
    )
    return report(args, tally, samples, committed(run_dir), first_step, load_s, status, log, (clean, loaded))


@dataclass(frozen=True)
class Phase:
    name: str
    cpu: tuple[dict[str, float], dict[str, float]]
    """CPU seconds by process at the phase's start and end (:func:`cpu_seconds`)."""
    steps: int


def print_cpu(phases: tuple[Phase, ...]) -> None:
    """CPU seconds per committed step, by process of the run, in each phase: where a flood's cost lands."""
    names = sorted(set().union(*(set(p.cpu[1]) for p in phases)), key=lambda n: (n.startswith("replica:"), n))
    print("CPU seconds per step (user + system), by process; the replica's named threads below it:")
    print(f"  {'':32s}" + "".join(f"{f'{p.name} ({p.steps} steps)':>22s}" for p in phases))
    for name in names:
        per_step = [(p.cpu[1].get(name, 0.0) - p.cpu[0].get(name, 0.0)) / max(p.steps, 1) for p in phases]
        if max(per_step) >= 0.005:
            print(f"  {name[:32]:32s}" + "".join(f"{v:22.3f}" for v in per_step))


def report(
    args: argparse.Namespace,
    tally: Tally,
    samples: list[tuple[float, dict[str, int]]],
    steps: list[int],
    first_step: int,
    load_s: float,
    status: int,
    log: Path,
    step_times: tuple[list[float], list[float]],
) -> int:
    failed = []
    clean, loaded = step_times
    if clean and loaded:
        ratio = statistics.median(loaded) / statistics.median(clean)
        print(
            f"step time: clean median {statistics.median(clean):.2f} s ({len(clean)} steps), under the "
            f"flood {statistics.median(loaded):.2f} s ({len(loaded)} steps): {ratio:.2f}x "
            f"(bound {args.max_slowdown:g})"
        )
        failed += [] if ratio <= args.max_slowdown else [f"steps {ratio:.2f}x slower under the flood"]
    else:
        failed.append(f"too few steps to compare: {len(clean)} clean, {len(loaded)} under the flood")
    where = "under SCHED_IDLE" if args.clients_idle else "on the same cores as the run"
    where += "; replica pinned to a CPU of its own" if args.pin_replica else ""
    print(f"load: {load_s / 60:.1f} min, {args.clients} clients ({where}), recipe {args.recipe}; log {log}")
    lat = sorted(tally.latencies)
    if lat:
        p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        print(
            f"good requests served: {len(lat)}, latency p50 {p50:.2f} s, p99 {p99:.2f} s, max {lat[-1]:.2f} s"
        )
    else:
        failed.append("no good request was served")
    print("answers by kind and code:")
    for kind in sorted({k for k, _ in tally.codes}):
        codes = ", ".join(f"{c} {n}" for (k, c), n in sorted(tally.codes.items()) if k == kind)
        print(f"  {kind:24s} {codes}")
    totals = Counter[str]()
    for (_, code), n in tally.codes.items():
        totals[code] += n
    print("by code: " + ", ".join(f"{c} {n}" for c, n in totals.most_common()))
    failed += [f"{kind} answered {code} ({n}x)" for (kind, code), n in sorted(tally.failures.items())]
    restarts = log.read_text(errors="replace").count("restarting (")
    in_order = steps == list(range(len(steps)))
    print(
        f"steps: {len(steps) - 1} committed ({len(steps) - 1 - first_step} under load), each once in order: "
        f"{in_order}; supervisor restarts: {restarts}; coordinator exit status {status}"
    )
    failed += [] if in_order else ["steps missing, repeated or out of order"]
    failed += [f"{restarts} supervisor restarts"] if restarts else []
    failed += [f"coordinator exit status {status}"] if status else []
    warm_up_s = load_s / 5
    print(
        f"RSS (MiB), {len(samples)} samples every {args.sample_s:g} s; after {warm_up_s:.0f} s of warm-up, "
        f"first third -> last third (bound: ratio <= {args.max_growth:g} "
        f"or growth <= {args.max_growth_mib:g} MiB):"
    )
    for name, (first, last) in growth(samples, warm_up_s).items():
        ratio, mib = last / first if first else float("inf"), (last - first) / 2**20
        ok = ratio <= args.max_growth or mib <= args.max_growth_mib
        print(
            f"  {name:16s} {first / 2**20:8.1f} -> {last / 2**20:8.1f}  ratio {ratio:.3f}  "
            f"{mib:+7.1f} MiB  {'ok' if ok else 'GROWS'}"
        )
        failed += [] if ok else [f"{name} RSS grew {ratio:.3f}x ({mib:+.1f} MiB)"]
    print("RSS over time (MiB):")
    names = sorted(set().union(*(s for _, s in samples))) if samples else []
    print("  " + " ".join(f"{n[:12]:>12s}" for n in ["t (s)", *names]))
    for t, s in samples[:: max(1, len(samples) // 10)] + samples[-1:]:
        print("  " + " ".join(f"{v:12.1f}" for v in [t, *(s.get(n, 0) / 2**20 for n in names)]))
    for line in failed:
        print(f"FAILED: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
