"""A tiny Qwen2-architecture causal LM with a byte-level tokenizer (one token per
ASCII character), for tests and the demo; with ``--moe``, its Qwen3-MoE twin.

Every linear layer has whole 128x128 FP8 blocks: hidden 256, intermediate 512, 4 query heads and 2
key/value heads of dimension 64 (q shard 256 rows, k and v shards 128 rows each). The MoE variant has the
same attention (plus Qwen3's q/k norms) and, in every layer, 4 experts of intermediate 128 (one block),
top-2 with renormalised weights, behind a router (``mlp.gate``) that stays in high precision. Random
initialisation, deterministic for a seed. The directory is in HF format (config.json, model.safetensors,
tokenizer.json), loadable by transformers and vLLM alike.

    python -m fp8rl.tiny --out DIR [--seed 0] [--dtype bfloat16|float32] [--trained] [--moe]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fp8rl.models import MANIFEST, file_digests

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
MOE_ARCHITECTURE: dict[str, Any] = dict(
    ARCHITECTURE,
    head_dim=64,
    # Every layer sparse (no mlp_only_layers), so intermediate_size above sizes no layer. 4 experts of one
    # 128-block hold as many weights as the dense MLP; top-2 runs half of them per token.
    moe_intermediate_size=128,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
"""The MoE variant (``--moe``): Qwen3-MoE, the dense model's attention, every expert GEMM FP8-eligible
(``fp8rl.architectures``: moe_intermediate_size a multiple of 128)."""
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# What the demo needs of the trained base model, on greedy answers to validation pairs: RL has room (the
# hedge hides sums the model knows) on top of a real skill.
SKILL_TARGET = 0.6  # stage 1 trains until this greedy accuracy on training pairs
GREEDY_WINDOW = (0.2, 0.6)
MIN_HEDGE_GAP = 0.2  # known - greedy
VALIDATION_PAIRS = 256


def progress(message: str) -> None:
    """Where the builder reports its stages: stderr, so stdout carries only the written path."""
    print(message, file=sys.stderr, flush=True)


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


# A minimal chat format, so chat prompts are tested for real: "user: 12+34=\nassistant: ". Plain text
# (no special tokens): the byte-level tokenizer spells it out.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


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
        chat_template=CHAT_TEMPLATE,
    )


def build_config(dtype: str = "bfloat16", moe: bool = False):  # -> Qwen2Config | Qwen3MoeConfig
    from transformers import Qwen2Config, Qwen3MoeConfig

    config_class, architecture = (Qwen3MoeConfig, MOE_ARCHITECTURE) if moe else (Qwen2Config, ARCHITECTURE)
    return config_class(
        vocab_size=VOCAB_SIZE,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype=dtype,
        **architecture,
    )


def build_model(seed: int = 0, dtype: str = "bfloat16", moe: bool = False):  # -> a *ForCausalLM
    from transformers import Qwen2ForCausalLM, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = (Qwen3MoeForCausalLM if moe else Qwen2ForCausalLM)(build_config(dtype, moe))
    # transformers wraps Module.to in a decorator that type checkers misread
    return model.to(DTYPES[dtype]).eval()  # type: ignore[arg-type]


def encode(text: str) -> list[int]:
    """Token ids of ``text`` (byte b -> 4 + b), without building a tokenizer."""
    return [len(SPECIAL_TOKENS) + b for b in text.encode()]


def decode(ids: list[int]) -> str:
    """The text of byte tokens ``ids`` (special and padding ids are skipped)."""
    first = len(SPECIAL_TOKENS)
    return bytes(t - first for t in ids if first <= t < first + 256).decode(errors="replace")


@dataclass(frozen=True)
class WarmStart:
    """What a warm start did: steps per stage and where its monitors stood when each stage ended."""

    seed: int
    skill_steps: int
    skill_accuracy: float  # greedy accuracy on the monitor pairs when stage 1 ended
    skill_reached: bool  # stage 2 runs only when stage 1 reached its target
    hedge_steps: int
    hedge_selectivity: float  # min(hedged share of monitor sums >= 100, unhedged share of the rest)


def warm_start(
    model: torch.nn.Module,
    seed: int = 0,
    *,
    lr: float = 5e-4,
    batch: int = 64,
    skill_target: float = SKILL_TARGET,
    skill_budget: int = 2000,
    hedge_target: float = 0.9,
    hedge_budget: int = 400,
    check_every: int = 25,
    say: Callable[[str], None] = progress,
) -> WarmStart:
    """Supervised warm start on the arith task, loss on the answer only, in two stages that each train
    until a greedy check on a fixed monitor set of training pairs says they did their job.

    1. Right answers ("37+48=" -> "85" then newline) until the monitor accuracy reaches ``skill_target``
       (at most ``skill_budget`` steps), so the base model's skill lands in the same place whatever the
       luck of the run.
    2. ``arith.hedged_answer``, a teacher who appends "?" to 70% of sums of 100 or more and 30% of the
       rest, until the greedy answers hedge ``hedge_target`` of the monitor's large sums and leave as
       large a share of the small ones unhedged (at most ``hedge_budget`` steps; early on the model hedges
       everything): it keeps its skill but its greedy validation accuracy is about half of what it knows.
       That format flaw is the room RL has, as with real models; RL also improves the skill.

    AdamW at a constant ``lr`` after a 50-step warm-up: at 2e-3 with a decay, whether stage 1 learned
    addition in its budget hung on the CPU's float kernels. Deterministic for a seed on one machine
    (kernels and thread count decide the float rounding); about a minute on 2 CPU cores.
    """
    import random

    from fp8rl import arith

    torch.manual_seed(seed)
    rng = random.Random(f"warm-start:{seed}")
    hedge_rng = random.Random(f"warm-start-hedge:{seed}")
    monitor = arith.train_pairs(random.Random(f"warm-start-monitor:{seed}"), 64)
    large = [(a, b) for a, b in monitor if a + b >= 100]
    small = [(a, b) for a, b in monitor if a + b < 100]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    step = 0

    def train(
        teacher: Callable[[int, int], str], budget: int, done: Callable[[], float], target: float
    ) -> tuple[int, float]:
        nonlocal step
        first, score = step, 0.0
        while step - first < budget:
            step += 1
            for group in optimizer.param_groups:
                group["lr"] = lr * min(1.0, step / 50)
            pairs = arith.train_pairs(rng, batch)
            answers = [teacher(a, b) + "\n" for a, b in pairs]
            supervised_step(model.train(), optimizer, [arith.prompt(a, b) for a, b in pairs], answers)
            if (step - first) % check_every == 0 or step - first == budget:
                score = done()
                if score >= target:
                    break
        model.eval()
        return step - first, score

    skill_steps, skill = train(
        arith.answer, skill_budget, lambda: greedy_accuracy(model.eval(), monitor), skill_target
    )
    say(f"seed {seed}: stage 1 (skill) {skill_steps} steps, monitor accuracy {skill:.2f}")
    if skill < skill_target:
        return WarmStart(seed, skill_steps, skill, False, 0, 0.0)
    hedge_steps, hedged = train(
        lambda a, b: arith.hedged_answer(a, b, hedge_rng),
        hedge_budget,
        lambda: min(hedge_rate(model.eval(), large), 1 - hedge_rate(model, small)),
        hedge_target,
    )
    say(f"seed {seed}: stage 2 (hedge) {hedge_steps} steps, selectivity {hedged:.2f}")
    return WarmStart(seed, skill_steps, skill, True, hedge_steps, hedged)


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


def hedge_rate(model: torch.nn.Module, pairs: list[tuple[int, int]]) -> float:
    """Fraction of ``pairs`` whose greedy answer ends with the hedge "?"."""
    return sum(greedy_answer(model, a, b).endswith("?") for a, b in pairs) / len(pairs)


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


@dataclass(frozen=True)
class BaseScore:
    """A base model's greedy answers on validation pairs (float32 compute)."""

    greedy: float  # fraction answered exactly right
    known: float  # fraction right once a trailing "?" is stripped

    def misses(self) -> list[str]:
        """The demo's postconditions this score breaks: empty when RL has room on a real skill."""
        low, high = GREEDY_WINDOW
        out = []
        if not low <= self.greedy <= high:
            out.append(f"greedy accuracy {self.greedy:.3f} outside [{low}, {high}]")
        if self.known - self.greedy < MIN_HEDGE_GAP:
            out.append(f"known {self.known:.3f} - greedy {self.greedy:.3f} < {MIN_HEDGE_GAP}")
        return out


