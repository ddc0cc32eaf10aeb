"""`docker compose up`, for real: the image built from the project's Dockerfile, the compose file run by
Docker Compose v2 on a container engine (tests/containers.py) with two replicas, the trainer killed mid-run
and brought back with `up`, then Redis killed with SIGKILL and brought back the same way, then everything
checked from the volumes and torn down with `down -v`.

One run serves every test in this module (module-scoped fixture): they read what it left."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from coordinator.metrics import read_metrics
from tests.containers import IMAGE, IMAGE_BUILD, Compose, base_images, build_image, container_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
RUN_ID = "compose-test"
STEPS = 6
KILL_AFTER_STEP = 1  # the trainer is killed once this step is committed
KILL_REDIS_AFTER_STEP = 3  # then Redis, with kill -9 (its AOF is fsynced on every write)

# Run by the coordinator's image on the project's network with its secrets: the run as Redis has it, and
# each registered replica's own status over mutual TLS.
PROBE = f"""
import json, os, redis, ssl, time, httpx
from coordinator.clients import RolloutPool
from coordinator.environments import NamedServer
from coordinator.state import RunStore
from fp8rl.config import read_yaml
from fp8rl.credentials import redis_url_with_password
from fp8rl.registry import live_replicas
from fp8rl.security import SERVER_NAMES, SecurityConfig
from fp8rl.v1 import common_pb2
client = redis.Redis.from_url(redis_url_with_password(os.environ["REDIS_URL"]))
store = RunStore(client, {RUN_ID!r})
# Both replicas list themselves again within a few beats (2 s) of Redis' return from its kill -9.
deadline = time.monotonic() + 20
while len(registered := sorted(live_replicas(client))) < 2 and time.monotonic() < deadline:
    time.sleep(0.5)
security = SecurityConfig.model_validate(read_yaml("/config/coordinator.yaml")["security"])
pool = RolloutPool(lambda: registered, security)
status = {{a: pool.stub(a).GetStatus(common_pb2.GetStatusRequest(), timeout=10) for a in registered}}
# Each replica's OpenAI face over HTTPS under the run's CA, with the coordinator's token, and without one.
tls = NamedServer(SERVER_NAMES["rollout"], ssl.create_default_context(cafile=str(security.tls_ca)))
bearer = {{"Authorization": "Bearer " + security.token_file.read_text().strip()}}
def completion(address):
    with httpx.Client(transport=tls, headers=bearer, timeout=60) as http:
        [model] = [m["id"] for m in http.get(f"https://{{address}}/v1/models").json()["data"]]
        body = {{"model": model, "prompt": "1+1=", "max_tokens": 2}}
        return http.post(f"https://{{address}}/v1/completions", json=body).json()["weight_version"]
def anonymous(address):
    with httpx.Client(transport=tls, timeout=60) as http:
        return http.get(f"https://{{address}}/v1/models").status_code
faces = {{a: s.http_address for a, s in status.items()}}
print(json.dumps({{
    "metrics": store.metrics(), "replica_versions": store.replica_versions(), "registered": registered,
    "tokens_generated": {{a: s.tokens_generated for a, s in status.items()}},
    "weight_version": {{a: s.weight_version for a, s in status.items()}},
    "http_weight_version": {{a: completion(h) for a, h in faces.items()}},
    "http_anonymous": {{a: anonymous(h) for a, h in faces.items()}},
}}))
"""


@dataclass
class ComposeRun:
    compose: Compose
    password: str
    secrets: list[bytes]  # every token and key the secrets service wrote
    record: dict  # PROBE's output after the run
    run_dir: Path  # the runs volume's run directory, copied out
    checkpoints: Path  # the checkpoints volume, copied out
    cmdlines: dict[str, bytes]  # container -> every /proc/*/cmdline in it, while the run was going
    refused: dict[str, bool]  # what a plaintext client from the host network got
    accepted: bool  # the same trainer, with the coordinator's certificate
    killed_at: int  # steps committed when the trainer was killed
    redis_killed_at: int  # steps committed just before Redis was killed
    stopped: dict[str, int]  # container -> exit code after `compose stop`
    timings: dict[str, float]
    leftovers: list[str]  # what `down -v` left


def committed_steps(compose: Compose) -> int:
    """Steps in the run's metrics file so far (the coordinator must be running)."""
    (coordinator,) = compose.containers("coordinator")
    assert coordinator["State"] == "running", compose("logs", "coordinator", check=False).stdout[-4000:]
    done = compose("exec", "-T", "coordinator", "cat", f"/runs/{RUN_ID}/metrics.jsonl", check=False)
    return len(done.stdout.splitlines()) - 1 if done.returncode == 0 else -1


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(1)


