"""The venv has what the services need, and the tiny model loads the same in transformers and vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import load_file

from fp8rl.tiny import decode, encode


def test_venv_imports_vllm_transformers_and_fp8rl() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import vllm, transformers, fp8rl; print(vllm.__version__, transformers.__version__)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    print(out.stdout)


def built(out: Path, seed: int) -> dict[str, torch.Tensor]:
    """The random tiny model of ``seed``, built by the CLI in a fresh process (as users build it)."""
    args = [sys.executable, "-m", "fp8rl.tiny", "--out", str(out), "--seed", str(seed)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(out / "model.safetensors")


def test_tiny_model_is_deterministic_and_fp8_shaped(tmp_path: Path) -> None:
    first, again, other = (
        built(tmp_path / "first", 0),
        built(tmp_path / "again", 0),
        built(tmp_path / "other", 1),
    )
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(
        first["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"]
    )
    linears = {k: v for k, v in first.items() if ".layers." in k and k.endswith("_proj.weight")}
    assert len(linears) == 14
    assert all(v.shape[0] % 128 == 0 and v.shape[1] % 128 == 0 for v in linears.values())
    assert all(v.dtype == torch.bfloat16 for v in first.values())


def test_tokenizer_is_byte_level_and_lossless(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in ["37+48=85", "a  b\n\tc", "naïve 日本"]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    assert tok("0+9=")["input_ids"] == [4 + ord(c) for c in "0+9="] == encode("0+9=")
    assert decode(tok("naïve 日本")["input_ids"]) == "naïve 日本"
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0


VLLM_PROBE = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[2])}],
                       SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True))
    c = out[0].outputs[0]
    print("RESULT", json.dumps({"tokens": list(c.token_ids),
                                "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]}))
""")


def test_vllm_and_transformers_agree_on_the_tiny_model(tiny_model_dir_f32: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompt = [4 + ord(c) for c in "12+34="]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        env["TORCHDYNAMO_DISABLE"] = "1"  # as the rollout engine does: see rollout_service/engine.py
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_PROBE, str(tiny_model_dir_f32), json.dumps(prompt)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir_f32, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + result["tokens"]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    assert logits.argmax(-1).tolist() == result["tokens"]  # greedy continuation agrees
    ours = logprobs.gather(1, torch.tensor(result["tokens"])[:, None]).squeeze(1)
    diff = (ours - torch.tensor(result["logprobs"], dtype=torch.float64)).abs().max().item()
    print(f"max |logprob difference| vLLM vs transformers: {diff:.2e}")
    assert diff < 1e-3
