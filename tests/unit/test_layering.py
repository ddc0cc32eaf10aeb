"""The import contracts of pyproject.toml ([tool.importlinter]; docs/architecture.md explains the layers):
no upward import, no import between the two services, no cycle among any package's children. Reads the
source only (nothing is imported), in about a second."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LINT = (
    "import sys; from importlinter.cli import lint_imports; "
    "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True))"
)


def test_import_contracts_hold() -> None:
    # A child process whose path starts at this checkout, so the graph is of these files (not of an
    # editable install elsewhere) and bench/ and scripts/ resolve as namespace packages.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", LINT, str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"import contracts broken:\n{proc.stdout}\n{proc.stderr}"
    assert "0 broken" in proc.stdout, proc.stdout
