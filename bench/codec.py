"""Weight-sync cost for a model-shaped WeightSet: keyframe vs delta bytes and codec throughput.

The tensor shapes are those of Qwen2-0.5B (24 layers, hidden 896, GQA 14/2 heads, MLP 4864, vocab
151936, tied embeddings), random float32 master weights. One "optimizer step" moves every master weight
by ``relative * |w| * N(0, 1)`` (Adam-like per-element steps of 1e-4 ... 1e-6 of the weight), and the
bf16 / FP8 sets are rebuilt from the new master. Printed, all measured in this one run:

* keyframe and delta wire bytes as a fraction of the bf16 full weights, and density (fraction of the
  set's tensor bytes that changed);
* encode and decode throughput (set bytes / s) next to a copy of the same bytes (warm pages), for
  keyframes and deltas; decoding starts from a received (writable) buffer and a held set of its own
  (a delta rewrites the held set in place), as the replica's does;
* where one core's time goes: each stage of the codec timed alone over the whole set;
* with ``--trajectory RUN_DIR``: the real per-step delta bytes and density of a coordinator run, from
  its per-step checkpoints, split into bf16 tensors, FP8 codes and FP8 scales.

    python bench/codec.py [--layers 24] [--seed 0] [--trajectory runs/<id>]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard

from fp8rl.codec.layout import planes, word_of
from fp8rl.codec.schema import SCALE_SUFFIX, build_weight_set
from fp8rl.codec.testing import decode_update, encode_delta, encode_keyframe, to_bytes
from fp8rl.codec.weight_set import WeightSet, raw_bytes
from fp8rl.recipes import WEIGHT_FORMATS

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


def llama_8b_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """Llama-3.1-8B's tensors (hidden 4096, GQA 32/8 heads of 128, MLP 14336, vocab 128256, untied), for
    ``layers`` of its 32 decoder layers."""
    hidden, mlp, kv_rows, vocab = 4096, 14336, 1024, 128256
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv_rows, hidden),
            p + "self_attn.v_proj.weight": (kv_rows, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (mlp, hidden),
            p + "mlp.up_proj.weight": (mlp, hidden),
            p + "mlp.down_proj.weight": (hidden, mlp),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def timed(fn: Callable[[], Any], repeats: int = 1) -> tuple[Any, float]:
    """The result of ``fn`` and its best time over ``repeats`` calls."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return result, best


