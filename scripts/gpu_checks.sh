#!/usr/bin/env bash
# The full proof, for a CUDA host with the project's GPU images (Dockerfile.rollout-gpu: vLLM;
# Dockerfile.trainer-gpu: Transformer Engine), run inside one of them from the repository root:
#   scripts/gpu_checks.sh                     # in either image
#   FP8RL_REQUIRE_TE=1 scripts/gpu_checks.sh  # in the trainer image: a missing or broken TE fails
# A bare host with torch alone runs scripts/gpu_proof.py instead (docs/gpu.md). Installs nothing: not
# `pip install -e '.[gpu]'` either (vLLM pins its own torch; Transformer Engine has no PyTorch wheel on
# PyPI and builds from source against the torch present), which is why the supported route is the images.
# Prints the versions, runs the tests marked `gpu`, then scripts/gpu_checks.py (one PASS/FAIL/SKIP line
# per check). Exits non-zero if anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
"$PY" - <<'PYEOF' || exit 1
import importlib.metadata as md, os, torch
assert torch.cuda.is_available(), "no CUDA device"
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"
te = version("transformer-engine")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()} "
      f"(compute capability {'.'.join(map(str, torch.cuda.get_device_capability()))}), "
      f"vLLM {version('vllm')}, Transformer Engine {te}")
if os.environ.get("FP8RL_REQUIRE_TE") == "1":
    import transformer_engine.pytorch  # a broken install fails here, before anything skips over it
PYEOF
"$PY" -m pytest -m gpu -v "$@"; tests=$?
"$PY" scripts/gpu_checks.py; checks=$?
exit $(( tests != 0 || checks != 0 ))
