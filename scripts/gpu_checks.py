"""The proof on a GPU host with the project's images: each check of the CUDA paths prints one PASS / FAIL /
SKIP line with its figure.

    scripts/gpu_checks.sh            # versions, the tests marked gpu, then these checks

(a) TE's blockwise quantizers against fp8rl.quant (each scale format) and our CUDA codes against CPU's;
(b) a rollout engine per FP8 recipe (fp8, fp8-pow2, fp8-kv): load, keyframe and delta refits with a
    bit-exact readback of one layer's codes (under pow2 vLLM re-quantizes every refit: the codes shipped
    are its fixed point, so it holds them unchanged), then two restarts with the free GPU memory printed;
(c) a 10-step `coordinator start --recipe fp8 --compute-dtype bfloat16` and its median token_mult_prob_error;
(d) FP8 against BF16 GEMM time for the model's linear shapes.
Every check needs the project's dependencies (pydantic, zstandard, ...: an image, not a bare host, where
scripts/gpu_proof.py runs instead). (a) needs Transformer Engine for its TE part, (b) vLLM, (c) vLLM,
Transformer Engine and redis-server in one environment; each skips, with the reason, what it lacks, but
with FP8RL_REQUIRE_TE=1 a missing Transformer Engine fails (a) and (c). Installs nothing. Exits 1 if any
check failed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fp8rl import quant  # noqa: E402
from fp8rl.codec.schema import attention_scale_names  # noqa: E402
from fp8rl.recipes import WeightFormat, get_recipe  # noqa: E402
from trainer_service.kv_cache import scale_names  # noqa: E402

results: list[str] = []


def check(name: str, run: Callable[[], str]) -> None:
    """Run one check; it returns its figure, raises AssertionError to fail, or SkipCheck to skip."""
    try:
        line = f"PASS {name}: {run()}"
    except SkipCheck as skip:
        line = f"SKIP {name}: {skip}"
    except Exception as exc:  # a check that raises fails; the others still run
        traceback.print_exc()
        line = f"FAIL {name}: {type(exc).__name__}: {exc}"
    results.append(line)
    print(line, flush=True)


class SkipCheck(Exception):
    pass


def import_te() -> None:
    """Transformer Engine, or SkipCheck with the reason; with FP8RL_REQUIRE_TE=1 its absence fails."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as exc:
        if os.environ.get("FP8RL_REQUIRE_TE") == "1":
            raise AssertionError(f"FP8RL_REQUIRE_TE=1 but Transformer Engine does not import: {exc}") from exc
        raise SkipCheck(f"Transformer Engine does not import ({exc})") from exc


def quantizers() -> str:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 1024, generator=g) * 10.0 ** torch.randint(-3, 4, (512, 1), generator=g)
    q_cpu, s_cpu = quant.quantize_activation(x)
    q_gpu, s_gpu = quant.quantize_activation(x.cuda())
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8)) and torch.equal(
        s_gpu.cpu(), s_cpu
    )
    try:
        import_te()
    except SkipCheck as skip:
        return f"CUDA codes = CPU codes; TE's quantizers not compared: {skip}"
    from trainer_service.fp8_linear import te_quantizer

    xc = x.cuda()
    for fmt in quant.SCALE_FORMATS:
        ours = {
            (1, True): quant.fake_quantize_activation(xc, scale_format=fmt),
            (2, True): quant.fake_quantize_weight(xc, scale_format=fmt),
            (1, False): quant.fake_quantize_columnwise(xc, scale_format=fmt),
        }
        for (dim, rowwise), want in ours.items():
            got = te_quantizer(dim, rowwise, fmt)(xc).dequantize(dtype=torch.float32)
            differ = (got != want).sum().item()
            assert differ == 0, f"{fmt} dim={dim} rowwise={rowwise}: {differ} values differ"
    return "CUDA codes = CPU codes; TE 1x128 rowwise, 1x128 columnwise, 128x128 = fp8rl.quant (fp32, pow2)"