def score_base_model(model: torch.nn.Module, count: int = VALIDATION_PAIRS) -> BaseScore:
    """Greedy answers of a float32 copy of ``model`` (its weights as stored) on ``count`` validation pairs."""
    import copy

    from fp8rl import arith

    model = copy.deepcopy(model).float().eval()
    answers = [(greedy_answer(model, a, b), arith.answer(a, b)) for a, b in arith.val_pairs(0, count)]
    return BaseScore(
        greedy=sum(got == right for got, right in answers) / count,
        known=sum(got.removesuffix("?") == right for got, right in answers) / count,
    )


class BaseModelError(RuntimeError):
    """No seed gave a base model that meets the demo's postconditions."""


def train_base_model(
    seed: int = 0,
    dtype: str = "bfloat16",
    attempts: int = 3,
    say: Callable[[str], None] = progress,
    moe: bool = False,
    **warm_start_options: Any,
) -> tuple[Any, WarmStart, BaseScore]:  # (a *ForCausalLM, ...)
    """The warm-started arith model (the MoE variant with ``moe``) for ``seed``, in ``dtype``, checked
    against the postconditions (``BaseScore.misses``) as stored; a seed that misses them gives way to the
    next, up to ``attempts`` seeds, then :class:`BaseModelError` lists what each missed.
    ``warm_start_options`` go to :func:`warm_start`."""
    failures = []
    for candidate in range(seed, seed + attempts):
        model = build_model(candidate, "float32", moe)
        run = warm_start(model, candidate, say=say, **warm_start_options)
        if not run.skill_reached:
            failures.append(f"seed {candidate}: stage 1 ended at monitor accuracy {run.skill_accuracy:.2f}")
            continue
        model = model.to(DTYPES[dtype])
        score = score_base_model(model)
        say(f"seed {candidate}: validation greedy {score.greedy:.3f}, known {score.known:.3f}")
        if not score.misses():
            return model, run, score
        failures.append(f"seed {candidate}: " + "; ".join(score.misses()))
    raise BaseModelError("no base model met the postconditions: " + " | ".join(failures))


