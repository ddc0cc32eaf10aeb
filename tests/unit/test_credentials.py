"""Secrets out of command lines and run files, run ids that stay inside runs/ (fp8rl/credentials.py and
where the coordinator uses it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fp8rl.credentials import check_run_id, has_password, redacted, redis_url_with_password, write_private


def test_password_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("fi/le:pw\n")
    assert (
        redis_url_with_password("redis://h:6379/0", {"REDIS_PASSWORD": "env-pw"})
        == "redis://:env-pw@h:6379/0"
    )
    assert (
        redis_url_with_password(
            "redis://h:6379/0", {"REDIS_PASSWORD_FILE": str(secret), "REDIS_PASSWORD": "x"}
        )
        == "redis://:fi%2Fle%3Apw@h:6379/0"
    )
    assert redis_url_with_password("redis://:given@h/0", {"REDIS_PASSWORD": "env-pw"}) == "redis://:given@h/0"
    assert redis_url_with_password("redis://h/0", {}) == "redis://h/0"
    ipv6 = redis_url_with_password("redis://[::1]:6379/0", {"REDIS_PASSWORD": "p"})
    assert ipv6 == "redis://:p@[::1]:6379/0" and redacted(ipv6) == "redis://[::1]:6379/0"
    assert (
        redacted("redis://user:pw@h:1/0") == "redis://user@h:1/0" and redacted("redis://h/0") == "redis://h/0"
    )
    assert has_password("redis://:pw@h/0") and not has_password("redis://h/0") and not has_password(None)


def test_private_files_are_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "a" / "secret"
    write_private(path, "x")
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("bad", ["..", ".", "../x", "a/b", "-rf", ".hidden", "", "a" * 129, "run id"])
def test_run_ids_that_could_leave_runs_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="run id"):
        check_run_id(bad)
    check_run_id("run-2026.12_01")


def test_every_command_refuses_such_a_run_id_before_touching_anything(tmp_path: Path) -> None:
    for command in ("start", "status", "report", "stop"):
        args = [sys.executable, "-m", "coordinator.cli", command, "--run-id", ".."]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode != 0 and "run id '..'" in proc.stderr, (command, proc.stderr[-500:])
    assert not any(tmp_path.iterdir())  # nothing was created anywhere
