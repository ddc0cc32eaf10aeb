"""What the GPU proof's host can import: Python, torch and a few packages, without pydantic, zstandard,
vLLM, Transformer Engine (nor, to be safe, grpc and yaml). fp8rl.quant and the emulated FP8 linear must
import there: each is checked in a fresh interpreter where those packages cannot be imported at all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ABSENT = ("pydantic", "zstandard", "vllm", "transformer_engine", "transformer_engine_torch", "grpc", "yaml")

# A meta-path finder that refuses the absent packages (as on the bare host), then the imports under test,
# then the check that none of them was reached some other way.
PRELUDE = f"""
import importlib.abc, sys
ABSENT = {ABSENT!r}
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ImportError(f"{{name}} is not installed on the bare GPU host")
        return None
sys.meta_path.insert(0, Absent())
"""
EPILOGUE = """
reached = sorted({m.split(".")[0] for m in sys.modules} & set(ABSENT))
assert not reached, reached
print("ok")
"""


def run_torch_only(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter at the repository root, the absent packages refused."""
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + code + EPILOGUE],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


SCRIPT = """
import runpy, sys
sys.argv = {argv!r}
try:
    runpy.run_path({script!r}, run_name="__main__")
except SystemExit as done:
    assert done.code == 0, done.code
"""


def script_lines(script: str, *args: str) -> list[str]:
    """What ``script`` (a path from the repository root) prints when run with ``args`` under
    :func:`run_torch_only`; it must exit 0 without reaching an absent package."""
    done = run_torch_only(SCRIPT.format(argv=[script, *args], script=script), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "ok"  # (none of the absent packages was reached)
    return lines[:-1]


@pytest.mark.parametrize(
    "module",
    [
        "fp8rl.quant",
        "fp8rl.accumulation",
        "trainer_service.fp8_linear",
        "tests.vllm_reference",
        "fp8rl.codec.device_planes",
    ],
)
def test_imports_with_torch_alone(module: str) -> None:
    done = run_torch_only(f"import {module}\n")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_refusal_works() -> None:
    """The check itself: a module that needs pydantic fails to import under it."""
    done = run_torch_only("import fp8rl.recipes\n")
    assert done.returncode != 0 and "pydantic is not installed" in done.stderr
