"""Helpers for tests: real child processes (tracked by PID and always reaped), a real redis-server on
loopback, a trainer's config on this CPU, an independent reference for the logprobs an FP8 engine should
produce, and the compose file's services as local processes."""

from __future__ import annotations

import errno
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from coordinator.processes import free_port as free_port  # the one free_port, re-exported for tests
from coordinator.processes import start_redis
from fp8rl import quant
from fp8rl.serving import BOUND_LINE, HEALTH_LINE
from trainer_service.config import TrainerConfig

if TYPE_CHECKING:
    from fp8rl.security import SecurityConfig
    from fp8rl.serving import RunningServer
    from trainer_service.service import TrainerService


def trainer_config(model: Path, recipe: str = "fp8", **fields: Any) -> TrainerConfig:
    """A trainer of ``model`` under ``recipe`` as the tests run one: float32 compute (bf16's noise hides
    FP8 effects) and a free port if it serves; ``fields`` set the rest."""
    return TrainerConfig.model_validate(
        {"model": model, "recipe": recipe, "compute_dtype": "float32", "port": 0} | fields
    )


SHORT_RUN = (
    *("--prompts-per-step", "4", "--group-size", "4", "--max-tokens", "4"),
    *("--val-every", "0", "--set", "val_size=8"),
)
"""The shape of the short end-to-end runs: steps of 4 prompts x 4 samples of 4 tokens, validated on 8
problems before the first step and after the last only."""


def coordinator(*args: str) -> list[str]:
    """The command line of ``coordinator ARGS`` (any of its commands)."""
    return [sys.executable, "-m", "coordinator.cli", *args]


def coordinator_start(run_dir: Path, *args: str) -> list[str]:
    """The command line of an embedded test run: `coordinator start` into ``run_dir`` with float32
    compute (the default on CPU, said aloud) and plain progress lines, then ``args``."""
    return coordinator(
        "start", "--run-dir", str(run_dir), "--compute-dtype", "float32", "--progress", "plain", *args
    )


@contextmanager
def child_process(
    args: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """Start a process in its own session; on exit SIGTERM it (then SIGKILL) and wait for it."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_for_line(proc: subprocess.Popen, log: Path, pattern: str, timeout: float = 300) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, log.read_text(errors="replace"))
        if match:
            return match
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"no line matching {pattern!r} after {timeout}s:\n{log.read_text()[-4000:]}")


def bound_address(proc: subprocess.Popen, log: Path, timeout: float = 300) -> str:
    """The host:port a service process bound (:func:`fp8rl.serving.serve` prints it before loading).
    Tests start services on port 0 and read this: a port picked free beforehand can be taken (by a
    connection's ephemeral port, another lane's server) before the child binds it."""
    return wait_for_line(proc, log, BOUND_LINE, timeout).group(1)


def health_address(proc: subprocess.Popen, log: Path, timeout: float = 300) -> str:
    """The host:port of a service's plaintext health probes, started with ``health_port=0`` (a trainer
    rank > 0 prints it once its shard has loaded)."""
    return wait_for_line(proc, log, HEALTH_LINE, timeout).group(1)


@contextmanager
def unpickling_forbidden() -> Iterator[None]:
    """Within it, reading a pickle (pickle.load/loads/Unpickler, torch.load) raises. torch.distributed's
    object collectives hold their own reference to the unpickler: what the ranks send each other (made by
    a rank, never read from a file) still passes."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a pickle was read")

    patched = [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")]
    patched.append((torch.serialization, "load"))
    saved = [getattr(module, name) for module, name in patched]
    for module, name in patched:
        setattr(module, name, refuse)
    try:
        yield
    finally:
        for (module, name), value in zip(patched, saved, strict=True):
            setattr(module, name, value)


def assert_pickle_free(checkpoint: Path) -> None:
    """Every file of ``checkpoint`` (hidden ones too: torch's pickled ``.metadata``) is safetensors or
    JSON."""
    files = [p for p in checkpoint.rglob("*") if p.is_file()]
    assert files and all(p.suffix in (".safetensors", ".json") for p in files), files


@contextmanager
def redis_server(
    data: Path, port: int | None = None, aof: bool = False, log: str = "redis.log"
) -> Iterator[str]:
    """The coordinator's own redis-server launcher (:func:`coordinator.processes.start_redis`) as a
    context manager: a private server keeping its files in ``data``; yields its URL."""
    with ExitStack() as stack:
        url, _ = start_redis(stack, data, data / log, port=port, aof=aof)
        yield url


def serve_trainer(service: TrainerService, security: SecurityConfig | None = None) -> RunningServer:
    """``service`` behind a real gRPC server on port 0, as its CLI serves it, SERVING (``.stop(0)``)."""
    from fp8rl.serving import start_server
    from fp8rl.v1 import trainer_pb2_grpc
    from trainer_service.servicer import SERVICE_NAME, TrainerServicer

    servicer = TrainerServicer(service)
    running = start_server(
        lambda s: trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, s),
        [SERVICE_NAME],
        security=security,
    )
    running.set_serving()
    return running


