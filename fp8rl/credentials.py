"""Secrets out of command lines and files: a Redis password comes from the environment (REDIS_PASSWORD)
or from a file (REDIS_PASSWORD_FILE, e.g. a compose secret), never from an argument that `ps` shows, and
URLs are written to disk and logs without it; private files are written 0600 from their first byte."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

PASSWORD_ENV, PASSWORD_FILE_ENV = "REDIS_PASSWORD", "REDIS_PASSWORD_FILE"
RUN_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
"""A run id: letters, digits, `_`, `.`, `-`, not starting with `.` or `-` (no `.`, `..`, separators)."""


PASSWORD_IN_URL = (
    "{prog}: warning: the Redis URL carries a password, which process listings (ps) show to every user; "
    "drop it from the URL and set REDIS_PASSWORD_FILE or REDIS_PASSWORD"
)


def check_run_id(run_id: str) -> str:
    if not RUN_ID.match(run_id):
        raise ValueError(
            f"run id {run_id!r}: use letters, digits, '_', '.', '-' (at most 128 characters, not starting "
            "with '.' or '-')"
        )
    return run_id


def redis_url_with_password(url: str, environ: Mapping[str, str] = os.environ) -> str:
    """``url`` with the password from REDIS_PASSWORD_FILE or REDIS_PASSWORD when it carries none."""
    parts = urlsplit(url)
    if parts.password is not None:
        return url
    password = None
    if environ.get(PASSWORD_FILE_ENV):
        password = Path(environ[PASSWORD_FILE_ENV]).read_text().strip()
    elif environ.get(PASSWORD_ENV):
        password = environ[PASSWORD_ENV]
    if not password:
        return url
    return _with_userinfo(url, f"{quote(parts.username or '', safe='')}:{quote(password, safe='')}")


def redacted(url: str) -> str:
    """``url`` without its password (for files, logs and metrics; the password comes back from the
    environment or a file, :func:`redis_url_with_password`)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return _with_userinfo(url, quote(parts.username, safe="") if parts.username else "")


def _with_userinfo(url: str, userinfo: str) -> str:
    """``url`` with its user-info part (before ``@``) replaced; host and port kept as written (an IPv6
    host keeps its brackets)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{host}" if userinfo else host))


def has_password(url: str | None) -> bool:
    return bool(url) and urlsplit(str(url)).password is not None


def redis_config_string(value: str) -> str:
    """``value`` as one quoted argument of a Redis configuration line: a password with a space, `"` or
    `\\` in it stays one argument (Redis reads `\\`, `\\"`, `\\n`, `\\r` inside double quotes)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


def new_password() -> str:
    return secrets.token_urlsafe(24)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to a file only its owner can read (created 0600, never world-readable meanwhile)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def write_private_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (0600) as one step that a crash cannot tear: written to a temporary
    file beside it, flushed to disk, renamed over it, and the rename flushed too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
