"""`coordinator start --launcher ray`: the trainer's ranks and the rollout replicas as actors on a Ray
cluster (docs/ray.md). Each actor runs the same service as embedded mode's child processes, as a child
of its own, on the node Ray placed it; Redis, the coordinator's state machine and the wire stay as they
are (Redis on this machine's loopback: only the coordinator talks to it).

- Replicas are spread over the nodes. Ray restarts one whose node (or process) was lost, on a node that
  has room; the coordinator takes each replica's address from its actor before every step, and a replica
  back at a new address gets a keyframe, as a new one does.
- The trainer's ranks are one placement group, rank i a torchrun node (static rendezvous at rank 0).
  A lost rank is not restarted alone: the supervisor restarts the run's processes, and the ranks resume
  from the last checkpoint (the run directory must be storage every trainer node sees at its path).
- Across hosts the services talk mutual TLS under the run's CA, always. Each actor gets the run's secrets
  for its role as values and keeps them in a directory of its own (0700, in /dev/shm), removed when it
  stops; the model path must exist on every node.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from coordinator.config import CoordinatorConfig
from coordinator.embedded import EmbeddedProcesses, RunExit, as_sets, embedded_trainer, secrets_dir
from coordinator.processes import Child, is_serving, python_module, wait_healthy_address
from fp8rl.credentials import write_private
from fp8rl.run_secrets import security_for
from fp8rl.security import SecurityConfig
from fp8rl.serving import PARENT_ENV

log = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0  # a replica loads and compiles its model within this, or the run fails
POLL_TIMEOUT_S = 10.0  # an actor that does not answer this fast is restarting (or its node is gone)
Command = Callable[[Path, str], list[str]]  # (the actor's private directory, its node's IP) -> argv


def private_files(security: SecurityConfig) -> dict[str, str]:
    """The files ``security`` names that exist, by field: what an actor on another node needs."""
    return {
        field: Path(value).read_text()
        for field, value in security.model_dump().items()
        if isinstance(value, Path) and value.exists()
    }


def relocated(security: SecurityConfig, directory: Path) -> dict[str, Any]:
    """``security`` with each file it names moved to ``directory`` (the actor's copies), as JSON."""
    dumped = security.model_dump(mode="json")
    for field, value in security.model_dump().items():
        if isinstance(value, Path):
            dumped[field] = str(directory / field)
    return dumped


PRIVATE_PREFIX, OWNER = "fp8rl-actor-", "owner"


def sweep_orphans(where: Path) -> None:
    """Remove the private directories of actors that are gone without stopping (killed by Ray, their
    node's OOM killer, or a coordinator that died): each names its owner's PID."""
    for directory in where.glob(f"{PRIVATE_PREFIX}*"):
        try:
            os.kill(int((directory / OWNER).read_text()), 0)
        except ProcessLookupError:
            shutil.rmtree(directory, ignore_errors=True)
        except (OSError, ValueError):
            pass  # (another user's, or still being made)


class ServiceActor:
    """One service process on a Ray node, a child that dies with this actor (PR_SET_PDEATHSIG, and the
    service's parent watch). Its secrets are in a private directory of the node, removed when it stops
    (or, if it is killed, by the next actor on the node); its log is the node's TMPDIR/fp8rl-NAME-PID.log.
    The child's exit ends the actor, so Ray restarts a replica, and a trainer rank shows as dead."""

    def __init__(
        self, name: str, command: Command | None = None, files: dict[str, str] | None = None
    ) -> None:
        import ray

        self.name, self.stopping = name, False
        self.child: Child | None = None
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        # Secrets in memory, not on disk, unless the node's TMPDIR says where; the service's log on disk.
        shm = Path("/dev/shm")
        where = Path(tempfile.gettempdir()) if os.environ.get("TMPDIR") or not shm.is_dir() else shm
        sweep_orphans(where)
        self.dir = Path(tempfile.mkdtemp(prefix=PRIVATE_PREFIX, dir=where))
        (self.dir / OWNER).write_text(str(os.getpid()))
        self.log = Path(tempfile.gettempdir()) / f"fp8rl-{name}-{os.getpid()}.log"
        if command is not None:  # a replica: started, and bound, before the actor counts as created
            self.start(command, files or {}, watch=False)
            try:  # (one that fails here is not restarted: the run reports why)
                if self.address(START_TIMEOUT_S) is None:
                    raise TimeoutError(f"{name} did not bind within {START_TIMEOUT_S:.0f}s")
            except BaseException:
                self.stop()
                raise
            self.watch()

    def where(self) -> tuple[str, str]:
        return self.node_id, self.node_ip

    def status(self) -> tuple[str, str | None]:
        """Its node, and the address its service bound (None: not yet)."""
        return self.node_id, self.address(0)

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind((self.node_ip, 0))
            return int(s.getsockname()[1])

    def start(self, command: Command, files: dict[str, str], watch: bool = True) -> None:
        for field, text in files.items():
            write_private(self.dir / field, text)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())}
        self.child = Child(self.name, command(self.dir, self.node_ip), self.log, env)
        if watch:
            self.watch()

    def watch(self) -> None:
        threading.Thread(target=self._exit_with_child, name="child-watch", daemon=True).start()

    def address(self, timeout: float) -> str | None:
        """The ``host:port`` the service bound; None if it has not within ``timeout``."""
        assert self.child is not None
        try:
            return self.child.bound_address(timeout)
        except TimeoutError:
            return None

    def _exit_with_child(self) -> None:
        assert self.child is not None
        status = self.child.proc.wait()
        if self.stopping:
            return
        tail = self.child.log_path.read_text(errors="replace")[-3000:]
        print(f"{self.name} exited with status {status} ({self.log}):\n{tail}", file=sys.stderr, flush=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        os._exit(1)  # (Ray restarts a replica's actor; a trainer rank's stays dead)

    def stop(self) -> None:
        self.stopping = True
        if self.child is not None:
            self.child.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def replica_command(args: list[str], security: SecurityConfig) -> Command:
    def command(directory: Path, ip: str) -> list[str]:
        sets = as_sets({"security": relocated(security, directory)})
        return python_module("rollout_service.cli", *args, "--host", ip, *sets)

    return command


def trainer_command(
    config: dict[str, Any], security: SecurityConfig, rank: int, ranks: int, master: tuple[str, int]
) -> Command:
    """Rank ``rank`` of ``ranks``: the trainer itself, or a torchrun node of the group at ``master``."""

    def command(directory: Path, ip: str) -> list[str]:
        path = directory / "trainer.yaml"
        write_private(path, yaml.safe_dump(config | {"host": ip, "security": relocated(security, directory)}))
        serve = ["-m", "trainer_service.cli", "serve", "--config", str(path)]
        if ranks == 1:
            return [sys.executable, *serve]
        torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={ranks}", "--nproc-per-node=1"]
        torchrun += [f"--node-rank={rank}", f"--master-addr={master[0]}", f"--master-port={master[1]}"]
        # The rank's parent is torchrun, and its PID is known only once it runs: the shell exports its
        # own, which exec keeps.
        watch = f'export {PARENT_ENV}=$$; exec "$@"'
        return ["sh", "-c", watch, "sh", *torchrun, "--module", *serve[1:]]

    return command


class RayProcesses(EmbeddedProcesses):
    """An embedded run whose trainer ranks and replicas are Ray actors (module docstring)."""

    tls_required = True  # the services talk across hosts

    def __init__(self, config: CoordinatorConfig, run_dir: Path, stack: ExitStack) -> None:
        super().__init__(config, run_dir, stack)
        self.ray_config = config.embedded.ray
        # Refused before anything starts.
        self.address = self.ray_config.address or os.environ.get("RAY_ADDRESS")
        if not self.address:
            raise RunExit(2, "--launcher ray joins a running Ray cluster: give --ray-address or RAY_ADDRESS")
        try:
            import ray  # noqa: F401
        except ImportError:
            raise RunExit(2, "--launcher ray needs Ray: pip install 'fp8rl[ray]'") from None
        self.rank_actors: list[Any] = []
        self.replicas: list[Any] = []
        self.placed: dict[int, tuple[str, str]] = {}  # replica -> (node, address) it last answered from
        self.gone: dict[int, str] = {}  # replica -> why it will not come back
        self.me: SecurityConfig | None = None

    def compute_dtype(self) -> str:
        """`auto`: bfloat16 where the actors get GPUs, float32 otherwise (not this machine's device)."""
        if self.config.embedded.compute_dtype != "auto":
            return self.config.embedded.compute_dtype
        return "bfloat16" if self.ray_config.replica_gpus or self.ray_config.trainer_gpus else "float32"

    def platform_refusal(self, model: Path, dtype: str) -> str | None:
        return None  # (the nodes' platform, not this machine's: each replica refuses what its cannot run)

    def start_services(self, model: Path, dtype: str, me: SecurityConfig) -> tuple[str, list[str]]:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.trainer_ranks()  # (refuses ranks for one process's checkpoints, as a local run does)
        if not ray.is_initialized():
            handler = signal.getsignal(signal.SIGTERM)
            try:
                ray.init(address=self.address, log_to_driver=False, configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise RunExit(1, f"cannot join the Ray cluster at {self.address}: {exc}") from None
            finally:
                signal.signal(signal.SIGTERM, handler)  # (ray.init installs its own: keep the run's)
        self.stack.callback(ray.shutdown)
        self.me = me
        actor = ray.remote(ServiceActor)
        ranks, cfg = self.config.embedded.trainer_procs, self.ray_config
        # The trainer: one placement group, a bundle per rank; rank 0 first, as it hosts the rendezvous.
        group = placement_group(
            [
                {"CPU": cfg.trainer_cpus, "GPU": cfg.trainer_gpus}
                if cfg.trainer_gpus
                else {"CPU": cfg.trainer_cpus}
            ]
            * ranks,
            strategy=cfg.trainer_strategy,
        )
        self.stack.callback(remove_placement_group, group)
        if not wait_ready(ray, group.ready(), START_TIMEOUT_S):
            raise RunExit(
                1, f"the Ray cluster has no room for {ranks} trainer rank(s) ({cfg.trainer_strategy})"
            )
        for rank in range(ranks):
            handle = actor.options(
                num_cpus=cfg.trainer_cpus,  # (its bundle's: Ray sets the rank's threads from it)
                num_gpus=cfg.trainer_gpus,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank
                ),
            ).remote(f"trainer-{rank}")
            self.stack.callback(stop_actor, ray, handle)
            self.rank_actors.append(handle)
        rank_nodes = [ray.get(h.where.remote()) for h in self.rank_actors]
        master = (rank_nodes[0][1], ray.get(self.rank_actors[0].free_port.remote()))
        trainer_security = security_for(secrets_dir(self.run_dir), "trainer", True)
        config = embedded_trainer(self.config, model, dtype, self.run_dir, True).model_dump(mode="json")
        for rank, handle in enumerate(self.rank_actors):
            command = trainer_command(config, trainer_security, rank, ranks, master)
            ray.get(handle.start.remote(command, private_files(trainer_security)))
        # The replicas, spread over the nodes; each actor is created once its service has bound.
        replica_security = security_for(secrets_dir(self.run_dir), "replica", True)
        args = self.rollout_args(model, dtype, with_security=False)
        for i in range(cfg.replicas):
            handle = actor.options(
                num_cpus=cfg.replica_cpus,
                num_gpus=cfg.replica_gpus,
                max_restarts=-1,
                max_task_retries=0,
                scheduling_strategy="SPREAD",
            ).remote(f"rollout-{i}", replica_command(args, replica_security), private_files(replica_security))
            self.stack.callback(stop_actor, ray, handle)
            self.replicas.append(handle)
        trainer_address = ray.get(self.rank_actors[0].address.remote(START_TIMEOUT_S))
        if trainer_address is None:
            raise RunExit(1, f"the trainer did not bind within {START_TIMEOUT_S:.0f}s")
        wait_healthy_address(trainer_address, "trainer", me, START_TIMEOUT_S)
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(ready := self.poll_replicas()) < cfg.replicas:
            if self.gone:
                raise RunExit(1, f"a replica failed to start: {next(iter(self.gone.values()))[-2000:]}")
            if time.monotonic() > deadline:
                raise RunExit(
                    1, f"{len(ready)} of {cfg.replicas} replicas serving after {START_TIMEOUT_S:.0f}s"
                )
            time.sleep(1)
        nodes = sorted({node for node, _ in self.placed.values()})
        on = ", ".join(node[:12] for node, _ in rank_nodes)
        self.say(f"trainer at {trainer_address}, {ranks} rank(s) on node(s) {on}; replicas on {len(nodes)}")
        return trainer_address, ready

    def say(self, line: str) -> None:
        print(f"coordinator: ray: {line}", file=sys.stderr, flush=True)

    def poll_replicas(self) -> list[str]:
        """The addresses of the replicas serving now; one that moved (Ray restarted it) is said once."""
        import ray

        assert self.me is not None
        asked = {i: h.status.remote() for i, h in enumerate(self.replicas) if i not in self.gone}
        answered, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=POLL_TIMEOUT_S)
        ready = []
        for i, ref in asked.items():
            if ref not in answered:
                continue  # restarting, or its node is gone
            try:
                node, address = ray.get(ref)
            except ray.exceptions.ActorDiedError as exc:
                if exc.actor_init_failed:  # for good: its service failed to start
                    self.gone[i] = str(exc)
                    self.say(f"replica {i} is gone: {exc}")
                continue
            except ray.exceptions.RayError:
                continue
            if address is None:
                continue
            if self.placed.get(i) != (node, address):
                if not is_serving(address, "rollout", self.me):
                    continue
                if i in self.placed:
                    self.say(f"replica {i} is back, on node {node[:12]} at {address}")
                else:
                    self.say(f"replica {i} on node {node[:12]} at {address}")
                self.placed[i] = (node, address)
            ready.append(address)
        return ready

    def replica_addresses(self) -> list[str]:
        """The replicas serving; one Ray is restarting is waited for up to `replica_restart_wait_s`, and
        while none serves, as long as a replica takes to start."""
        start = time.monotonic()
        while True:
            ready = self.poll_replicas()
            waited, expected = time.monotonic() - start, len(self.replicas) - len(self.gone)
            enough = len(ready) >= expected or (ready and waited >= self.ray_config.replica_restart_wait_s)
            if enough or waited >= START_TIMEOUT_S:
                return ready
            time.sleep(1)

    def dead(self, grace_s: float = 15.0) -> list[str]:
        """Redis, or a trainer rank, that died or does not answer within ``grace_s`` (a rank's actor is
        idle once its service runs; a replica is Ray's to restart)."""
        import ray

        asked = [h.where.remote() for h in self.rank_actors]
        answered, _ = ray.wait(asked, num_returns=len(asked), timeout=grace_s)
        dead = super().dead(grace_s=0)
        for rank, ref in enumerate(asked):
            if ref not in answered:
                dead.append(f"trainer rank {rank} (no answer in {grace_s:.0f}s)")
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:
                dead.append(f"trainer rank {rank} ({type(exc).__name__})")
        return dead


def wait_ready(ray: Any, ref: Any, timeout: float) -> bool:
    ready, _ = ray.wait([ref], timeout=timeout)
    return bool(ready)


def stop_actor(ray: Any, handle: Any) -> None:
    """Stop the actor's service (its files go with it), then the actor; one already gone is left."""
    try:
        ray.get(handle.stop.remote(), timeout=30)
    except Exception as exc:  # (its node is gone, or it is restarting: nothing of it left to stop here)
        log.info("actor not stopped cleanly: %s", exc)
    try:
        ray.kill(handle, no_restart=True)
    except Exception as exc:
        log.info("actor not killed: %s", exc)