def serve_rollout(servicer: Any, security: SecurityConfig | None = None) -> RunningServer:
    """A Rollout servicer (the real one, or a test's) behind a real gRPC server on port 0, with the
    replica's message bound, SERVING (``.stop(0)``)."""
    from fp8rl.serving import start_server
    from fp8rl.v1 import rollout_pb2_grpc

    running = start_server(
        lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, s),
        ["fp8rl.v1.Rollout"],
        security=security,
        max_receive_bytes=64 * 1024 * 1024,
    )
    running.set_serving()
    return running


def load_reference(
    model_dir: Path, fp8: bool, activation_fake_quant: bool = True, arithmetic: quant.Arithmetic = "te"
) -> torch.nn.Module:
    """A float32 transformers model; with ``fp8`` every linear inside the blocks computes with
    fake-quantized weights (and, optionally, 1x128 activations fake-quantized with the ``arithmetic`` of
    the engine it stands for: ``te`` for the trainer, ``vllm`` for the rollout)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if fp8:
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                module.weight.data = quant.fake_quantize_weight(module.weight.data)
                if activation_fake_quant:
                    module.register_forward_pre_hook(
                        lambda _m, args: (quant.fake_quantize_activation(args[0], arithmetic=arithmetic),)
                    )
    return model


def set_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], fp8: bool) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = state[name].float()
            is_linear = fp8 and ".layers." in name and name.endswith("_proj.weight")
            p.copy_(quant.fake_quantize_weight(w) if is_linear else w)


def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """float64 logprobs of ``completion`` given ``prompt`` under softmax(logits / temperature)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logprobs.gather(1, torch.tensor(completion)[:, None]).squeeze(1)


@contextmanager
def service_process(
    module: str, model: Path, log: Path, *extra: str, ready: str = r"serving on", port: int | None = None
) -> Iterator[tuple[subprocess.Popen, str]]:
    """``python -m <module> serve --model MODEL --port P ...`` as a child; yields it and its address once
    its log shows ``ready``. Without ``port`` it binds port 0 and the address is the one it printed."""
    args = [sys.executable, "-m", module, "serve", "--model", str(model), "--port", str(port or 0), *extra]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with child_process(args, log, env) as proc:
        address = bound_address(proc, log)
        wait_for_line(proc, log, ready)
        yield proc, address


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real filesystem of ``size`` (``mount -t tmpfs -o size=40m``) at ``path``, unmounted on exit: a
    disk that really fills. Skips the test, saying why, where mounting is not permitted (not root, or a
    container without CAP_SYS_ADMIN)."""
    import pytest

    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (a real full disk: mount -t tmpfs -o size=...)")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)  # busy: detach it now


def fill_disk(path: Path, leave: int, ballast: str = ".ballast") -> int:
    """Fill the filesystem of ``path`` with one file until ``leave`` bytes are free (a multiple of the
    page size on a tmpfs: its blocks); returns the bytes written. Writing again resizes the ballast."""
    target = path / ballast
    target.unlink(missing_ok=True)
    stats = os.statvfs(path)
    size = stats.f_bavail * stats.f_frsize - leave
    if size < 0:
        raise ValueError(f"{path} has only {stats.f_bavail * stats.f_frsize} bytes free, not {leave}")
    # Allocated at once (a tmpfs counts allocated pages as used; no sparse file), so that a run a few
    # steps a second meets the full disk at once; where allocation fails (others wrote meanwhile, or the
    # filesystem cannot), written block by block until full.
    with open(target, "wb", buffering=0) as f:
        try:
            os.posix_fallocate(f.fileno(), 0, size)
            return size
        except OSError:
            pass
        written, block = 0, b"\0" * (1 << 20)
        try:
            while written < size:
                written += f.write(block[: size - written])
        except OSError as exc:  # others wrote meanwhile: the disk is full all the same
            if exc.errno != errno.ENOSPC:
                raise
    return written


# -- the compose file's services as local processes ------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable syntax: ${VAR}, ${VAR:-default}, ${VAR:?error}; $$ is a literal $."""

    def value(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if name in env and env[name] != "":
            return env[name]
        if op == ":?":
            raise ValueError(f"compose: {arg}")
        return arg or ""

    text = re.sub(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:\?)([^}]*))?\}", value, text)
    return text.replace("$$", "$")


