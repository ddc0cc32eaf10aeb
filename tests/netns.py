"""A real network for tests: each service in a network namespace of its own, joined by a veth pair to a hub
namespace. The hub holds every fault: a TCP proxy (tests/faultproxy.py) in front of each service adds
latency (the kernel here has no netem qdisc), and its iptables rules drop packets, a random fraction of
them (``-m statistic --mode random``) or all of them between two namespaces (a partition).

Addresses: node i's link is 10.77.i.0/24, the node at .2, the hub at .1. A client reaches node i's service
at 10.77.i.1 (the proxy, in the hub), which connects to 10.77.i.2; each namespace's /etc/hosts
(``ip netns exec`` mounts /etc/netns/NS/hosts over it) names the services by those proxy addresses, so
the compose file's hostnames (which the TLS certificates name) work as they are. Every rule, veth and
process lives in a namespace this module made: deleting the namespaces undoes everything."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import LocalCompose, child_process, wait_for_line

NETNS_DIR = Path("/etc/netns")


def unavailable() -> str | None:
    """Why network namespaces with iptables cannot be used here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces and iptables need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"no {tool} here (Debian's iproute2 / iptables package; `make test` installs them)"
    probe = f"fp8rl-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        rule = ["ip", "netns", "exec", probe, "iptables", "-A", "INPUT", "-m", "statistic"]
        rule += ["--mode", "random", "--probability", "0.5", "-j", "DROP"]
        tried = subprocess.run(rule, capture_output=True, text=True)
        if tried.returncode != 0:
            return f"iptables does not work in a network namespace: {tried.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sh(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")


@dataclass(frozen=True)
class Node:
    name: str  # the service's hostname in the compose file
    ns: str
    index: int

    @property
    def address(self) -> str:
        """Where clients reach this node's services: its proxy in the hub."""
        return f"10.77.{self.index}.1"

    @property
    def own_address(self) -> str:
        return f"10.77.{self.index}.2"

    @property
    def hub_link(self) -> str:
        return f"fp8h{self.index}"  # the hub's end of its veth pair


