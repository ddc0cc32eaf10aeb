# CPU image (the default): vLLM for CPU, the emulated FP8 backends. Same extras and pins as `make setup`
# (both install from pyproject.toml).
#   docker build -t fp8rl:cpu .
# Any Debian-like base with python3 (3.10+) and its venv module builds it: the tests build on a Debian
# root filesystem of their own (tests/containers.py), as a host without Docker Hub must.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}
# torch==2.13.0+cpu (pinned by the cpu extra) comes from the PyTorch CPU index; empty: pip's own sources.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# A build behind a private package index names a pip configuration file, mounted into the build (the
# tests: `podman build -v DIR:/pip-host:ro --build-arg PIP_CONFIG_FILE=/pip-host/pip.conf`). Unset: pip's
# defaults.
ARG PIP_CONFIG_FILE
# A C++ compiler and Python's headers: torch's inductor compiles kernels at run time (the replicas' vLLM).
# python:3.11-slim has its own headers; a Debian base gets Debian's.
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ libnuma1 libgomp1 \
    && { python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
         || apt-get install -y --no-install-recommends python3-dev; } \
    && rm -rf /var/lib/apt/lists/*
# A venv: Debian's own Python refuses system-wide installs (PEP 668), and the image's commands find
# python, pip and the entry points on PATH either way.
RUN python3 -m venv /opt/fp8rl
ENV PATH=/opt/fp8rl/bin:$PATH VIRTUAL_ENV=/opt/fp8rl PYTHONUNBUFFERED=1
WORKDIR /app
# The dependencies first, from pyproject.toml alone (an empty package and README stand in for the
# source), so that an edit of the source or the docs rebuilds only the last layer.
COPY pyproject.toml ./
RUN mkdir fp8rl && touch fp8rl/__init__.py README.md \
    && pip install --no-cache-dir ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} ".[cpu]" \
    && pip uninstall -y torchvision torchaudio torchcodec \
    && pip uninstall -y fp8rl && rm -rf fp8rl README.md build *.egg-info
COPY README.md ./
COPY fp8rl fp8rl
COPY rollout_service rollout_service
COPY trainer_service trainer_service
COPY coordinator coordinator
COPY deploy deploy
RUN pip install --no-cache-dir --no-deps . && rm -rf build *.egg-info
# Large mallocs in huge pages (glibc reads this at a process's start; torch's tensors: each entry point
# sets THP_MEM_ALLOC_ENABLE, fp8rl/devices.py).
ENV GLIBC_TUNABLES=glibc.malloc.hugetlb=1
