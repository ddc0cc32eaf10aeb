"""Chaos: an embedded training run on the tiny model while faults come at random, several at once, from
a seed that is printed (``--seed`` replays the same schedule):

- kill -9 of a child (the trainer, the replica, redis-server) or of the coordinator itself;
- a partition of one service's port (iptables DROP both ways on loopback), random loss on every link
  (iptables' statistic match), or latency on one service's link, for seconds: these machines' kernels
  have no netem, so its connections are reset and new ones go through tests/faultproxy.py (an iptables
  REDIRECT), which holds every chunk 25-200 ms each way;
- a Generate flood (valid and invalid requests, as fast as the replicas answer) for seconds;
- a replica added (started by hand with the run's Redis URL and secrets, as a user adds one: it
  registers, the coordinator finds it and sends it a keyframe) or removed (SIGTERM or kill -9);
- a full run directory (its filesystem filled to the last byte) for seconds.

The seed fixes the sequence of faults and their lengths (their moments follow the machine's speed).
The run lives in a network and mount namespace of its own (``unshare``, as root): the rules, the
latency and the small tmpfs that holds the run directory touch nothing outside. Whenever the
coordinator ends without finishing (killed, its Redis gone, its disk full), it is started again on the
same run, as a user would. Printed at the end, and written to ``--out``/report.json:

- every step committed exactly once, in order (the metrics), and the trainer's newest checkpoint is the
  last step (its own counter);
- every version a reader was served was one the trainer had published by then;
- faults by kind, the coordinator's restarts of its children, reruns, heals, and the longest stall
  (seconds between two commits);
- the final validation accuracy, and with ``--clean`` that of the same run without faults.

Exit status 1 if a check fails. Needs root (namespaces, iptables, tc).

    python bench/chaos.py [--steps 400] [--minutes M] [--until-covered] [--seed N] [--clean] [--out DIR]

The hour-long form: ``--minutes 60 --steps 100000 --clean``. The shortest that still meets every kind
(the suite's, tests/e2e/test_chaos.py): ``--until-covered``, which ends the faults once each kind has been
applied, a flood has been served, and a replica added by hand holds a version the trainer sent it and
has generated.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc

from coordinator.metrics import read_metrics
from fp8rl.run_secrets import security_for
from fp8rl.transport import channel
from fp8rl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

RUN_ID = "chaos"
FAST = ["--prompts-per-step", "4", "--group-size", "4", "--max-tokens", "4", "--val-every", "0"]
FAST += ["--set", "val_size=64", "--set", "max_restarts=100000", "--compute-dtype", "float32"]
FAST += ["--progress", "plain"]
KINDS = ("kill", "partition", "loss", "latency", "flood", "full-disk", "replica")
PROXY_SOURCE = "127.0.0.2"  # where the latency proxy's own connections come from: its rules skip them
EXTRA_REPLICAS = 2  # at most this many added replicas at once (each is a vLLM engine on the same cores)


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


class Run:
    """The run directory and what the bench watches in it."""

    def __init__(self, run_dir: Path, steps: int, seed: int) -> None:
        self.run_dir, self.steps, self.seed = run_dir, steps, seed
        self.served: list[tuple[int, int]] = []  # (version served to a reader, steps committed by then)
        self.commits: list[float] = []  # when each step's record appeared
        self.pids: set[int] = set()  # every child the coordinators started (ended at the end, by PID)
        self.added: dict[str, subprocess.Popen] = {}  # address -> a replica the bench added
        self.logs = run_dir.parent  # where added replicas log (kept after the run's tmpfs goes)
        self.stopped = threading.Event()  # asked to stop at a step boundary (--minutes, --until-covered)
        self.lock = threading.Lock()

    def committed(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        try:
            return len(path.read_text().splitlines()) - 1 if path.exists() else -1
        except OSError:
            return -1

    def info(self) -> dict:
        try:
            return json.loads((self.run_dir / "run.json").read_text())
        except (OSError, ValueError):
            return {}

    def command(self) -> list[str]:
        args = ["start", "--recipe", "fp8", "--steps", str(self.steps), "--run-id", RUN_ID, "--seed"]
        args += [str(self.seed), "--run-dir", str(self.run_dir), *FAST]
        return [sys.executable, "-m", "coordinator.cli", *args]


def flood(run: Run, until: float, counts: Counter[str]) -> None:
    """Valid and invalid Generate requests to the current replica until ``until``; each version a
    completion reports is recorded with the steps committed when it came back."""
    bad = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=rollout_pb2.TokenIds(ids=[5]))], n=0
    )
    good = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(text="12+34=")], sampling=common_pb2.SamplingParams(max_tokens=4)
    )
    rng = random.Random(until)
    while time.monotonic() < until:
        rollouts = (run.info().get("rollouts") or []) + sorted(run.added)
        if not rollouts or not (run.run_dir / "secrets").exists():
            time.sleep(0.2)
            continue
        with channel(
            rng.choice(rollouts), security_for(run.run_dir / "secrets", "reader", tls=False), "rollout"
        ) as chan:
            stub = rollout_pb2_grpc.RolloutStub(chan)
            while time.monotonic() < until:
                try:
                    reply = stub.Generate(good if rng.random() < 0.7 else bad, timeout=30)
                except grpc.RpcError as err:
                    counts[err.code().name] += 1
                    if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        time.sleep(0.2)
                        break  # (a new replica, perhaps: look again)
                    continue
                counts["OK"] += 1
                with run.lock:
                    run.served += [(c.weight_version, run.committed()) for c in reply.completions]


class Faults:
    """The seeded schedule: a fault every 3-15 s, each in a thread of its own (one of a kind at a time),
    until ``stop``; the first of each kind come first, in a seeded order."""

    def __init__(self, run: Run, rng: random.Random, coordinator: list[subprocess.Popen]) -> None:
        self.run, self.rng, self.coordinator = run, rng, coordinator
        self.counts: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.active: set[str] = set()
        self.stop = threading.Event()
        self.log: list[str] = []
        self.departed: list[dict] = []  # each added replica's status as it was removed (or at the end)
        self.first: list[str] = []  # the kinds not applied yet, in the seeded order they come first

    def loop(self) -> None:
        # Each kind until it has been applied once, then any at random: a short run meets all.
        self.first = self.rng.sample(KINDS, len(KINDS))
        while not self.stop.wait(self.rng.uniform(3, 15)):
            pending = list(self.first)  # (a copy: _apply threads remove kinds as they land)
            kind = pending[0] if pending else self.rng.choice(KINDS)
            seconds = self.rng.uniform(2, 12)
            if kind in self.active or not self.run.info():
                continue
            self.active.add(kind)
            threading.Thread(target=self._apply, args=(kind, seconds, self.rng.random()), daemon=True).start()

    def covered(self) -> bool:
        """Every kind applied, a flood served (a completion came back), and a replica added by hand
        joined: it holds a version the coordinator sent it and has generated (now, or when it was
        removed)."""
        if self.first or not self.counts or not self.run.served:
            return False
        statuses = [*self.departed, *(status_of(self.run, address) for address in list(self.run.added))]
        return any(joined(status) for status in statuses)

    def _apply(self, kind: str, seconds: float, pick: float) -> None:
        try:
            what = getattr(self, "_" + kind.replace("-", "_"))(seconds, pick)
            if what:
                self.counts[kind] += 1
                with contextlib.suppress(ValueError):
                    self.first.remove(kind)
                self.log.append(f"{time.strftime('%H:%M:%S')} step {self.run.committed()}: {kind} {what}")
                print(self.log[-1], flush=True)
        except Exception as exc:  # a fault that could not be applied (a process just gone): skipped
            self.log.append(f"{kind}: not applied ({exc})")
        finally:
            self.active.discard(kind)

    def _kill(self, seconds: float, pick: float) -> str:
        coordinator = self.coordinator[-1].pid
        children = children_of(coordinator)  # (run.json names the first ones; restarts make new ones)
        victims = [*sorted(children), "coordinator"]
        victim = victims[int(pick * len(victims))]
        os.kill(coordinator if victim == "coordinator" else children[victim], signal.SIGKILL)
        return victim

    def _service_port(self, pick: float) -> tuple[str, str]:
        """(name, port) of one of the run's services, by ``pick``."""
        info = self.run.info()
        ports = {"trainer": info["trainer"], "rollout": info["rollouts"][0], "redis": info["redis_url"]}
        name = sorted(ports)[int(pick * len(ports))]
        return name, re.findall(r":(\d+)", ports[name])[-1]

    def _partition(self, seconds: float, pick: float) -> str:
        name, port = self._service_port(pick)
        rules = [
            ["INPUT", "-i", "lo", "-p", "tcp", "--dport", port],
            ["OUTPUT", "-o", "lo", "-p", "tcp", "--sport", port],
        ]
        for rule in rules:
            sh("iptables", "-A", *rule, "-j", "DROP")
        try:
            time.sleep(seconds)
        finally:
            for rule in rules:
                sh("iptables", "-D", *rule, "-j", "DROP")
        return f"{name} for {seconds:.0f} s"

    def _loss(self, seconds: float, pick: float) -> str:
        percent = 1 + int(pick * 9)  # (iptables' statistic match: these kernels lack netem for latency)
        rule = [
            "INPUT",
            "-i",
            "lo",
            "-m",
            "statistic",
            "--mode",
            "random",
            "--probability",
            f"{percent / 100}",
        ]
        sh("iptables", "-A", *rule, "-j", "DROP")
        try:
            time.sleep(seconds)
        finally:
            sh("iptables", "-D", *rule, "-j", "DROP")
        return f"{percent}% of packets on every link for {seconds:.0f} s"

    def _latency(self, seconds: float, pick: float) -> str:
        """Every connection to one service through a proxy that delays it: those open are reset (REJECT
        of their next packet) and new ones are redirected to the proxy; afterwards the rules go, the
        proxy ends, and its connections with it."""
        from coordinator.processes import free_port

        name, port = self._service_port(pick)
        delay_ms = 25 * (1 + int(pick * 24) % 8)  # (25-200 ms each way)
        proxy_port = str(free_port())
        log = self.run.logs / f"latency-{proxy_port}.log"
        route = f"127.0.0.1:{proxy_port}=127.0.0.1:{port}"
        proxy_args = ["--delay-ms", str(delay_ms), "--source", PROXY_SOURCE, route]
        with open(log, "w") as out:
            proxy = subprocess.Popen(
                [sys.executable, "-m", "tests.faultproxy", *proxy_args],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.run.pids.add(proxy.pid)  # (ended at the end, should this thread not get to)
        direct = ["OUTPUT", "-p", "tcp", "-d", "127.0.0.1", "--dport", port, "!", "-s", PROXY_SOURCE]
        rules = [
            ["-t", "nat", "-A", *direct, "-j", "REDIRECT", "--to-ports", proxy_port],
            ["-A", *direct, "-j", "REJECT", "--reject-with", "tcp-reset"],  # (after NAT: the old ones only)
        ]
        applied: list[list[str]] = []
        try:
            deadline = time.monotonic() + 30
            while "proxying" not in log.read_text():
                if proxy.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the latency proxy did not start: {log.read_text()[-300:]}")
                time.sleep(0.1)
            for rule in rules:
                sh("iptables", *rule)
                applied.append(rule)
            time.sleep(seconds)
        finally:
            for rule in applied:  # (each tried, whatever the one before did)
                with contextlib.suppress(subprocess.CalledProcessError):
                    sh("iptables", *[("-D" if arg == "-A" else arg) for arg in rule])
            with contextlib.suppress(OSError):
                os.killpg(proxy.pid, signal.SIGKILL)
            proxy.wait()
            self.run.pids.discard(proxy.pid)
        return f"{delay_ms} ms each way on {name} for {seconds:.0f} s"

    def _flood(self, seconds: float, pick: float) -> str:
        flood(self.run, time.monotonic() + seconds, self.requests)
        return f"for {seconds:.0f} s"

    def _replica(self, seconds: float, pick: float) -> str:
        """Add a replica (below EXTRA_REPLICAS, or on a coin's throw) or remove one the bench added."""
        run = self.run
        if run.added and (pick < 0.5 or len(run.added) >= EXTRA_REPLICAS):
            address = sorted(run.added)[int(pick * 2 * len(run.added)) % len(run.added)]
            proc = run.added.pop(address)
            self.departed.append(status_of(run, address) | {"at": f"step {run.committed()}"})
            how = signal.SIGTERM if pick < 0.25 else signal.SIGKILL
            end_replica(proc, how)
            return f"removed {address} ({how.name})"
        proc, address = add_replica(run, self.coordinator[-1].pid)
        run.added[address] = proc
        return f"added {address}"

    def _full_disk(self, seconds: float, pick: float) -> str:
        filler = self.run.run_dir.parent / "filler"
        block = b"\0" * (4 << 20)
        with open(filler, "wb", buffering=0) as out, contextlib.suppress(OSError):  # to the last byte
            while True:
                out.write(block)
        try:
            time.sleep(seconds)
        finally:
            filler.unlink()
        return f"for {seconds:.0f} s"


def joined(status: dict) -> bool:
    """Whether an added replica's status (:func:`status_of`) shows it joined the run."""
    return status.get("version", -1) >= 0 and status.get("tokens", 0) > 0


def status_of(run: Run, address: str) -> dict:
    """What a replica says of itself (the version it holds, the tokens it made), or why it did not."""
    try:
        with channel(address, security_for(run.run_dir / "secrets", "reader", tls=False), "rollout") as chan:
            status = rollout_pb2_grpc.RolloutStub(chan).GetStatus(common_pb2.GetStatusRequest(), timeout=5)
    except grpc.RpcError as err:
        return {"address": address, "unreachable": err.code().name}
    return {"address": address, "version": status.weight_version, "tokens": status.tokens_generated}


def end_replica(proc: subprocess.Popen, how: signal.Signals = signal.SIGKILL) -> None:
    """Send ``how`` to an added replica's session (it and its engine core); after SIGTERM, wait for it up
    to 30 s; then kill what is left and reap it."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, how)
    if how == signal.SIGTERM:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def add_replica(run: Run, coordinator: int) -> tuple[subprocess.Popen, str]:
    """One more replica of the run: the embedded replica's own command line (model, recipe, secrets) on
    a port of its own, registered in the run's Redis, as a user adds one by hand."""
    from coordinator.processes import free_port
    from fp8rl.credentials import PASSWORD_FILE_ENV

    info, rollout = run.info(), children_of(coordinator).get("rollout")
    if not info or rollout is None:
        raise RuntimeError("no embedded replica to copy")
    args = Path(f"/proc/{rollout}/cmdline").read_bytes().decode().split("\0")[:-1]
    port = free_port()
    args[args.index("--port") + 1] = str(port)
    address = f"127.0.0.1:{port}"
    args += ["--set", f"redis_url={info['redis_url']}", "--set", f"advertise={address}"]
    args += ["--set", "heartbeat_s=1"]
    log = open(run.logs / f"replica-{port}.log", "w")  # noqa: SIM115 (the child holds it)
    env = {**os.environ, PASSWORD_FILE_ENV: info["redis_password_file"]}
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log.close()
    run.pids.add(proc.pid)
    return proc, address


def stop_when(
    run: Run,
    faults: Faults,
    scheduler: threading.Thread,
    done: Callable[[], bool],
    finished: threading.Event,
) -> None:
    """--minutes, --until-covered: once ``done()``, no new faults (the ``scheduler`` has ended); once
    those in progress are over, ask the coordinator to stop at its next step boundary (`coordinator
    stop`), again while it restarts, until it has. (The bench then runs one more step without faults, the
    run's last, whose validation it reports.)"""
    while not checked(done):
        if finished.wait(2):
            return
    faults.stop.set()
    scheduler.join()  # (it may have been starting one more fault as it was told to stop)
    deadline = time.monotonic() + 120
    while faults.active and time.monotonic() < deadline:
        time.sleep(0.5)
    if finished.is_set():  # (it reached --steps meanwhile: no step past them)
        return
    run.stopped.set()
    stop = [
        sys.executable,
        "-m",
        "coordinator.cli",
        "stop",
        "--run-id",
        RUN_ID,
        "--run-dir",
        str(run.run_dir),
    ]
    while not finished.wait(5):
        subprocess.run(stop, capture_output=True)


def checked(done: Callable[[], bool]) -> bool:
    """``done()``; False, said, if it failed (a replica's secrets gone with a restart, say): asked again."""
    try:
        return done()
    except Exception as exc:
        print(f"stop condition not read: {exc!r}", flush=True)
        return False


def run_to_the_end(run: Run, faults: Faults | None, reruns: Counter[str]) -> str:
    """Start the coordinator on the run until it finishes; every start but the first resumes."""
    output = []
    for attempt in range(1000):
        log = run.run_dir.parent / f"coordinator-{attempt}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                run.command(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        if faults is not None:
            faults.coordinator.append(proc)
        while proc.poll() is None:
            run.pids.update(children_of(proc.pid).values())
            committed = run.committed()
            while len(run.commits) < committed + 1:
                run.commits.append(time.monotonic())
            time.sleep(0.5)
        output.append(log.read_text(errors="replace"))
        if proc.returncode == 0:
            return "\n".join(output)
        reruns[f"exit {proc.returncode}"] += 1
        time.sleep(1)
    raise RuntimeError("the run did not finish in 1000 starts")


def check(run: Run, out: str, faults: Faults | None) -> dict:
    records = read_metrics(run.run_dir)
    steps = [r["step"] for r in records]
    checkpoints = sorted(
        p.name for p in (run.run_dir / "checkpoints").iterdir() if p.name.startswith("step-")
    )
    future = [(v, c) for v, c in run.served if v > c + 1]  # a version not yet published when served
    gaps = [b - a for a, b in zip(run.commits, run.commits[1:], strict=False)]
    events = Counter(e for e in re.findall(r"recovery: |restarting \(", out))
    return {
        "steps": steps[-1] if steps else -1,
        "every_step_once": steps == list(range(len(steps)))
        and (len(steps) == run.steps + 1 or run.stopped.is_set()),
        "trainer_at_last_step": bool(checkpoints) and checkpoints[-1] == f"step-{len(steps) - 1:08d}",
        "served_only_published": not future,
        "served": len(run.served),
        "served_versions": sorted({v for v, _ in run.served}),
        "future_versions": future[:10],
        "faults": dict(faults.counts) if faults else {},
        "requests": dict(faults.requests) if faults else {},
        "replicas_added": sum(": replica added" in line for line in faults.log) if faults else 0,
        "added_replicas": [*faults.departed] if faults else [],
        "restarts": events["restarting ("],
        "heals": events["recovery: "],
        "longest_stall_s": round(max(gaps, default=0.0), 1),
        "final_val_accuracy": records[-1].get("val_accuracy") if records else None,
    }


SERVICES = {
    "trainer_service.cli": "trainer",
    "rollout_service.cli": "rollout",
    "redis-server": "redis-server",
}


def children_of(pid: int) -> dict[str, int]:
    """The coordinator's running services by name, from the kernel's list of its children."""
    found = {}
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            cmdline = (
                Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
            for needle, name in SERVICES.items():
                if needle in cmdline:
                    found[name] = int(child)
    return found


def end_children(pids: set[int]) -> None:
    """Kill what is left of the coordinators' children (one killed with -9 may leave some for a moment):
    only those still in this network namespace, which is the bench's alone (a PID the kernel gave to
    another process since is never touched)."""
    ours = os.readlink("/proc/self/ns/net")
    for pid in pids:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/ns/net") == ours:
                os.kill(pid, signal.SIGKILL)


def ended_or_covered(faults: Faults, deadline: float, until_covered: bool) -> bool:
    return time.monotonic() >= deadline or (until_covered and faults.covered())


def namespaced(args: argparse.Namespace) -> int:
    """Inside the namespaces: loopback up, the run on a small tmpfs, the faults, the report."""
    sh("ip", "link", "set", "lo", "up")
    out = Path(args.out).resolve()
    reports: dict[str, dict] = {}
    # Stopped early, the chaos run comes first: the clean one then runs as many steps as it reached.
    early = bool(args.minutes or args.until_covered)
    order = [("chaos", True)] + ([("clean", False)] if args.clean else [])
    if args.clean and not early:
        order.reverse()
    for label, with_faults in order:
        disk = out / label / "disk"
        disk.mkdir(parents=True, exist_ok=True)
        sh("mount", "-t", "tmpfs", "-o", f"size={args.disk_mb}m,mode=0700", "tmpfs", str(disk))
        steps = reports["chaos"]["steps"] if early and not with_faults else args.steps
        run = Run(disk / "run", steps, args.seed)
        run.logs = out / label
        rng = random.Random(args.seed)
        reruns: Counter[str] = Counter()
        faults = Faults(run, rng, []) if with_faults else None
        scheduler = threading.Thread(target=faults.loop, daemon=True) if faults else None
        finished = threading.Event()
        started = time.monotonic()
        try:
            if scheduler:
                scheduler.start()
            if faults and early:
                deadline = started + args.minutes * 60 if args.minutes else math.inf
                done = functools.partial(ended_or_covered, faults, deadline, args.until_covered)
                assert scheduler is not None
                watch = (run, faults, scheduler, done, finished)
                threading.Thread(target=stop_when, args=watch, daemon=True).start()
            text = run_to_the_end(run, faults, reruns)
            finished.set()
            if run.stopped.is_set():  # one more step, without faults: the run's last, which is validated
                run.steps = run.committed() + 1
                text += "\n" + run_to_the_end(run, None, reruns)
        finally:
            finished.set()
            if faults:
                faults.stop.set()
                faults.departed += [status_of(run, address) | {"at": "the end"} for address in run.added]
            for proc in run.added.values():
                end_replica(proc)
        end_children(run.pids)
        report = check(run, text, faults) | {
            "reruns": dict(reruns),
            "wall_s": round(time.monotonic() - started),
        }
        shutil.copytree(
            run.run_dir, out / label / "run", dirs_exist_ok=True, ignore=shutil.ignore_patterns("checkpoints")
        )
        if faults:
            (out / label / "faults.log").write_text("\n".join(faults.log) + "\n")
        sh("umount", "-l", str(disk))
        reports[label] = report
        print(f"{label}: {json.dumps(report)}", flush=True)
    (out / "report.json").write_text(
        json.dumps(
            {
                "seed": args.seed,
                "steps": args.steps,
                "minutes": args.minutes,
                "until_covered": args.until_covered,
                **reports,
            },
            indent=1,
        )
    )
    chaos = reports["chaos"]
    ok = chaos["every_step_once"] and chaos["trainer_at_last_step"] and chaos["served_only_published"]
    if args.clean:
        clean = reports["clean"]["final_val_accuracy"]
        print(f"final val accuracy: chaos {chaos['final_val_accuracy']}, clean {clean}")
    print("PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--steps", type=int, default=400, help="the run's length (the tiny model: ~1 s a step)"
    )
    parser.add_argument("--seed", type=int, default=None, help="the faults' and the run's seed (printed)")
    parser.add_argument(
        "--minutes",
        type=float,
        help="end the faults after this long, stop the run at its next step boundary and train one "
        "more step, the last (--steps is then a ceiling; the clean run, after it, goes as far)",
    )
    parser.add_argument(
        "--until-covered",
        action="store_true",
        help="end the faults once every kind has been applied, a flood has been served and an added "
        "replica has joined, then stop as --minutes does (with --minutes: whichever comes first)",
    )
    parser.add_argument("--clean", action="store_true", help="also the same run without faults")
    parser.add_argument("--out", default="runs/chaos", help="where the report and the runs' records go")
    parser.add_argument("--disk-mb", type=int, default=512, help="the run directory's tmpfs")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        sys.exit(namespaced(args))
    if os.geteuid() != 0:
        sys.exit("bench/chaos.py needs root: network and mount namespaces, iptables, tc")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"chaos seed {seed} (--seed {seed} replays the faults' schedule)", flush=True)
    inner = [
        "unshare",
        "--net",
        "--mount",
        "--fork",
        sys.executable,
        __file__,
        "--inside",
        "--seed",
        str(seed),
    ]
    inner += ["--steps", str(args.steps), "--out", args.out, "--disk-mb", str(args.disk_mb)]
    inner += ["--minutes", str(args.minutes)] if args.minutes else []
    inner += ["--until-covered"] if args.until_covered else []
    sys.exit(subprocess.run([*inner, *(["--clean"] if args.clean else [])]).returncode)


if __name__ == "__main__":
    main()