def memcpy_seconds(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages once so the timing is of copying, not of page faults
    return timed(lambda: dst.copy_(src), 3)[1]


def fresh(ws: WeightSet) -> WeightSet:
    """The same tensors without cached digests, so hashing is timed as part of encoding (as in the
    trainer, which builds each version's set anew)."""
    return WeightSet(ws.format, ws.tensors)


def received(blob: bytes) -> bytearray:
    return bytearray(blob)  # what the replica's reassembler hands to the decoder


def held_copy(ws: WeightSet) -> WeightSet:
    """A copy of the held set with its digests known, as the replica holds it: a delta is applied to the
    held set in place, so each timed decode gets its own (copied outside the timer)."""
    tensors = {n: t.clone() for n, t in ws.tensors.items()}
    return WeightSet.verified(ws.format, tensors, ws.tensor_digests, owned=True)


def timed_decode(buffer: bytearray, held: WeightSet, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        target = held_copy(held)
        start = time.perf_counter()
        decode_update(buffer, target, held_version=0)
        best = min(best, time.perf_counter() - start)
    return best


def stage_shares(new: WeightSet, base: WeightSet) -> str:
    """One core's time per stage of a delta's encode and decode, each stage run alone over the whole set
    (whole tensors rather than cache-sized blocks), as shares of their sum."""
    pairs = [(words(raw_bytes(t)), words(raw_bytes(base.tensors[n]))) for n, t in new.tensors.items()]
    pairs = [(a, b) for a, b in pairs if a.size]
    found = [np.flatnonzero(a != b) for a, b in pairs]
    xors = [a[i] ^ b[i] for (a, b), i in zip(pairs, found, strict=True)]
    streams = [
        np.concatenate([planes(np.diff(i, prepend=0).astype("<u4")), planes(x)])
        for i, x in zip(found, xors, strict=True)
    ]
    compressor = zstandard.ZstdCompressor(level=1)
    packed = [compressor.compress(x.data) for x in streams]
    decompressor = zstandard.ZstdDecompressor()
    seconds = {
        "hash": timed(lambda: [xxhash.xxh3_128_digest(a.data) for a, _ in pairs])[1],
        "find changes": timed(lambda: [np.flatnonzero(a != b) for a, b in pairs])[1],
        "gather": timed(lambda: [a[i] ^ b[i] for (a, b), i in zip(pairs, found, strict=True)])[1],
        "compress": timed(lambda: [compressor.compress(x.data) for x in streams])[1],
        "decompress (dec)": timed(lambda: [decompressor.decompress(p) for p in packed])[1],
        "scatter (dec)": timed(lambda: scatter_all(pairs, found, xors))[1],
        "hash (dec)": timed(lambda: [xxhash.xxh3_128_digest(b.data) for _, b in pairs])[1],
    }
    scatter_all(pairs, found, xors)  # XOR again: the base is the base again
    total = sum(seconds.values())
    return "  ".join(f"{k} {v / total:4.0%}" for k, v in seconds.items())


def words(a: np.ndarray) -> np.ndarray:
    return a.view(word_of(a.size))  # the words the codec compares


def scatter_all(
    pairs: list[tuple[np.ndarray, np.ndarray]], found: list[np.ndarray], xors: list[np.ndarray]
) -> None:
    for (_, base), index, xor in zip(pairs, found, xors, strict=True):
        base[index] ^= xor


def codec(master: dict[str, torch.Tensor], bf16_bytes: int) -> None:
    print(
        f"{'format':13} {'update':>8} {'rel step':>8} {'bytes/bf16':>10} {'density':>8} "
        f"{'enc GB/s':>9} {'dec GB/s':>9} {'copy GB/s':>9} {'enc/copy':>8} {'dec/copy':>8}"
    )
    for fmt in WEIGHT_FORMATS:
        base = build_weight_set(master, fmt)
        copy_s = memcpy_seconds(base.nbytes)

        def row(kind: str, relative: float | None, update: Any, enc_s: float, dec_s: float) -> None:
            gbps = [base.nbytes / s / 1e9 for s in (enc_s, dec_s, copy_s)]  # noqa: B023
            step = f"{relative:8.0e}" if relative else f"{'-':>8}"
            print(
                f"{fmt:13} {kind:>8} {step} {update.wire_bytes / bf16_bytes:10.4f} {update.density:8.4f} "  # noqa: B023
                f"{gbps[0]:9.2f} {gbps[1]:9.2f} {gbps[2]:9.2f} {copy_s / enc_s:8.3f} {copy_s / dec_s:8.3f}"  # noqa: B023
            )

        keyframe, enc_s = timed(lambda: encode_keyframe(fresh(base), version=0), 3)  # noqa: B023
        buffer = received(to_bytes(keyframe))  # decoded in place: its tensors are views of this buffer
        held, dec_s = timed(lambda: decode_update(buffer).weights, 3)  # noqa: B023
        row("keyframe", None, keyframe, enc_s, dec_s)
        for relative in (1e-4, 1e-5, 1e-6):
            stepped = {n: w + relative * w.abs() * torch.randn(w.shape) for n, w in master.items()}
            new = build_weight_set(stepped, fmt)
            base.digest, held.digest  # noqa: B018 — both sides already know their bases' digests
            delta, enc_s = timed(lambda: encode_delta(fresh(new), base, version=1, base_version=0), 3)  # noqa: B023
            dec_s = timed_decode(received(to_bytes(delta)), held)
            row("delta", relative, delta, enc_s, dec_s)
            if relative == 1e-4:
                shares = stage_shares(new, base)
        print(f"{fmt:13} one core, each stage alone, 1e-4 delta: {shares}")


def trajectory(run_dir: Path) -> None:
    """Per-step delta bytes and density of a real run, from its per-step master-weight checkpoints."""
    from safetensors.torch import load_file

    steps = sorted((run_dir / "checkpoints").glob("step-*/model.safetensors"))
    if len(steps) < 2:
        raise SystemExit(f"{run_dir}: needs at least two step checkpoints (checkpoint_every=1)")
    print(f"\nreal trajectory: {run_dir} ({len(steps)} checkpoints)")
    print(
        f"{'step':>5} {'format':13} {'delta B':>9} {'density':>8} "
        f"{'bf16 part':>10} {'fp8 codes':>10} {'fp8 scales':>10}"
    )
    previous = load_file(steps[0])
    for path in steps[1:]:
        current = load_file(path)
        for fmt in WEIGHT_FORMATS:
            old, new = build_weight_set(previous, fmt), build_weight_set(current, fmt)
            delta = encode_delta(new, old, 1, 0)
            parts = {"bf16": [0, 0], "codes": [0, 0], "scales": [0, 0]}
            for name, t in new.tensors.items():
                part = (
                    "scales"
                    if name.endswith(SCALE_SUFFIX)
                    else "codes"
                    if t.dtype == torch.float8_e4m3fn
                    else "bf16"
                )
                changed = int(np.count_nonzero(raw_bytes(t) != raw_bytes(old.tensors[name])))
                parts[part][0] += changed
                parts[part][1] += t.numel() * t.element_size()
            shown = [f"{c / n:10.4f}" if n else f"{'-':>10}" for c, n in parts.values()]
            step = path.parent.name.removeprefix("step-").lstrip("0") or "0"
            print(f"{step:>5} {fmt:13} {delta.wire_bytes:9,d} {delta.density:8.4f} {' '.join(shown)}")
        previous = current


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="transformer layers (24 = Qwen2-0.5B)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trajectory", type=Path, help="a coordinator run directory with step checkpoints")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    shapes = qwen2_05b_shapes(args.layers)
    master = {n: torch.randn(s) * (0.02 if len(s) == 2 else 1.0) for n, s in shapes.items()}
    bf16_bytes = sum(t.numel() * 2 for t in master.values())
    print(
        f"model: Qwen2-0.5B shapes, {args.layers} layers, {bf16_bytes / 2**30:.3f} GiB in bf16; "
        f"{torch.get_num_threads()} threads"
    )
    codec(master, bf16_bytes)
    if args.trajectory:
        trajectory(args.trajectory)


if __name__ == "__main__":
    main()
