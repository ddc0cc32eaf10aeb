"""Weight-sync cost for a model-shaped WeightSet: keyframe vs delta bytes and codec throughput.

The tensor shapes are those of Qwen2-0.5B (24 layers, hidden 896, GQA 14/2 heads, MLP 4864, vocab
151936, tied embeddings), random float32 master weights. One "optimizer step" moves every master weight
by ``relative * |w| * N(0, 1)`` (Adam-like per-element steps of 1e-4 ... 1e-6 of the weight), and the
bf16 / FP8 sets are rebuilt from the new master. Printed, all measured in this one run:

* keyframe and delta wire bytes as a fraction of the bf16 full weights,
* density (fraction of the set's tensor bytes that changed),
* encode and decode throughput (set bytes / s) next to a plain memcpy of the same bytes.

    python bench/weight_sync.py [--layers 24] [--seed 0]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from fp8rl.weights import (
    WEIGHT_FORMATS,
    WeightSet,
    build_weight_set,
    decode_update,
    encode_delta,
    encode_keyframe,
)

HIDDEN, MLP, KV_ROWS, VOCAB = 896, 4864, 128, 151936


def qwen2_05b_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            p + "self_attn.q_proj.bias": (HIDDEN,),
            p + "self_attn.k_proj.weight": (KV_ROWS, HIDDEN),
            p + "self_attn.k_proj.bias": (KV_ROWS,),
            p + "self_attn.v_proj.weight": (KV_ROWS, HIDDEN),
            p + "self_attn.v_proj.bias": (KV_ROWS,),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (MLP, HIDDEN),
            p + "mlp.up_proj.weight": (MLP, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, MLP),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        }
    return shapes


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def memcpy_seconds(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages once so the timing is of copying, not of page faults
    _, seconds = timed(lambda: dst.copy_(src))
    return seconds


def fresh(ws: WeightSet) -> WeightSet:
    """The same tensors without cached digests, so hashing is timed as part of encoding."""
    return WeightSet(ws.format, ws.tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="transformer layers (24 = Qwen2-0.5B)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    shapes = qwen2_05b_shapes(args.layers)
    master = {n: torch.randn(s) * (0.02 if len(s) == 2 else 1.0) for n, s in shapes.items()}
    bf16_bytes = sum(t.numel() * 2 for t in master.values())
    print(f"model: Qwen2-0.5B shapes, {args.layers} layers, {bf16_bytes / 2**30:.3f} GiB in bf16")
    print(
        f"{'format':13} {'rel step':>8} {'key/bf16':>9} {'delta/bf16':>10} {'density':>8} "
        f"{'enc GB/s':>9} {'dec GB/s':>9} {'memcpy GB/s':>11} {'enc/memcpy':>10} {'dec/memcpy':>10}"
    )
    for fmt in WEIGHT_FORMATS:
        base = build_weight_set(master, fmt)
        keyframe, _ = timed(lambda: encode_keyframe(fresh(base), version=0))  # noqa: B023
        held = decode_update(keyframe.blob).weights
        for relative in (1e-4, 1e-5, 1e-6):
            stepped = {n: w + relative * w.abs() * torch.randn(w.shape) for n, w in master.items()}
            new = build_weight_set(stepped, fmt)
            base.digest, held.digest  # noqa: B018 — both sides already know their bases' digests
            delta, enc_s = timed(lambda: encode_delta(new, base, version=1, base_version=0))  # noqa: B023
            _, dec_s = timed(lambda: decode_update(delta.blob, held, held_version=0))  # noqa: B023
            copy_s = memcpy_seconds(new.nbytes)
            gbps = lambda s: new.nbytes / s / 1e9  # noqa: E731, B023
            print(
                f"{fmt:13} {relative:8.0e} {keyframe.wire_bytes / bf16_bytes:9.3f} "
                f"{delta.wire_bytes / bf16_bytes:10.4f} {delta.density:8.4f} {gbps(enc_s):9.2f} "
                f"{gbps(dec_s):9.2f} {gbps(copy_s):11.2f} {copy_s / enc_s:10.3f} {copy_s / dec_s:10.3f}"
            )


if __name__ == "__main__":
    main()
