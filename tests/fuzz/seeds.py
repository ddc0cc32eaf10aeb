"""Writes the seed corpus, ``tests/fuzz/corpus/<target>/seed-*`` (committed: run this again when a wire
format changes, and commit what changed): ``python -m tests.fuzz.seeds``. Regression inputs
(``regress-*``, each a crash once found) are kept as they are."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import torch

from fp8rl.codec.encode import EncodedUpdate, delta_parts, keyframe_parts
from fp8rl.codec.stream import parts_to_chunks
from fp8rl.codec.weight_set import WeightSet
from fp8rl.v1 import common_pb2, rollout_pb2, trainer_pb2
from tests.fuzz.targets import CORPUS, HELD_FORMAT, HELD_VERSION, PART_SEPARATOR, SIGNER, held_tensors


def new_tensors() -> dict[str, torch.Tensor]:
    """The held set one step on: a word changed (a sparse chunk), a tensor changed throughout (a dense
    one), one unchanged, one removed, one new."""
    new = {k: v.clone() for k, v in held_tensors().items()}
    new["layers.0.mlp.weight"].view(torch.uint8)[0, 3] ^= 0x11
    new["layers.1.mlp.weight"] += 1.0
    new["layers.0.norm.weight"][::7] *= 2
    del new["positions"]
    new["new.bias"] = torch.linspace(-1, 1, 24)
    return new


def encoded_parts(part_bytes: int) -> dict[str, list[EncodedUpdate]]:
    """A keyframe of the held set and a delta from it to :func:`new_tensors`, in parts."""
    held = WeightSet(HELD_FORMAT, held_tensors())
    new = WeightSet(HELD_FORMAT, new_tensors())
    return {
        "keyframe": list(keyframe_parts(held, HELD_VERSION, "fp8", part_bytes=part_bytes)),
        "delta": list(delta_parts(new, held, HELD_VERSION + 1, HELD_VERSION, "fp8", part_bytes)),
    }


def codec_decode() -> dict[str, bytes]:
    seeds = {}
    for part_bytes, size in ((sys.maxsize, "1part"), (400, "parts")):
        for kind, parts in encoded_parts(part_bytes).items():
            held = 4 if kind == "delta" else 0
            for reseal in (0, 2):
                mode = held | reseal | (8 if kind == "keyframe" and reseal else 0)
                blobs = [b"".join(p.segments) for p in parts]
                seeds[f"{kind}-{size}-reseal{reseal}"] = bytes([mode]) + PART_SEPARATOR.join(blobs)
    return seeds


def codec_stream() -> dict[str, bytes]:
    seeds = {}
    for kind, parts in encoded_parts(400).items():
        held = 4 if kind == "delta" else 0
        for signed in (0, 1):
            chunks = parts_to_chunks(parts, epoch=2, signer=SIGNER if signed else None, chunk_bytes=300)
            stream = b"".join(
                len(c.SerializeToString()).to_bytes(2, "little") + c.SerializeToString() for c in chunks
            )
            seeds[f"{kind}-signed{signed}"] = bytes([held | signed]) + stream
            seeds[f"{kind}-signed{signed}-fixed"] = bytes([held | signed | 2]) + stream
    return seeds


def sampling(**fields: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**fields)  # type: ignore[arg-type]


def generate() -> dict[str, bytes]:
    P = rollout_pb2.Prompt
    requests = {
        "text": rollout_pb2.GenerateRequest(prompts=[P(text="3+4=")]),
        "tokens-n": rollout_pb2.GenerateRequest(
            prompts=[P(id="a", token_ids={"ids": [5, 6, 7]}), P(id="b", text="12*3=")],
            n=3,
            sampling=sampling(temperature=0.7, top_p=0.9, top_k=20, max_tokens=8, seed=11, stop=["\n"]),
            weight_version=4,
            request_id="r1",
        ),
        "chat": rollout_pb2.GenerateRequest(
            prompts=[
                P(
                    chat=rollout_pb2.ChatMessages(
                        messages=[
                            rollout_pb2.ChatMessage(role="system", content="add"),
                            rollout_pb2.ChatMessage(role="user", content="2+2="),
                        ]
                    )
                )
            ],
            sampling=sampling(temperature=0.0, max_tokens=500),
            weight_version=-1,
        ),
    }
    return {name: r.SerializeToString() for name, r in requests.items()}


def train_samples() -> dict[str, bytes]:
    def sample(prompt: list[int], completion: list[int], **extra: object) -> trainer_pb2.Sample:
        return trainer_pb2.Sample(
            prompt_token_ids=prompt,
            completion_token_ids=completion,
            gen_logprobs=[-0.25] * len(completion),
            reward=1.0,
            group_id="g0",
            **extra,  # type: ignore[arg-type]
        )

    positions = 3 + 4 - 1
    ids = np.arange(positions * 3 * 2).reshape(positions, 3, 2) % 8
    routed = common_pb2.RoutedExperts(
        moe_layers=3, top_k=2, id_bytes=1, expert_ids=ids.astype("<u1").tobytes()
    )
    wide = common_pb2.RoutedExperts(
        moe_layers=3, top_k=2, id_bytes=2, expert_ids=(ids * 37).astype("<u2").tobytes()
    )
    requests = {
        "dense": (2, [sample([5, 6, 7], [8, 9]), sample([5, 6], [10], advantage=-0.5)]),
        "mean-rewards": (3, [sample([4, 4], [4, 4, 4])]),
        "routed": (0, [sample([5, 6, 7], [8, 9, 10, 11], routed_experts=routed)]),
        "routed-wide": (4, [sample([5, 6, 7], [8, 9, 10, 11], routed_experts=wide)]),
    }
    return {
        name: bytes([mode])
        + trainer_pb2.TrainStepRequest(
            run_id="run", step=0, samples=batch, sampling=sampling(temperature=1.0, top_k=5)
        ).SerializeToString()
        for name, (mode, batch) in requests.items()
    }


def openai() -> dict[str, bytes]:
    bodies = {
        "completion": (0, {"model": "tiny", "prompt": "3+4=", "max_tokens": 4}),
        "completion-batch": (
            0,
            {
                "model": "tiny",
                "prompt": [[5, 6, 7], [8, 9]],
                "n": 2,
                "temperature": 0.5,
                "top_p": 0.9,
                "top_k": 3,
                "seed": 3,
                "stop": ["\n", "="],
                "logprobs": 0,
                "weight_version": -1,
            },
        ),
        "completion-stream": (
            2,
            {
                "model": "tiny",
                "prompt": ["a", "b"],
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
        "chat": (
            1,
            {
                "model": "tiny",
                "messages": [
                    {"role": "system", "content": "add"},
                    {"role": "user", "content": [{"type": "text", "text": "2+2="}]},
                ],
                "max_completion_tokens": 5,
                "logprobs": True,
            },
        ),
        "chat-stream": (
            1,
            {"model": "tiny", "messages": [{"role": "user", "content": "1+1="}], "stream": True, "n": 2},
        ),
    }
    return {
        name: bytes([mode]) + (b"-1\n" if mode & 2 else b"") + json.dumps(body).encode()
        for name, (mode, body) in bodies.items()
    }


def main() -> None:
    for target, make in {
        "codec_decode": codec_decode,
        "codec_stream": codec_stream,
        "generate": generate,
        "train_samples": train_samples,
        "openai": openai,
    }.items():
        folder = CORPUS / target
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("seed-*"):
            old.unlink()
        for name, data in make().items():
            (folder / f"seed-{name}").write_bytes(data)
        print(
            f"{target}: {len(list(folder.glob('seed-*')))} seeds, {sum(1 for _ in folder.iterdir())} in all"
        )
    shutil.rmtree(CORPUS / "__pycache__", ignore_errors=True)


if __name__ == "__main__":
    main()
