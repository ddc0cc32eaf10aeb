"""`coordinator status | stop | report` on an existing run (from Redis while it runs, else its files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coordinator.metrics import METRICS_FILE, committed, read_metrics
from fp8rl.credentials import PASSWORD_FILE_ENV, check_run_id, redis_url_with_password


def _run_dir(run_id: str | None, run_dir: Path | None) -> Path:
    if run_id is not None:
        try:
            check_run_id(run_id)
        except ValueError as exc:
            raise SystemExit(f"coordinator: {exc}") from None
    if run_dir is not None:
        return run_dir
    if run_id is not None:
        return Path("runs") / run_id
    runs = sorted(Path("runs").glob(f"*/{METRICS_FILE}"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise SystemExit("coordinator: no runs found under runs/; pass --run-id or --run-dir")
    return runs[-1].parent


def _store(run_dir: Path, run_id: str | None, redis_url: str | None) -> Any:
    import redis

    from coordinator.state import RunStore

    info = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() else {}
    url = redis_url or info.get("redis_url")
    if not url:
        return None
    if not redis_url and info.get("redis_password_file"):  # an embedded run's own redis-server
        url = redis_url_with_password(url, {PASSWORD_FILE_ENV: info["redis_password_file"]})
    client = redis.Redis.from_url(redis_url_with_password(url), socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError:
        return None
    return RunStore(client, run_id or info["run_id"])


def status(run_id: str | None, run_dir: Path | None, redis_url: str | None) -> int:
    from rich.console import Console
    from rich.table import Table

    directory = _run_dir(run_id, run_dir)
    store = _store(directory, run_id, redis_url)
    records = committed(store.metrics()) if store is not None else read_metrics(directory)
    console = Console()
    if store is not None:
        state = store.read()
        console.print(f"run {store.run_id}: step {state.step}, phase {state.phase} (live, from Redis)")
    else:
        console.print(f"run {directory.name}: {len(records)} records (from {directory / METRICS_FILE})")
    table = Table("step", "reward", "val acc", "mult err", "gen kl", "step s", "sync bytes")
    for r in records[-10:]:
        table.add_row(
            *(
                _cell(r.get(k))
                for k in (
                    "step",
                    "reward_mean",
                    "val_accuracy",
                    "token_mult_prob_error",
                    "gen_kl_error",
                    "step_s",
                    "sync_bytes",
                )
            )
        )
    console.print(table)
    return 0


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def stop(run_id: str | None, run_dir: Path | None, redis_url: str | None) -> int:
    directory = _run_dir(run_id, run_dir)
    store = _store(directory, run_id, redis_url)
    if store is None:
        print(f"coordinator: run {run_id} is not running (no reachable Redis)")
        return 1
    store.request_stop()
    print(f"stop requested: run {store.run_id} stops at the next step boundary")
    return 0


def report(run_id: str | None, run_dir: Path | None, redis_url: str | None) -> int:
    from coordinator.report import write_plots

    directory = _run_dir(run_id, run_dir)
    for path in write_plots(read_metrics(directory), directory):
        print(path)
    return 0
