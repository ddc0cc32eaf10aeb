#!/usr/bin/env bash
# The proof on a GPU host (one Hopper GPU, the project installed with the gpu extra or in the GPU images):
#   python -m venv .venv && .venv/bin/pip install -e '.[gpu,dev]' && scripts/gpu_checks.sh
# Installs nothing. Prints the versions, runs the tests marked `gpu`, then scripts/gpu_checks.py (one
# PASS/FAIL/SKIP line per check). Exits non-zero if anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" - <<'PYEOF' || exit 1
import importlib.metadata as md, torch
assert torch.cuda.is_available(), "no CUDA device"
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()} "
      f"(compute capability {'.'.join(map(str, torch.cuda.get_device_capability()))}), "
      f"vLLM {version('vllm')}, Transformer Engine {version('transformer-engine')}")
PYEOF
"$PY" -m pytest -m gpu -v "$@"; tests=$?
"$PY" scripts/gpu_checks.py; checks=$?
exit $(( tests != 0 || checks != 0 ))