class LocalCompose:
    """Maps the compose world onto this machine: volumes to directories under ``tmp``; with ``loopback``
    (one network: this host's) service hostnames to 127.0.0.1 and ports to free ones, else hostnames and
    ports as the compose file has them (each service in a network namespace of its own: tests/netns.py)."""

    def __init__(self, tmp: Path, env: dict[str, str], loopback: bool = True) -> None:
        self.loopback = loopback
        ports = ("6379", "50051", "50052", "50053", "8000")
        self.ports = {p: str(free_port()) for p in ports} if loopback else {p: p for p in ports}
        self.volumes = {name: tmp / name for name in COMPOSE["volumes"]}
        for path in self.volumes.values():
            path.mkdir()
        self.config = tmp / "config"
        shutil.copytree(ROOT / "deploy" / "config", self.config)
        self.env = env
        for service in ("trainer", "rollout", "coordinator"):  # each reads its own secrets at /secrets
            path = self.config / f"{service}.yaml"
            path.write_text(self.localize(path.read_text(), service))

    def mounts(self, service: str) -> dict[str, Path]:
        """Container path -> local path, from the service's own volume list (longest paths first)."""
        entries = COMPOSE["services"][service].get("volumes") or COMPOSE["x-app"]["volumes"]
        found = {}
        for entry in entries:
            source, target = entry.split(":")[:2]
            found[target] = self.config if source.startswith("./") else self.volumes[source]
        return dict(sorted(found.items(), key=lambda item: -len(item[0])))

    def localize(self, text: str, service: str = "coordinator") -> str:
        text = interpolate(text, self.env)
        if self.loopback:
            for port, local in self.ports.items():
                text = re.sub(rf"\b{port}\b", local, text)
            text = (
                text.replace("redis://redis:", "redis://127.0.0.1:")
                .replace("rediss://redis:", "rediss://127.0.0.1:")
                .replace("trainer:", "127.0.0.1:")
                .replace("0.0.0.0", "127.0.0.1")
            )
        for target, path in self.mounts(service).items():
            text = re.sub(rf"(?<![\w/.]){target}\b", str(path), text)
        return text

    def environment(self, service: str) -> dict[str, str]:
        merged = {**COMPOSE["x-app"]["environment"], **COMPOSE["services"][service].get("environment", {})}
        env = {k: self.localize(str(v), service) for k, v in merged.items()}
        bin_dir = Path(sys.executable).parent  # the services' console scripts live beside the interpreter
        path = f"{bin_dir}:{os.environ['PATH']}"
        advertise = {"ADVERTISE_HOST": "127.0.0.1"} if self.loopback else {}
        return {**os.environ, **env, **advertise, "PYTHONUNBUFFERED": "1", "PATH": path}

    def command(self, service: str, *extra: str) -> list[str]:
        """The service's command line; ``extra`` arguments go to the end of its shell script's command."""
        command = [self.localize(part, service) for part in COMPOSE["services"][service]["command"]]
        if extra:
            assert command[:2] == ["sh", "-c"], command
            command[2] += " " + " ".join(shlex.quote(arg) for arg in extra)
        return [sys.executable, *command[1:]] if command[0] == "python" else command  # the image's python

    def health_check(self, service: str) -> list[str]:
        test = [
            self.localize(part, service) for part in COMPOSE["services"][service]["healthcheck"]["test"][1:]
        ]
        if test[0] == "python":
            test[0] = sys.executable  # the image's python is this venv's
        return test

    def healthy(self, service: str, timeout: float = 300, prefix: tuple[str, ...] = ()) -> None:
        """Wait for the service's compose health check (run under ``prefix``, e.g. ``ip netns exec NS``)."""
        test = [*prefix, *self.health_check(service)]
        deadline = time.monotonic() + timeout
        while subprocess.run(test, capture_output=True, env=self.environment(service)).returncode != 0:
            assert time.monotonic() < deadline, f"{service} not healthy after {timeout}s"
            time.sleep(1)