def rollout_refits(recipe: str) -> Callable[[], str]:
    def run() -> str:
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise SkipCheck("vLLM not installed") from exc
        from fp8rl import models
        from fp8rl.codec.schema import build_weight_set
        from rollout_service.config import RolloutConfig
        from rollout_service.engine import VllmEngine

        config = RolloutConfig(recipe=recipe, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3)
        engine = VllmEngine(config)
        from safetensors.torch import load_file

        state = load_file(models.verified(models.TINY_ARITH) / "model.safetensors")
        g = torch.Generator().manual_seed(1)
        name = "model.layers.0.mlp.down_proj.weight"
        for _ in range(2):  # a keyframe, then a changed set (what a delta applies)
            state = {
                k: v + 0.01 * v.float().std() * torch.randn(v.shape, generator=g) if v.ndim == 2 else v
                for k, v in state.items()
            }
            if get_recipe(recipe).kv_cache_dtype == "fp8":  # calibrated-looking k/v scales ride along
                attention = [f"model.layers.{i}.self_attn" for i in range(num_layers(state))]
                state |= {n: torch.rand((), generator=g) / 100 + 1e-3 for n in scale_names(attention)}
            sent = build_weight_set(state, get_format(recipe), torch.bfloat16).tensors
            engine.load_weights(sent)
        held = engine.named_parameters()
        codes = next(v for k, v in held.items() if k.endswith("mlp.down_proj.weight"))
        assert codes.dtype == torch.float8_e4m3fn, codes.dtype
        assert torch.equal(codes.view(torch.uint8), sent[name].view(torch.uint8)), (
            "held codes differ from sent"
        )
        if get_recipe(recipe).kv_cache_dtype == "fp8":  # vLLM's FP8 cache took the scales shipped
            for layer, held_scales in engine.attention_scales().items():
                prefix = layer.removesuffix(".attn")
                want = tuple(float(sent[n]) for n in attention_scale_names(prefix))
                assert held_scales == want, f"{layer}: q/k/v scales {held_scales}, sent {want}"
            # The emulations round the query too, as FlashAttention-3 does: a backend that does not
            # would leave the trainer computing something else.
            assert all(engine.llm.collective_rpc(queries_in_fp8)[0]), "this backend leaves Q unquantized"
        free = []
        for _ in range(2):
            engine.restart()
            free.append(torch.cuda.mem_get_info()[0] / 2**30)
        return f"refits bit-exact; free GiB after restarts {free[0]:.1f}, {free[1]:.1f}"

    return run


def queries_in_fp8(worker: Any) -> list[bool]:
    """Whether each attention layer quantizes its query (vLLM's ``query_quant``: FA3 over an FP8 cache)."""
    from vllm.model_executor.layers.attention import Attention

    model = worker.model_runner.model
    return [m.query_quant is not None for m in model.modules() if isinstance(m, Attention)]


def get_format(recipe: str) -> WeightFormat:
    return get_recipe(recipe).rollout_weights


def num_layers(state: dict[str, torch.Tensor]) -> int:
    return 1 + max(int(n.split(".")[2]) for n in state if n.startswith("model.layers."))


def short_run() -> str:
    import_te()
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise SkipCheck(f"needs vLLM and Transformer Engine in one environment ({exc})") from exc
    if shutil.which("redis-server") is None:
        raise SkipCheck("no redis-server on PATH (the coordinator starts one)")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-m",
            "coordinator.cli",
            "start",
            "--recipe",
            "fp8",
            "--steps",
            "10",
            "--compute-dtype",
            "bfloat16",
            "--run-dir",
            str(run_dir),
            "--progress",
            "plain",
        ]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, proc.stderr[-2000:]
        errors = sorted(
            json.loads(line)["token_mult_prob_error"]
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()[1:]
        )
        median = errors[len(errors) // 2]
        assert median < 1.05, f"median token_mult_prob_error {median:.5f}"
        return f"median token_mult_prob_error {median:.5f} over {len(errors)} steps"


def seconds(fn: Callable[[], object]) -> float:
    """Mean CUDA time of ``fn`` over 20 calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 20


def gemm_speedup(m: int, n: int, k: int) -> float:
    """BF16 time over per-tensor-scaled FP8 time of an [m, k] x [k, n] GEMM."""
    a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    fp8 = seconds(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    bf_a, bf_b = a.bfloat16(), b.bfloat16().t()
    return seconds(lambda: bf_a @ bf_b) / fp8


def gemm_times() -> str:
    """Qwen2.5-1.5B's linear shapes (N, K) at 4096 tokens: per-tensor-scaled FP8 vs BF16."""
    shapes = [(2048, 1536), (256, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]
    return "FP8 speed-up over BF16: " + ", ".join(
        f"{n}x{k} {gemm_speedup(4096, n, k):.2f}x" for n, k in shapes
    )


def main() -> int:
    assert torch.cuda.is_available(), "no CUDA device"
    check("a quantizers", quantizers)
    for recipe in ("fp8", "fp8-pow2", "fp8-kv"):
        check(f"b rollout refits {recipe}", rollout_refits(recipe))
    check("c 10-step fp8 run", short_run)
    check("d GEMM time", gemm_times)
    print("\n".join(results))
    return 1 if any(line.startswith("FAIL") for line in results) else 0


if __name__ == "__main__":
    sys.exit(main())