def write_tiny_model(
    out: str | Path,
    seed: int = 0,
    dtype: str = "bfloat16",
    trained: bool = False,
    say: Callable[[str], None] = progress,
    moe: bool = False,
) -> Path:
    """Write the tiny model (dense, or the MoE variant with ``moe``; random, or warm-started on arith) and
    its tokenizer to ``out``; a trained
    model gets a ``manifest.json`` (how it was built, its scores, the sha256 of each file)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out)
    if not trained:
        out.mkdir(parents=True, exist_ok=True)
        build_model(seed, dtype, moe).save_pretrained(out)
        build_tokenizer().save_pretrained(out)
        return out
    # The manifest lists every file of the directory: build in a fresh one, then rename it into place.
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} is not empty: a trained model goes into an empty or new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    model, run, score = train_base_model(seed, dtype, say=say, moe=moe)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _save_with_manifest(model, tmp, seed, dtype, run, score, moe)
        tmp.chmod(0o755)  # mkdtemp's 0700 would travel with the rename
        os.replace(tmp, out)  # an empty `out` is replaced whole
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _save_with_manifest(
    model: Any, out: Path, seed: int, dtype: str, run: WarmStart, score: BaseScore, moe: bool = False
) -> None:
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    manifest = {
        "built_by": f"python -m fp8rl.tiny --out DIR --trained --seed {seed} --dtype {dtype}"
        + (" --moe" if moe else ""),
        "warm_start": dataclasses.asdict(run),
        "validation": {"pairs": VALIDATION_PAIRS, **dataclasses.asdict(score)},
        "built_on": {
            "torch": torch.__version__,
            "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(),
        },
        "files": file_digests(out),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fp8rl.tiny", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory to write the model to")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument(
        "--trained", action="store_true", help="warm-start on the arith task (about a minute)"
    )
    parser.add_argument(
        "--moe", action="store_true", help="the Qwen3-MoE variant (4 experts of 128, top-2, every layer)"
    )
    args = parser.parse_args(argv)
    try:
        print(write_tiny_model(args.out, args.seed, args.dtype, args.trained, moe=args.moe))
    except (BaseModelError, FileExistsError) as exc:
        print(f"python -m fp8rl.tiny: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