def models_from_the_host(address: str, secrets: Path) -> list[str]:
    """The replica's model list, asked as docs/running.md shows ("The OpenAI face under compose"): the
    openai client, the run's CA and the reader's token, the certificate checked for the role's name."""
    import ssl

    import httpx
    from openai import OpenAI

    def as_replica(request: httpx.Request) -> None:
        request.extensions["sni_hostname"] = "replica"

    tls = ssl.create_default_context(cafile=str(secrets / "ca.pem"))
    client = OpenAI(
        base_url=f"https://{address}:8000/v1",
        api_key=(secrets / "reader.token").read_text().strip(),
        http_client=httpx.Client(verify=tls, event_hooks={"request": [as_replica]}),
    )
    return [m.id for m in client.models.list().data]


def raises(error: type[Exception], call: Callable[[], object]) -> bool:
    try:
        call()
    except error:
        return True
    return False


@pytest.fixture(scope="module")
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeRun]:
    work = tmp_path_factory.mktemp("compose-up")
    timings: dict[str, float] = {}
    with container_engine(work) as engine:
        started = time.monotonic()
        if background := request.config.stash.get(IMAGE_BUILD, None):
            bases = background.bases()  # what is left of the build the session started (usually nothing)
        else:
            bases = base_images(engine)
            build_image(engine, bases, work)
        timings["build_wait_s"] = time.monotonic() - started
        password = secrets.token_urlsafe(24)
        variables = {**bases, "REDIS_PASSWORD": password, "FP8RL_STEPS": str(STEPS), "FP8RL_RUN_ID": RUN_ID}
        compose = Compose(engine, f"fp8rl-test-{secrets.token_hex(3)}", variables)
        up = ("up", "--detach", "--no-build", "--pull", "missing", "--scale", "rollout=2")
        try:
            started = time.monotonic()
            compose(*up)  # returns once the coordinator has started (its dependencies healthy)
            timings["up_s"] = time.monotonic() - started
            yield observe(compose, password, up, timings, work)
        finally:
            if not (work / "compose.log").exists():
                (work / "compose.log").write_text(compose("logs", "--no-color", check=False).stdout)
            compose("down", "--volumes", "--remove-orphans", "--timeout", "20", check=False)


def observe(compose: Compose, password: str, up: tuple[str, ...], timings: dict, work: Path) -> ComposeRun:
    containers = compose.containers()
    names = {c["Service"]: c["Name"] for c in containers}  # (one replica's name stands for both)
    replicas = [c["Name"] for c in containers if c["Service"] == "rollout"]
    running = [c["Name"] for c in containers if c["State"] == "running"]
    # Every process's command line in every container, while the coordinator runs.
    every_cmdline = ("sh", "-c", "cat /proc/[0-9]*/cmdline")
    cmdlines = {name: compose.engine.run("exec", name, *every_cmdline).stdout.encode() for name in running}
    assert names["coordinator"] in cmdlines and all(r in cmdlines for r in replicas), (running, names)
    shared = compose.volume("secrets", work / "secrets")
    keys = [*shared.glob("*.token"), shared / "registration.key", shared / "update-signing.key"]
    found_secrets = [p.read_bytes().strip() for p in keys if p.exists()]

    # Mutual TLS from the host's network: nothing in plaintext, the trainer with a certificate.
    from fp8rl.healthcheck import serving
    from fp8rl.security import SecurityConfig

    trainer = f"{compose.address(names['trainer'])}:50052"
    refused = {
        "trainer": not serving(trainer, "fp8rl.v1.Trainer", server="trainer"),
        **{r: not serving(f"{compose.address(r)}:50051", "fp8rl.v1.Rollout") for r in replicas},
    }
    redis_host = compose.address(names["redis"])
    plaintext = redis.Redis(host=redis_host, port=6379, socket_timeout=5)
    refused["redis"] = raises(redis.ConnectionError, plaintext.ping)
    own = compose.volume("secrets-coordinator", work / "coordinator-secrets")
    ca_only = SecurityConfig(tls_ca=own / "ca.pem")  # TLS, but no client certificate
    refused["trainer, without a client certificate"] = not serving(
        trainer, "fp8rl.v1.Trainer", security=ca_only, server="trainer"
    )
    as_coordinator = SecurityConfig(
        tls_ca=own / "ca.pem", tls_cert=own / "coordinator.pem", tls_key=own / "coordinator.key"
    )
    accepted = serving(trainer, "fp8rl.v1.Trainer", security=as_coordinator, server="trainer")
    # Redis over its TLS, without the password: nothing (and so the refusal above is TLS's).
    tls = {"ssl": True, "ssl_ca_certs": str(own / "ca.pem"), "ssl_check_hostname": False}
    no_password = redis.Redis(host=redis_host, port=6379, socket_timeout=5, **tls)  # type: ignore[arg-type]
    refused["redis, without the password"] = raises(
        redis.AuthenticationError, lambda: no_password.set("x", 1)
    )

    # The trainer killed mid-run, and `up` again: it resumes from its checkpoint, the run goes on.
    wait_until(lambda: committed_steps(compose) >= KILL_AFTER_STEP, 600, f"step {KILL_AFTER_STEP}")
    compose("kill", "trainer")
    killed_at = committed_steps(compose)
    started = time.monotonic()
    # (--no-recreate: under podman 4.3, Compose 2.40 reads every running container as changed and would
    # recreate them all; Docker's `up` starts the killed one alone, as this does.)
    compose(*up, "--no-recreate")
    timings["restart_s"] = time.monotonic() - started
    # Then Redis: SIGKILL (nothing flushed on the way out) and `up` again, from its append-only file; the
    # coordinator's client rides out the gap with its retries.
    wait_until(
        lambda: committed_steps(compose) >= KILL_REDIS_AFTER_STEP, 600, f"step {KILL_REDIS_AFTER_STEP}"
    )
    redis_killed_at = committed_steps(compose)  # (read just before: fewer than all, or no test)
    compose("kill", "--signal", "SIGKILL", "redis")
    compose(*up, "--no-recreate")
    coordinator = compose.containers("coordinator")[0]["ID"]
    waited = compose.engine.run("wait", coordinator, timeout=900)
    assert waited.stdout.strip() == "0", compose("logs", "coordinator", check=False).stdout[-4000:]
    timings["run_s"] = time.monotonic() - started
    probe = compose("run", "--rm", "--no-deps", "-T", "coordinator", "python", "-c", PROBE)
    record = json.loads(probe.stdout.strip().splitlines()[-1])
    record["host_models"] = {r: models_from_the_host(compose.address(r), shared) for r in replicas}
    runs = compose.volume("runs", work / "runs")
    checkpoints = compose.volume("checkpoints", work / "checkpoints")
    (work / "compose.log").write_text(compose("logs", "--no-color", "--timestamps").stdout)
    compose("stop", "--timeout", "30")
    stopped = {c["Name"]: c["ExitCode"] for c in compose.containers() if c["Service"] != "secrets"}
    compose("down", "--volumes", "--remove-orphans", "--timeout", "20")
    print(f"compose up timings (s): {json.dumps({k: round(v, 1) for k, v in timings.items()})}")
    return ComposeRun(
        compose,
        password,
        found_secrets,
        record,
        runs / RUN_ID,
        checkpoints,
        cmdlines,
        refused,
        accepted,
        killed_at,
        redis_killed_at,
        stopped,
        timings,
        compose.leftovers(),
    )


