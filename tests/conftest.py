from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run scripts/gpu_checks.sh on a CUDA host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen() -> torch.Generator:
    """A generator with a fresh seed each run; the seed is printed so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fp8rl.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fp8rl.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny32") / "model", seed=0, dtype="float32")