class Network:
    """Namespaces ``names`` (service hostnames) around a hub; :meth:`down` removes every one of them."""

    def __init__(self, names: Sequence[str], log_dir: Path) -> None:
        tag = f"fp8rl{os.getpid()}"
        self.hub = f"{tag}-hub"
        self.nodes = {name: Node(name, f"{tag}-{name}", i + 1) for i, name in enumerate(names)}
        self.log_dir = log_dir
        self._rules: list[list[str]] = []

    def up(self) -> None:
        sh("ip", "netns", "add", self.hub)
        sh("ip", "-n", self.hub, "link", "set", "lo", "up")
        # The host's own name too (a container's /etc/hosts has it; gloo, in vLLM, resolves it), and no
        # DNS server: nothing is reachable there, and a lookup must fail at once, not after a timeout.
        hosts = f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n"
        hosts += "".join(f"{n.address} {n.name}\n" for n in self.nodes.values())
        for node in self.nodes.values():
            sh("ip", "netns", "add", node.ns)
            # Made in the hub, its peer straight in the node's namespace: no name is ever taken in the
            # host's namespace.
            sh(
                "ip",
                "-n",
                self.hub,
                "link",
                "add",
                node.hub_link,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                node.ns,
            )
            sh("ip", "-n", self.hub, "addr", "add", f"{node.address}/24", "dev", node.hub_link)
            sh("ip", "-n", self.hub, "link", "set", node.hub_link, "up")
            sh("ip", "-n", node.ns, "addr", "add", f"{node.own_address}/24", "dev", "eth0")
            sh("ip", "-n", node.ns, "link", "set", "eth0", "up")
            sh("ip", "-n", node.ns, "link", "set", "lo", "up")
            sh("ip", "-n", node.ns, "route", "add", "default", "via", node.address)
            (NETNS_DIR / node.ns).mkdir(parents=True, exist_ok=True)
            (NETNS_DIR / node.ns / "hosts").write_text(hosts)
            (NETNS_DIR / node.ns / "resolv.conf").write_text("nameserver 127.0.0.1\n")

    def down(self) -> None:
        """Remove the namespaces (with their veths and rules) and their hosts files; what is already gone
        is skipped."""
        for ns in [self.hub, *(n.ns for n in self.nodes.values())]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(NETNS_DIR / ns, ignore_errors=True)

    def left_over(self) -> list[str]:
        """Namespaces of this network still present (after :meth:`down`: none)."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        ours = {self.hub, *(n.ns for n in self.nodes.values())}
        return [line.split()[0] for line in listed.splitlines() if line and line.split()[0] in ours]

    def exec_prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[name].ns]

    @contextmanager
    def process(
        self, name: str, args: list[str], log: Path, env: dict[str, str] | None = None
    ) -> Iterator[subprocess.Popen]:
        """``args`` in ``name``'s namespace (``ip netns exec`` execs it: the PID is the process's own)."""
        with child_process([*self.exec_prefix(name), *args], log, env) as proc:
            yield proc

    @contextmanager
    def proxy(self, ports: dict[str, Sequence[int]], delay_ms: float) -> Iterator[subprocess.Popen]:
        """The fault proxy in the hub, in front of each node's ``ports``."""
        routes = [
            f"{self.nodes[name].address}:{p}={self.nodes[name].own_address}:{p}"
            for name, node_ports in ports.items()
            for p in node_ports
        ]
        args = ["ip", "netns", "exec", self.hub, sys.executable, "-m", "tests.faultproxy"]
        log = self.log_dir / "proxy.log"
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        with child_process([*args, "--delay-ms", str(delay_ms), *routes], log, env) as proc:
            wait_for_line(proc, log, "proxying", timeout=60)
            yield proc

    # -- faults -------------------------------------------------------------------------------------
    def _rule(self, spec: list[str]) -> None:
        sh("ip", "netns", "exec", self.hub, "iptables", "-I", *spec)
        self._rules.append(spec)

    def _unrule(self, spec: list[str]) -> None:
        sh("ip", "netns", "exec", self.hub, "iptables", "-D", *spec)
        self._rules.remove(spec)

    def loss(self, probability: float) -> None:
        """Drop each packet on every link, either way, with ``probability`` (for the rest of the run)."""
        for node in self.nodes.values():
            for chain, way in (("INPUT", "-i"), ("OUTPUT", "-o")):
                random = ["-m", "statistic", "--mode", "random", "--probability", str(probability)]
                self._rule([chain, way, node.hub_link, *random, "-j", "DROP"])

    def dropped(self) -> dict[str, int]:
        """Packets each rule of the hub dropped so far, by rule."""
        listed = subprocess.run(
            ["ip", "netns", "exec", self.hub, "iptables", "-S", "-v"], capture_output=True, text=True
        ).stdout
        found = {}
        for line in listed.splitlines():
            if "-j DROP" in line and " -c " in line:
                rule, _, counters = line.partition(" -c ")
                found[rule] = int(counters.split()[0])
        return found

    def partition_specs(self, name: str, peers: Sequence[str] = ()) -> list[list[str]]:
        """DROP rules cutting ``name`` off from ``peers`` (all of the network when none are given)."""
        link = self.nodes[name].hub_link
        if not peers:
            return [["INPUT", "-i", link, "-j", "DROP"], ["OUTPUT", "-o", link, "-j", "DROP"]]
        specs = []
        for peer in peers:
            other = self.nodes[peer]
            for a, b in ((self.nodes[name], other), (other, self.nodes[name])):  # a as b's client
                specs.append(["INPUT", "-i", a.hub_link, "-d", b.address, "-j", "DROP"])
                specs.append(["OUTPUT", "-o", a.hub_link, "-s", b.address, "-j", "DROP"])
        return specs

    def partition(self, name: str, peers: Sequence[str] = ()) -> ExitStack:
        """Cut ``name`` off (from ``peers``, or from everyone) until the returned stack is closed."""
        healed = ExitStack()
        for spec in self.partition_specs(name, peers):
            self._rule(spec)
            healed.callback(self._unrule, spec)
        return healed

    @contextlib.contextmanager
    def rate_limited(self, name: str, rate: str) -> Iterator[None]:
        """Cap what ``name`` sends (``tc ... tbf``, e.g. rate "2mbit") while the block runs."""
        exec_in = ("ip", "netns", "exec", self.nodes[name].ns, "tc", "qdisc")
        sh(*exec_in, "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "1s")
        try:
            yield
        finally:
            sh(*exec_in, "del", "dev", "eth0", "root")

    def rules(self) -> str:
        return subprocess.run(
            ["ip", "netns", "exec", self.hub, "iptables", "-S"], capture_output=True, text=True
        ).stdout


@contextmanager
def network(names: Sequence[str], log_dir: Path) -> Iterator[Network]:
    """A :class:`Network` of ``names``, removed on exit however the test ends (skips the test, saying why,
    where namespaces or iptables are not available)."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    net = Network(names, log_dir)
    try:
        net.up()
        yield net
    finally:
        net.down()
        assert not net.left_over(), net.left_over()


# -- the compose file's services on such a network ------------------------------------------------------

REPLICAS = ("rollout-a", "rollout-b")
NODES = ("redis", "trainer", *REPLICAS, "coordinator", "coordinator-2")
PORTS = {"redis": [6379], "trainer": [50052], **{r: [50051, 50053] for r in REPLICAS}}  # (50053: TCP plane)


class ComposeNetwork:
    """The compose file's services (tests/support.py, LocalCompose) each in its namespace of ``net``:
    Redis, the trainer and two replicas, behind the fault proxy; coordinators are started by the test."""

    def __init__(self, net: Network, compose: LocalCompose, stack: ExitStack, log_dir: Path) -> None:
        self.net, self.compose, self.stack, self.log_dir = net, compose, stack, log_dir
        self.started: list[subprocess.Popen] = []  # the trainer, the replicas, the coordinators
        # gRPC's default resolver (c-ares) reads no /etc/hosts, which names the services here (compose has
        # a DNS server); the native one (getaddrinfo) reads both.
        self.env = {"GRPC_DNS_RESOLVER": "native"}

    def environment(self, service: str, **more: str) -> dict[str, str]:
        return {**self.compose.environment(service), **self.env, **more}

    def start(self, delay_ms: float) -> None:
        local = self.compose
        secrets = subprocess.run(local.command("secrets"), env=local.environment("secrets"), timeout=120)
        assert secrets.returncode == 0
        self.stack.enter_context(self.net.proxy(PORTS, delay_ms))
        data = str(local.volumes["redis-data"])
        redis_cmd = [*local.command("redis"), "--bind", "0.0.0.0", "--dir", data]
        log = self.log_dir / "redis.log"
        proc = self.stack.enter_context(self.net.process("redis", redis_cmd, log, self.environment("redis")))
        wait_for_line(proc, log, "Ready to accept connections", timeout=60)
        services = [("trainer", "trainer"), *((r, "rollout") for r in REPLICAS)]
        started = []
        for node, service in services:
            env = self.environment(service, ADVERTISE_HOST=node)
            log = self.log_dir / f"{node}.log"
            started.append((self._service(node, local.command(service), log, env), log))
        # The compose health check, once the service says it serves: polled from the start, each check (a
        # Python process: ~0.6 s of CPU) took the CPU the loading services need.
        for (node, service), (proc, log) in zip(services, started, strict=True):
            wait_for_line(proc, log, r"-service serving on ", timeout=300)
            local.healthy(service, prefix=tuple(self.net.exec_prefix(node)))

    def coordinator(
        self, node: str, steps: int, *extra: str, name: str = ""
    ) -> tuple[subprocess.Popen, Path]:
        """``coordinator start`` of the compose file in ``node``'s namespace, with a run directory of
        its own (two coordinators of one run are on two hosts); returns it and its log."""
        local = self.compose
        run_dir = self.log_dir / f"{node}-run"
        env = self.environment("coordinator")
        command = local.command(
            "coordinator", "--run-dir", str(run_dir), "--steps", str(steps), *FAST, *extra
        )
        log = self.log_dir / f"{name or node}.log"
        return self._service(node, command, log, env), log

    def _service(self, node: str, args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        proc = self.stack.enter_context(self.net.process(node, args, log, env))
        self.started.append(proc)
        return proc

    def stop_services(self, timeout: float = 20) -> None:
        """SIGTERM the trainer, the replicas and the coordinators all at once and wait for them (the
        stack's exits then find them gone, and stop Redis and the proxy): one after another, as the stack
        stops them, a scenario's teardown took ~10 s. One still running past ``timeout`` is left to the
        stack (which SIGKILLs it)."""
        running = [proc for proc in self.started if proc.poll() is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))

    def _store_code(self, code: str) -> str:
        local = self.compose
        return (
            "import redis; from coordinator.state import RunStore; "
            "from fp8rl.credentials import redis_url_with_password; import os; "
            "store = RunStore(redis.Redis.from_url(redis_url_with_password(os.environ['REDIS_URL'])), "
            f"{local.env['FP8RL_RUN_ID']!r})\n" + code
        )

    def store_process(self, node: str, code: str, log: Path) -> AbstractContextManager[subprocess.Popen]:
        """:meth:`run_store`'s ``code`` as a child process (stopped on exit)."""
        args = [sys.executable, "-c", self._store_code(code)]
        return self.net.process(node, args, log, self.environment("coordinator"))

    def run_store(self, node: str, code: str) -> str:
        """Python ``code`` run in ``node``'s namespace with ``store`` (the run's RunStore, as the
        coordinator reaches it); its standard output."""
        done = subprocess.run(
            [*self.net.exec_prefix(node), sys.executable, "-c", self._store_code(code)],
            env=self.environment("coordinator"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout


# Small steps: each scenario is a few of them.
FAST = ["--prompts-per-step", "8", "--group-size", "4", "--val-every", "0", "--set", "val_size=8"]
