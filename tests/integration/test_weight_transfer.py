"""A replica's device plane as vLLM's own weight-transfer engine (rollout_service/vllm_transfer.py): a
real vLLM engine on CPU built with ``weight_transfer_config={"backend": "fp8rl-broadcast"}`` joins a
trainer's group and takes an FP8 update broadcast over Gloo (the code NCCL runs on GPUs), driven through
vLLM's own worker methods. It then computes with exactly what a gRPC refit of the same update gives,
and a plan that does not match the bytes is refused with nothing loaded."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fp8rl.codec import device_planes as planes
from fp8rl.codec.schema import build_weight_set
from rollout_service.config import RolloutConfig
from rollout_service.engine import UnsupportedPlatform, VllmEngine
from rollout_service.vllm_transfer import update_info_dict
from tests.integration.test_compiled_replica import perturbed


def greedy(engine: VllmEngine, prompt: list[int]) -> tuple[list[int], list[float]]:
    from vllm import SamplingParams

    out = engine.llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=0),
        use_tqdm=False,
    )[0].outputs[0]
    return list(out.token_ids), [p[t].logprob for p, t in zip(out.logprobs, out.token_ids, strict=True)]


def same_parameters(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
    )


def test_a_replica_takes_a_broadcast_update_through_vllms_weight_transfer_engine(
    tiny_model_dir_f32: Path, gen: torch.Generator
) -> None:
    config = RolloutConfig(
        model=tiny_model_dir_f32,
        recipe="fp8",
        dtype="float32",
        device="cpu",
        port=0,
        max_model_len=256,
        weight_transfer="fp8rl-broadcast",
    )
    try:
        engine = VllmEngine(config)
    except UnsupportedPlatform as exc:  # (a CUDA build of vLLM)
        pytest.skip(str(exc))
    sender = planes.BroadcastSender.listen(
        "127.0.0.1", world_size=2, backend="gloo", device="cpu", timeout_s=120
    )
    base = load_file(tiny_model_dir_f32 / "model.safetensors")
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    sets = [build_weight_set(s, "fp8-block128", torch.float32) for s in (base, perturbed(base, seed))]
    named = [planes.named_tensors(s.tensors.items()) for s in sets]
    prompt = [3, 14, 15, 9, 2, 6, 5, 3, 5, 8]
    try:
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(
                engine.join_device_plane,
                {
                    k: getattr(sender.init, k)
                    for k in (
                        "master_address",
                        "master_port",
                        "rank_offset",
                        "world_size",
                        "backend",
                        "timeout_s",
                    )
                },
            )
            sender.trainer_init()
            joined.result(timeout=120)
            before = greedy(engine, prompt)

            info = sender.plan(named[1], bucket_bytes=256 << 10)  # (several buckets)
            assert len(planes.plan_buckets(info)) > 2
            loading = pool.submit(engine.load_from_device_plane, update_info_dict(info))
            sender.send_weights(named[1], info)
            loading.result(timeout=120)
            broadcast = engine.named_parameters(), greedy(engine, prompt)
            assert broadcast[1] != before  # (another model: its logprobs moved)

            # The same update by the gRPC path's refit, from the starting weights: the same engine state.
            engine.load_weights(sets[0].tensors)
            assert greedy(engine, prompt) == before
            engine.load_weights(sets[1].tensors)
            assert same_parameters(engine.named_parameters(), broadcast[0])
            assert greedy(engine, prompt) == broadcast[1]

            # A plan whose fingerprint does not match what is broadcast: refused, nothing loaded.
            info0 = sender.plan(named[0], bucket_bytes=256 << 10)
            damaged = replace(info0, fingerprints=(info0.fingerprints[0] ^ 1, *info0.fingerprints[1:]))
            loading = pool.submit(engine.load_from_device_plane, update_info_dict(damaged))
            sender.send_weights(named[0], info0)
            with pytest.raises(Exception, match="did not arrive as sent"):
                loading.result(timeout=120)
            assert same_parameters(engine.named_parameters(), broadcast[0])
            assert greedy(engine, prompt) == broadcast[1]

            # ... and the next update lands: the refusal ended every worker's update session.
            loading = pool.submit(engine.load_from_device_plane, update_info_dict(info0))
            sender.send_weights(named[0], info0)
            loading.result(timeout=120)
            assert greedy(engine, prompt) == before
    finally:
        sender.shutdown()
        engine.llm.collective_rpc("shutdown_weight_transfer_engine")
