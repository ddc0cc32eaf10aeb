#!/usr/bin/env bash
# Run the checks that need CUDA (tests marked `gpu`) on a CUDA host with the project installed, e.g.
#   python -m venv .venv && .venv/bin/pip install -e '.[gpu,dev]' && scripts/gpu_checks.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name())'
exec "$PY" -m pytest -m gpu -v "$@"
