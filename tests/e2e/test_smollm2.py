"""The real instruct model end to end: SmolLM2-135M-Instruct (Llama, tied embeddings, q/k/v off the
128-grid) trained with ``--recipe fp8`` by the embedded coordinator on a chat-format dataset scored by
math-verify: every step recorded, consistency inside the band, the FP8 plan recorded."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from coordinator.metrics import read_metrics
from tests.support import coordinator_start

pytestmark = pytest.mark.slow


def chat_rows(count: int) -> list[dict[str, object]]:
    return [
        {"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
        for a, b in ((3 * i % 10, 7 * i % 10) for i in range(count))
    ]


def test_smollm2_trains_under_fp8_on_a_chat_dataset(smollm2_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(12)))
    run_dir = tmp_path / "run"
    args = coordinator_start(run_dir, "--recipe", "fp8", "--model", str(smollm2_dir), "--task", "dataset")
    args += ["--dataset", str(data), "--prompt-key", "messages", "--val-size", "4", "--val-every", "0"]
    args += ["--steps", "2", "--prompts-per-step", "4", "--group-size", "2", "--max-tokens", "12"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900)
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, out
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2], out
    trained = records[1:]
    assert all(r["reward_failures"] == 0 for r in trained), trained
    # Not 1.0: one FP8 code that the engines' one-ulp attention differences flip grows, layer by layer,
    # into a few percent of the hidden state (docs/fp8-contract.md: 1.06-1.13 measured on this model);
    # importance sampling corrects it.
    errors = [r["token_mult_prob_error"] for r in trained]
    assert all(1 <= e < 1.25 for e in errors), errors
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "but self_attn.k_proj, self_attn.q_proj, self_attn.v_proj" in summary["linears"], summary
    validated = {str(r["step"]): r["val_accuracy"] for r in records if "val_accuracy" in r}
    assert summary["val_accuracy_by_step"] == validated and validated.keys() == {"0", "2"}, summary
    run = json.loads((run_dir / "run.json").read_text())
    assert len(run["linears"]["high_precision_per_layer"]) == 3 and run["linears"]["layers"] == 30
