"""`coordinator start` end to end with real processes (embedded mode): a short run, kill -9 and resume,
bounded staleness, config errors before anything starts, and no child process left behind."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis

from coordinator.metrics import read_metrics
from fp8rl.credentials import redis_url_with_password
from tests.support import SHORT_RUN, child_process, coordinator, coordinator_start, wait_for_line

pytestmark = pytest.mark.slow


def start_fp8(model: Path, steps: int, run_id: str, run_dir: Path, *extra: str) -> list[str]:
    """`coordinator start` of a short fp8 run of ``model`` (SHORT_RUN)."""
    args = ["--model", str(model), "--steps", str(steps), "--run-id", run_id]
    return coordinator_start(run_dir, "--recipe", "fp8", *args, *extra, *SHORT_RUN)


def assert_children_gone(run_dir: Path) -> None:
    """Every child the coordinator started (PIDs from run.json) has exited."""
    children = json.loads((run_dir / "run.json").read_text())["children"]
    assert children, "run.json lists no children"
    deadline = time.monotonic() + 30
    for name, pid in children.items():
        while _alive(pid):
            assert time.monotonic() < deadline, f"{name} (pid {pid}) outlived the coordinator"
            time.sleep(0.2)


def assert_secrets_kept(run_dir: Path) -> None:
    """The embedded redis-server's password is in its 0600 file only: not in run.json (itself 0600), not
    in any child's command line; without it Redis refuses."""
    info_path, password_file = run_dir / "run.json", run_dir / "redis" / "password"
    info = json.loads(info_path.read_text())
    password = password_file.read_text()
    assert len(password) >= 24 and password not in info_path.read_text()
    assert info_path.stat().st_mode & 0o777 == 0o600 and password_file.stat().st_mode & 0o777 == 0o600
    names = ("update-signing.key", "registration.key", "trainer.token")
    secrets = [(run_dir / "secrets" / name).read_text().strip() for name in names]
    for pid in info["children"].values():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert all(secret.encode() not in cmdline for secret in (password, *secrets))
    for path in (run_dir / "secrets").iterdir():
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert all(secret not in info_path.read_text() for secret in secrets)
    import redis

    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(info["redis_url"]).set("x", 1)
    assert redis.Redis.from_url(
        redis_url_with_password(info["redis_url"], {"REDIS_PASSWORD": password})
    ).ping()


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per tag, as TensorBoard's own reader sees the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def tensorboard_histograms(run_dir: Path) -> dict[str, list[int]]:
    """The steps of each histogram tag, as TensorBoard's reader sees them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"histograms": 0})  # 0: keep all
    events.Reload()
    return {tag: [e.step for e in events.Histograms(tag)] for tag in events.Tags()["histograms"]}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_bad_config_fails_before_any_process_starts(tmp_path: Path) -> None:
    for bad, message in (
        (["--steps", "0"], "steps"),
        (["--task", "jsonl"], "dataset"),
        (["--temperature", "-1"], "temperature"),
        (["--set", "nonsense=1"], "nonsense"),
        (["--set", "learner.optimizer.lr=-1"], "learner.optimizer.lr"),  # the trainer's part, checked here
        (["--set", "learner.loss.advantage_norm=median"], "learner.loss.advantage_norm"),
        (["--set", "learner.micro_batch=4"], "learner.micro_batch"),
        (
            ["--task", "dataset", "--dataset", "/nonexistent.jsonl"],
            "dataset /nonexistent.jsonl does not exist",
        ),
        (["--task", "dataset", "--dataset", "gsm8k-sample"], "dataset: "),  # its prompts are under question
        (["--dataset", "gsm8k-sample", "--prompt-key", "question"], "task dataset"),  # not silently arith
    ):
        run_dir = tmp_path / "bad"
        start = time.monotonic()
        proc = subprocess.run(
            coordinator("start", "--run-dir", str(run_dir), *bad), capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not run_dir.exists() and time.monotonic() - start < 30


def test_embedded_run_writes_metrics_and_leaves_no_child(tiny_model_dir_f32: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        start_fp8(tiny_model_dir_f32, 3, "embedded", run_dir, "--wandb-project", "fp8rl-test", "--tls"),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = read_metrics(run_dir)
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    for key in (
        "weight_version",
        "reward_mean",
        "token_mult_prob_error",
        "gen_kl_error",
        "is_weight_mean",
        "is_clipped_fraction",
        "generate_s",
        "train_s",
        "publish_s",
        "step_s",
        "rollout_tokens_per_s",
        "sync_bytes",
        "sync_density",
    ):
        assert all(key in r for r in recs[1:]), key
    assert "val_accuracy" in recs[0] and "val_accuracy" in recs[-1]
    assert all(r["token_mult_prob_error"] < 1.05 for r in recs[1:])
    assert "summary:" in proc.stdout and (run_dir / "token_mult_prob_error.png").exists()
    assert "failed" not in proc.stdout + proc.stderr
    assert all(r["sync_keyframes"] == 0 for r in recs[1:])  # every step's weights travel as a delta
    assert all(r["sync_shared_memory"] == 1 for r in recs[1:])  # its bytes as shared memory (one host)
    assert all(0 < r["sync_refit_s"] < r["publish_s"] for r in recs[1:])  # the replica's engine refit
    scalars = tensorboard_scalars(run_dir)
    assert [s for s, _ in scalars["token_mult_prob_error"]] == [1, 2, 3]
    assert [s for s, _ in scalars["val_accuracy"]] == [0, 3]
    assert [v for _, v in scalars["reward_mean"]] == pytest.approx([r["reward_mean"] for r in recs[1:]])
    histograms = tensorboard_histograms(run_dir)
    assert histograms["abs_log_ratio"] == histograms["is_weight"] == [1, 2, 3]
    offline = list((run_dir / "wandb").glob("offline-run-*-embedded"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb")), list((run_dir / "wandb").iterdir())
    assert_children_gone(run_dir)
    status = subprocess.run(
        coordinator("status", "--run-dir", str(run_dir)), capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0 and "embedded" in status.stdout
    # The run's processes spoke mutual TLS under the run's own CA, with tokens and signed updates; the
    # replica kept its high-water mark beside the secrets, and only the trainer's config names the key
    # that signs.
    secrets = run_dir / "secrets"
    names = {"ca.pem", "coordinator.pem", "tokens", "update-signing.key", "update-verify.pub"}
    assert names | {"replica.high-water"} <= {p.name for p in secrets.iterdir()}
    assert "update-signing.key" in (run_dir / "trainer.yaml").read_text()


def test_kill_9_mid_step_then_resume(tiny_model_dir_f32: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = start_fp8(tiny_model_dir_f32, 4, "crash", run_dir)
    log = tmp_path / "first.log"
    with child_process(args, log) as proc:
        wait_for_line(proc, log, r"step 2/4", timeout=600)
        assert_secrets_kept(run_dir)  # (while the children run: their command lines are read)
        os.kill(proc.pid, signal.SIGKILL)  # mid-step 3
        proc.wait()
    assert_children_gone(run_dir)  # they die with the coordinator, even on SIGKILL
    again = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    recs = read_metrics(run_dir)
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]  # nothing skipped, nothing twice
    assert "resuming run crash" in again.stdout
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "resumed from" in trainer_log
    # The trainer's step counter ends at 4: every step was applied exactly once.
    assert (
        json.loads(sorted((run_dir / "checkpoints").glob("step-*"))[-1].joinpath("trainer.json").read_text())[
            "step"
        ]
        == 4
    )
    assert_children_gone(run_dir)


def test_max_staleness_one_overlaps_with_top_k_and_top_p(tiny_model_dir_f32: Path, tmp_path: Path) -> None:
    """Generation ahead never passes max_staleness; and under top-k / top-p (which put -inf logprobs on
    prompt tokens outside the sampling set) the loss, gradient and divergence metrics stay finite (they
    were NaN), with the excluded share reported. One run shows both."""
    run_dir = tmp_path / "run"
    top = ["--set", "top_k=8", "--set", "top_p=0.9"]
    proc = subprocess.run(
        start_fp8(tiny_model_dir_f32, 4, "stale", run_dir, "--max-staleness", "1", *top),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trained = read_metrics(run_dir)[1:]
    assert trained[0]["staleness"] == 0
    assert all(0 <= r["staleness"] <= 1 for r in trained)
    assert any(r["staleness"] == 1 for r in trained), "generation never overlapped training"
    events = redis_events(run_dir)
    assert all(e["kind"] != "stale-batch" or "staler than 1" in e["detail"] for e in events)
    for record in trained:
        for key in ("loss", "grad_norm", "token_mult_prob_error", "gen_kl_error", "is_weight_min"):
            assert math.isfinite(record[key]), (key, record)
        assert 0 <= record["out_of_support_fraction"] < 0.5
        assert record["token_mult_prob_error"] < 1.05


def redis_events(run_dir: Path) -> list[dict]:
    """Events from the run's AOF: start a throwaway redis-server on the run's data directory."""
    from tests.support import redis_server

    with redis_server(run_dir / "redis", aof=True, log="inspect-redis.log") as url:
        client = redis.Redis.from_url(url)
        key = next(k for k in client.keys("fp8rl:run:*:events"))
        return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in client.xrange(key)]


def test_stop_then_resume_then_ctrl_c(tiny_model_dir_f32: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = start_fp8(tiny_model_dir_f32, 50, "interrupted", run_dir)
    # `coordinator stop` ends the run cleanly at the next step boundary.
    log = tmp_path / "first.log"
    with child_process(args, log) as proc:
        wait_for_line(proc, log, r"step 1/50", timeout=600)
        stop = subprocess.run(
            coordinator("stop", "--run-id", "interrupted", "--run-dir", str(run_dir)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stop.returncode == 0 and "stop requested" in stop.stdout
        assert proc.wait(timeout=300) == 0
    stopped = re.search(r"stopped on request after step (\d+)/50", log.read_text())
    assert stopped, log.read_text()[-3000:]
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == list(range(int(stopped[1]) + 1))  # 0: base validation
    assert_children_gone(run_dir)
    # The same run id resumes after the last committed step; Ctrl-C then stops every child.
    log = tmp_path / "second.log"
    with child_process(args, log) as proc:
        wait_for_line(proc, log, rf"step {int(stopped[1]) + 1}/50", timeout=600)
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    assert "resuming run interrupted" in log.read_text()
    scalars = tensorboard_scalars(run_dir)  # the resumed session continued the same TensorBoard run
    steps = [s for s, _ in scalars["token_mult_prob_error"]]
    assert steps == list(range(1, max(steps) + 1)) and max(steps) > int(stopped[1])
    assert "resume with --run-id interrupted" in log.read_text()
    assert_children_gone(run_dir)


def test_compare_runs_each_recipe_and_writes_the_table(tiny_model_dir_f32: Path, tmp_path: Path) -> None:
    """bf16 against fp8-pow2: the pow2 run only trains if the trainer ships power-of-two scales (the
    replica refuses others) and stays consistent with the rollout."""
    out = tmp_path / "compare"
    short = (*SHORT_RUN, "--compute-dtype", "float32", "--progress", "plain")
    sets = [arg for pair in zip(short[::2], short[1::2], strict=True) for arg in _as_set(*pair)]
    proc = subprocess.run(
        coordinator(
            "compare",
            "--recipes",
            "bf16,fp8-pow2",
            "--steps",
            "2",
            "--out",
            str(out),
            "--set",
            f"model={tiny_model_dir_f32}",
            *sets,
        ),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (out / "compare.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [row.split("|")[1].strip() for row in rows] == ["`bf16`", "`fp8-pow2`"]
    assert all(len(row.split("|")) == len(rows[0].split("|")) and " - |" not in row for row in rows)
    for recipe in ("bf16", "fp8-pow2"):
        assert [r["step"] for r in read_metrics(out / recipe)] == [0, 1, 2]
    assert all(r["token_mult_prob_error"] < 1.05 for r in read_metrics(out / "fp8-pow2")[1:])
    assert (out / "token_mult_prob_error.png").stat().st_size > 0
    assert (out / "val_accuracy.png").stat().st_size > 0
    bad = subprocess.run(coordinator("compare", "--recipes", "bf16,fp9"), capture_output=True, text=True)
    assert bad.returncode == 2 and "fp9" in bad.stderr


def _as_set(flag: str, value: str) -> list[str]:
    """A `start` flag (`--prompts-per-step 4`) as a config override (`--set prompts_per_step=4`)."""
    if flag == "--set":
        return ["--set", value]
    return ["--set", f"{flag.removeprefix('--').replace('-', '_')}={value}"]