def test_every_step_is_recorded_once_across_the_trainer_and_redis_restarts(run: ComposeRun) -> None:
    """Redis' record of the run (steps Redis acknowledged before its kill -9 included) and the metrics
    file: each step once, none lost, none trained twice."""
    assert 0 < run.killed_at < run.redis_killed_at < STEPS
    steps = list(range(STEPS + 1))
    assert [r["step"] for r in read_metrics(run.run_dir)] == steps
    assert [r["step"] for r in run.record["metrics"]] == steps


def test_both_replicas_registered_and_served_batches(run: ComposeRun) -> None:
    registered = run.record["registered"]
    assert len(registered) == 2 and all(a.endswith(":50051") for a in registered)
    assert all(run.record["tokens_generated"][a] > 0 for a in registered), run.record["tokens_generated"]
    assert run.record["weight_version"] == {a: STEPS for a in registered}
    assert run.record["replica_versions"] == {a: STEPS for a in registered}


def test_each_replicas_openai_face_answers_the_runs_callers_only(run: ComposeRun) -> None:
    registered = run.record["registered"]
    assert run.record["http_weight_version"] == {a: STEPS for a in registered}  # HTTPS, the run's token
    assert run.record["http_anonymous"] == {a: 401 for a in registered}  # no token: refused
    assert list(run.record["host_models"].values()) == [["tiny-arith"]] * 2, run.record["host_models"]


def test_the_trainers_checkpoints_are_on_their_volume(run: ComposeRun) -> None:
    kept = sorted(p.name for p in run.checkpoints.iterdir())
    assert kept and kept[-1] == f"step-{STEPS:08d}", kept
    assert all((run.checkpoints / name / "manifest.json").is_file() for name in kept)


def test_mutual_tls_is_in_force(run: ComposeRun) -> None:
    assert run.refused == dict.fromkeys(run.refused, True), run.refused
    assert len(run.refused) == 6  # plaintext to the trainer, both replicas and Redis; the two above
    assert run.accepted  # (so the refusals are the TLS's, not an unreachable network)


def test_no_secret_in_any_command_line(run: ComposeRun) -> None:
    assert len(run.secrets) >= 4 and run.password
    for name, cmdlines in run.cmdlines.items():
        assert cmdlines, name
        for secret in (run.password.encode(), *run.secrets):
            assert secret not in cmdlines, f"a secret in a command line in {name}"


def test_every_service_stops_on_sigterm(run: ComposeRun) -> None:
    """`compose stop` (SIGTERM, then SIGKILL after 30 s): each one exits by itself, 137 is the SIGKILL."""
    assert len(run.stopped) == 5 and 137 not in run.stopped.values(), run.stopped


def test_down_leaves_nothing(run: ComposeRun) -> None:
    assert run.leftovers == []
    assert run.compose.engine.run("image", "inspect", IMAGE, check=False).returncode == 0  # (the image stays)
