"""A tiny Qwen2-architecture causal LM with a byte-level tokenizer (one token per
ASCII character), for tests and the demo.

Every linear layer has whole 128x128 FP8 blocks: hidden 256, intermediate 512, 4 query heads and 2
key/value heads of dimension 64 (q shard 256 rows, k and v shards 128 rows each). Random initialisation,
deterministic for a seed. The directory is in HF format (config.json, model.safetensors, tokenizer.json),
loadable by transformers and vLLM alike.

    python -m fp8rl.tiny --out DIR [--seed 0] [--dtype bfloat16|float32] [--trained]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
VOCAB_SIZE = 320  # 4 special tokens + 256 bytes, padded to a multiple of 64

ARCHITECTURE: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def byte_symbols() -> list[str]:
    """The byte-level BPE alphabet: byte b is shown as one printable unicode character.

    Printable Latin-1 bytes stand for themselves; the others are shifted past 255, so every byte has a
    visible, whitespace-free symbol (the convention of GPT-2 and Qwen2 tokenizers).
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def build_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """One token per byte (one per character for ASCII text): byte b has id ``4 + b``.

    A byte-level BPE without merges, so that transformers (which loads any Qwen2 checkpoint's
    tokenizer as its byte-level ``Qwen2Tokenizer``) and vLLM tokenize exactly as built here.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *byte_symbols()])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.add_special_tokens(SPECIAL_TOKENS)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=ARCHITECTURE["max_position_embeddings"],
    )


def build_config(dtype: str = "bfloat16"):  # -> transformers.Qwen2Config
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype=dtype,
        **ARCHITECTURE,
    )


def build_model(seed: int = 0, dtype: str = "bfloat16"):  # -> transformers.Qwen2ForCausalLM
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(build_config(dtype))
    # transformers wraps Module.to in a decorator that type checkers misread
    return model.to(DTYPES[dtype]).eval()  # type: ignore[arg-type]


def encode(text: str) -> list[int]:
    """Token ids of ``text`` (byte b -> 4 + b), without building a tokenizer."""
    return [len(SPECIAL_TOKENS) + b for b in text.encode()]


def decode(ids: list[int]) -> str:
    """The text of byte tokens ``ids`` (special and padding ids are skipped)."""
    first = len(SPECIAL_TOKENS)
    return bytes(t - first for t in ids if first <= t < first + 256).decode(errors="replace")


def warm_start(
    model: torch.nn.Module,
    seed: int = 0,
    steps: int = 1000,
    batch: int = 64,
    lr: float = 2e-3,
    target_accuracy: float = 0.6,
    hedge_steps: int = 60,
    check_every: int = 50,
) -> int:
    """Supervised warm start on the arith task, loss on the answer only, in two stages.

    1. Right answers ("37+48=" -> "85" then newline) until the greedy accuracy on a fixed monitor set of
       training pairs reaches ``target_accuracy`` (or ``steps`` run out), so the base model's skill lands in
       the same place whatever the luck of the run.
    2. ``hedge_steps`` more on ``arith.hedged_answer``, a teacher who often appends "?": the model keeps its
       skill but hedges most sums of 100 or more, so its greedy validation accuracy is about half of what
       it knows. That format flaw is the room RL has, as with real models; RL also improves the skill.

    About 90 s on 2 CPU cores, deterministic for a seed. Returns the number of steps taken.
    """
    import math
    import random

    from fp8rl import arith

    torch.manual_seed(seed)
    rng = random.Random(f"warm-start:{seed}")
    hedge_rng = random.Random(f"warm-start-hedge:{seed}")
    monitor = arith.train_pairs(random.Random(f"warm-start-monitor:{seed}"), 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def train_step(step: int, teacher: Callable[[int, int], str]) -> None:
        # Linear warm-up, then cosine decay to a tenth of the peak (held there past ``steps``).
        decay = 0.1 + 0.45 * (1 + math.cos(math.pi * min(step, steps) / steps))
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, step / 50) * decay
        pairs = arith.train_pairs(rng, batch)
        supervised_step(
            model.train(),
            optimizer,
            [arith.prompt(a, b) for a, b in pairs],
            [teacher(a, b) + "\n" for a, b in pairs],
        )

    step = 0
    while step < steps:
        step += 1
        train_step(step, arith.answer)
        if step % check_every == 0 and greedy_accuracy(model.eval(), monitor) >= target_accuracy:
            break
    for _ in range(hedge_steps):
        step += 1
        train_step(step, lambda a, b: arith.hedged_answer(a, b, hedge_rng))
    model.eval()
    return step


def supervised_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, prompts: list[str], answers: list[str]
) -> None:
    """One optimizer step on the mean cross-entropy of the ``answers`` tokens following their ``prompts``."""
    encoded = [(encode(p), encode(a)) for p, a in zip(prompts, answers, strict=True)]
    length = max(len(p) + len(a) for p, a in encoded)
    ids = torch.full((len(encoded), length), PAD_ID)
    weight = torch.zeros(len(encoded), length)
    for i, (p, a) in enumerate(encoded):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        weight[i, len(p) : len(p) + len(a)] = 1
    logits = model(input_ids=ids).logits[:, :-1]
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    loss = (losses * weight[:, 1:]).sum() / weight[:, 1:].sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def greedy_accuracy(model: torch.nn.Module, pairs: list[tuple[int, int]]) -> float:
    """Fraction of ``pairs`` whose greedy answer is exactly the right sum."""
    from fp8rl import arith

    return sum(greedy_answer(model, a, b) == arith.answer(a, b) for a, b in pairs) / len(pairs)


@torch.no_grad()
def greedy_answer(model: torch.nn.Module, a: int, b: int, max_tokens: int = 5) -> str:
    """The model's greedy completion of "a+b=", up to a newline or end of sequence."""
    from fp8rl import arith

    ids = torch.tensor([encode(arith.prompt(a, b))])
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(model(input_ids=ids).logits[0, -1].argmax())
        if token in (encode("\n")[0], EOS_ID):
            break
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return decode(out)


def write_tiny_model(out: str | Path, seed: int = 0, dtype: str = "bfloat16", trained: bool = False) -> Path:
    """Write the tiny model (random, or warm-started on arith) and its tokenizer to ``out``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(seed, "float32" if trained else dtype)
    if trained:
        warm_start(model, seed)
        model = model.to(DTYPES[dtype])
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fp8rl.tiny", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory to write the model to")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--trained", action="store_true", help="warm-start on the arith task (about 90 s)")
    args = parser.parse_args(argv)
    print(write_tiny_model(args.out, args.seed, args.dtype, args.trained))


if __name__ == "__main__":
    main()
