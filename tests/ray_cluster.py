"""A real multi-node Ray cluster on this machine, for tests: a head and more nodes, each a `ray start
--block` in a PID namespace of its own, all in one private network namespace that has loopback alone.

- Ray's servers bind every address; in that namespace every address is loopback, so nothing of the
  cluster (nor of the run inside it) is reachable from beyond this test, and Ray takes 127.0.0.1 as
  every node's IP.
- A node's processes (its raylet, workers, the services its actors run) are all in its PID namespace,
  with a /proc of its own (vLLM reads its own /proc/PID): SIGKILL to the namespace's first process ends
  them at once, as a machine that is lost.
- Each node keeps its files (Ray's session, its actors' private directories: TMPDIR) in a directory of
  its own, removed at the end with the namespace.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

RAY_BIN = Path(sys.executable).with_name("ray")


def unavailable() -> str | None:
    """Why this machine cannot host the cluster (None: it can)."""
    if os.geteuid() != 0:
        return "network and PID namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no {tool} here"
    try:
        import ray  # noqa: F401
    except ImportError:
        return "Ray is not installed (the `ray` extra; `make test` installs it)"
    return None


class RayCluster:
    def __init__(self, root: Path) -> None:
        self.root, self.netns = root, f"fp8rl-ray-{os.getpid()}-{root.name[-6:]}"
        self.nodes: dict[str, subprocess.Popen] = {}
        self.port = 6379
        subprocess.run(["ip", "netns", "add", self.netns], check=True)
        self.exec(["ip", "link", "set", "lo", "up"])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def prefix(self) -> list[str]:
        """Run a command inside the cluster's network namespace."""
        return ["ip", "netns", "exec", self.netns]

    def exec(self, args: list[str]) -> None:
        subprocess.run([*self.prefix(), *args], check=True, capture_output=True)

    def add_node(self, name: str, cpus: int, head: bool = False) -> None:
        """Start node ``name`` (its log: ROOT/NAME.log); it is up once Ray lists it. The head's Ray files
        (sessions, sockets) are under its directory; every node's TMPDIR under its own."""
        files = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.root))  # (a node added again: a new one)
        (files / "tmp").mkdir()
        args = [str(RAY_BIN), "start", "--block", f"--num-cpus={cpus}", "--num-gpus=0"]
        args += ["--object-store-memory=80000000", "--disable-usage-stats", f'--resources={{"{name}": 1}}']
        if head:
            args += ["--head", f"--port={self.port}", "--include-dashboard=false", f"--temp-dir={files}"]
        else:
            args += [f"--address={self.address}"]
        env = {**os.environ, "TMPDIR": str(files / "tmp"), "RAY_USAGE_STATS_ENABLED": "0"}
        with open(self.root / f"{name}.log", "ab") as out:
            self.nodes[name] = subprocess.Popen(
                [*self.prefix(), "unshare", "--pid", "--mount-proc", "--fork", "--kill-child", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.wait_for_nodes(len(self.nodes))

    def wait_for_nodes(self, count: int, timeout: float = 120) -> None:
        probe = "import ray; ray.init(address='auto', logging_level='ERROR'); "
        probe += "print(sum(n['Alive'] for n in ray.nodes()))"
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self.nodes.items():
                if proc.poll() is not None:
                    log = (self.root / f"{name}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"ray node {name} exited ({proc.returncode}):\n{log}")
            done = subprocess.run(
                [*self.prefix(), sys.executable, "-c", probe],
                capture_output=True,
                text=True,
                env={**os.environ, "RAY_ADDRESS": self.address},
            )
            if done.returncode == 0 and done.stdout.strip().splitlines()[-1:] == [str(count)]:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} ray nodes not up after {timeout:.0f}s: {done.stderr[-2000:]}")
            time.sleep(1)

    def lose(self, name: str) -> None:
        """Node ``name`` is gone at once, every process of it (SIGKILL to its PID namespace)."""
        proc = self.nodes.pop(name)
        proc.kill()  # (unshare --kill-child: its child, the namespace's first process, gets SIGKILL too)
        proc.wait()

    def shutdown(self) -> None:
        for name in list(self.nodes)[::-1]:  # (the head last)
            self.lose(name)
        deadline = time.monotonic() + 30
        while (left := pids_in_netns(self.netns)) and time.monotonic() < deadline:
            time.sleep(0.2)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
        assert not left, f"processes left in the cluster's namespace: {left}"


@contextmanager
def ray_cluster(nodes: dict[str, int]) -> Iterator[RayCluster]:
    """A cluster of ``nodes`` (name -> CPUs; the first is the head), torn down whole at the end."""
    root = Path(tempfile.mkdtemp(prefix="fp8rl-ray-", dir="/tmp"))  # (short: Ray's socket paths)
    cluster = RayCluster(root)
    try:
        for i, (name, cpus) in enumerate(nodes.items()):
            cluster.add_node(name, cpus, head=i == 0)
        yield cluster
    finally:
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def pids_in_netns(netns: str) -> list[int]:
    """Processes still in the namespace (none, once its nodes are gone)."""
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()]
