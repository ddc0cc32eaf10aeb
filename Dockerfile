# CPU image (the default): vLLM for CPU, the emulated FP8 backends. Same extras and pins as `make setup`
# (both install from pyproject.toml).
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ libnuma1 libgomp1 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY fp8rl fp8rl
COPY rollout_service rollout_service
COPY trainer_service trainer_service
COPY coordinator coordinator
COPY deploy deploy
# torch==2.13.0+cpu (pinned by the cpu extra) comes from the PyTorch CPU index.
RUN pip install --no-cache-dir --extra-index-url "$TORCH_INDEX" ".[cpu]" \
    && pip uninstall -y torchvision torchaudio torchcodec
ENV PYTHONUNBUFFERED=1
