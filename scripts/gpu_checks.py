"""The proof on a GPU host with the project's images: each check of the CUDA paths prints one PASS / FAIL /
SKIP line with its figure.

    scripts/gpu_checks.sh            # versions, the tests marked gpu, then these checks
    python scripts/gpu_checks.py     # these checks alone (--help: this text)

(a) TE's blockwise quantizers against fp8rl.quant (each scale format) and our CUDA codes against CPU's;
(b) a rollout engine per FP8 recipe (fp8, fp8-pow2, fp8-kv): load, keyframe and delta refits with a
    bit-exact readback of one layer's codes (under pow2 vLLM re-quantizes every refit: the codes shipped
    are its fixed point, so it holds them unchanged), then two restarts with the free GPU memory printed;
(c) a 10-step `coordinator start --recipe fp8 --compute-dtype bfloat16` and its median token_mult_prob_error;
(d) FP8 against BF16 GEMM time for the model's linear shapes;
(e) MoE expert refits: a Qwen3-MoE layer's fused experts (Qwen3-30B-A3B's expert shape, 8 experts)
    quantized blockwise where the trainer does it (on the GPU), then a keyframe and a delta through the
    codec, decoded part by part as a rollout does: every expert's codes and scales arrive as sent, every
    scale finite and positive (powers of two under pow2), and the delta changed every expert's scales;
(f) MoE expert GEMMs: each expert's gate, up and down weight, as (e) delivered it, in torch's
    blockwise-scaled FP8 GEMM (1x128 activations x 128x128 weights, scripts/gpu_proof.py's call) against
    float64 over the same FP8 operands, within the accumulation bound of fp8rl/accumulation.py.
(a) needs Transformer Engine for its TE part, (b) vLLM, (c) vLLM, Transformer Engine and redis-server in
one environment, (e) the codec's packages (pydantic, zstandard); each skips, with the reason, what it
lacks, but with FP8RL_REQUIRE_TE=1 a missing Transformer Engine fails (a) and (c). (a), (d) and (f) need
torch alone (on a host without the codec's packages (f) quantizes with fp8rl.quant itself, and says so),
and this script imports nothing more until a check asks: it runs on the bare GPU host too (docs/gpu.md).
Without CUDA the CUDA checks skip; (e) then runs on the CPU. Installs nothing. Exits 1 if any check
failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# torch-only modules here; the checks import the rest (pydantic, zstandard, vLLM, TE) when they run.
from fp8rl import quant  # noqa: E402
from fp8rl.accumulation import gemm_error_bound  # noqa: E402
from scripts.gpu_proof import UNSUPPORTED, blockwise_mm  # noqa: E402

if TYPE_CHECKING:
    from fp8rl.codec.weight_set import WeightSet
    from fp8rl.recipes import WeightFormat

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


def need_cuda() -> None:
    if not torch.cuda.is_available():
        raise SkipCheck("no CUDA device (torch.cuda.is_available() is False)")


def quantizers() -> str:
    need_cuda()
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
        need_cuda()
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise SkipCheck("vLLM not installed") from exc
        from fp8rl import models
        from fp8rl.codec.schema import attention_scale_names, build_weight_set
        from fp8rl.recipes import get_recipe
        from rollout_service.config import RolloutConfig
        from rollout_service.engine import VllmEngine
        from trainer_service.kv_cache import scale_names

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
    from fp8rl.recipes import get_recipe

    return get_recipe(recipe).rollout_weights


def num_layers(state: dict[str, torch.Tensor]) -> int:
    return 1 + max(int(n.split(".")[2]) for n in state if n.startswith("model.layers."))


def short_run() -> str:
    need_cuda()
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
    need_cuda()
    shapes = [(2048, 1536), (256, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]
    return "FP8 speed-up over BF16: " + ", ".join(
        f"{n}x{k} {gemm_speedup(4096, n, k):.2f}x" for n, k in shapes
    )


EXPERTS_PREFIX = "model.layers.0.mlp.experts"
QWEN3_30B_A3B_EXPERT = {"hidden": 2048, "intermediate": 768}  # (H, moe_intermediate_size; it has 128)
FORMATS: dict[WeightFormat, quant.ScaleFormat] = {"fp8-block128": "fp32", "fp8-block128-pow2": "pow2"}
PART_BYTES = 8 << 20  # (so that each update comes in several parts)
received: dict[str, dict[str, torch.Tensor]] = {}
"""What (e) delivered, per weight format: every expert linear's codes and scales, for (f)."""


def fused_experts(version: int, experts: int, hidden: int, intermediate: int) -> dict[str, torch.Tensor]:
    """transformers' fused expert parameters of one MoE layer at ``version`` (1 or 2), on the GPU if
    there is one (where the trainer quantizes): version 2 is version 1 with expert e scaled by
    2^(1 + e % 3) and noised by 1e-3 relative, so every expert's scales change (under pow2 too)."""
    g = torch.Generator().manual_seed(7)
    fused = {
        "gate_up_proj": torch.randn(experts, 2 * intermediate, hidden, generator=g) * 0.02,
        "down_proj": torch.randn(experts, hidden, intermediate, generator=g) * 0.02,
    }
    if version == 2:
        factor = 2.0 ** (1 + torch.arange(experts) % 3).float()[:, None, None]
        fused = {k: v * factor * (1 + 1e-3 * torch.randn(v.shape, generator=g)) for k, v in fused.items()}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {f"{EXPERTS_PREFIX}.{k}": v.to(device) for k, v in fused.items()}


def expert_linears(experts: int) -> list[str]:
    """The per-expert linears one MoE layer ships (its wire names, less ``.weight``)."""
    return [
        f"{EXPERTS_PREFIX}.{e}.{p}" for e in range(experts) for p in ("gate_proj", "up_proj", "down_proj")
    ]


def moe_refits(experts: int = 8, **shape: int) -> str:
    """Check (e); ``shape``: ``hidden`` and ``intermediate`` (Qwen3-30B-A3B's by default)."""
    shape = {**QWEN3_30B_A3B_EXPERT, **shape}
    try:
        from fp8rl.codec.schema import build_weight_set
    except ImportError as exc:
        raise SkipCheck(
            f"the codec cannot be imported ({exc}): it is in the images; a bare host can bring wheels"
        ) from exc
    figures = []
    for weight_format, scale_format in FORMATS.items():
        sent = [build_weight_set(fused_experts(v, experts, **shape), weight_format) for v in (1, 2)]
        held, wire = refit(sent, experts, scale_format)
        changed = [
            not torch.equal(*(ws.tensors[f"{m}.weight_scale_inv"] for ws in sent))
            for m in expert_linears(experts)
        ]
        assert all(changed), (
            f"the delta left the scales of {changed.count(False)} expert linears as they were"
        )
        received[weight_format] = dict(held)
        figures.append(
            f"{weight_format}: keyframe {wire[0] / 2**20:.1f} MiB, delta {wire[1] / 2**20:.2f} MiB"
        )
    return (
        f"{experts} experts of H={shape['hidden']}, I={shape['intermediate']} quantized on "
        f"{'the GPU' if torch.cuda.is_available() else 'the CPU'}, keyframe then delta (every expert's "
        f"scales changed), decoded part by part: all {3 * experts} expert linears' codes and scales as "
        f"sent, finite and positive (powers of two under pow2); {', '.join(figures)}"
    )


def refit(
    sent: list[WeightSet], experts: int, scale_format: quant.ScaleFormat
) -> tuple[Mapping[str, torch.Tensor], list[int]]:
    """``sent`` (two WeightSets) to a replica as a keyframe, then a delta, in parts; each update checked
    against what was sent once decoded. Returns the set held at the end and each update's bytes."""
    from fp8rl.codec.decode import UpdateDecoder
    from fp8rl.codec.encode import delta_parts, keyframe_parts

    schema = {n: (t.dtype, tuple(t.shape)) for n, t in sent[0].tensors.items()}

    def admit(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:  # (a replica's schema)
        assert schema.get(name) == (dtype, shape), f"{name}: {dtype} {shape} is not the model's"

    updates = [
        keyframe_parts(sent[0], 1, part_bytes=PART_BYTES),
        delta_parts(sent[1], sent[0], 2, 1, part_bytes=PART_BYTES),
    ]
    held, wire = None, [0, 0]
    for version, parts in enumerate(updates, start=1):
        decoder = UpdateDecoder(held, version - 1 if held else None, admit)
        for part in parts:
            blob = bytearray(b"".join(part.segments))  # (as a replica receives it: writable)
            wire[version - 1] += len(blob)
            decoder.add(blob)
        decoded = decoder.finish()
        assert (decoded.version, decoded.encoding) == (version, "keyframe" if version == 1 else "delta")
        check_experts(decoded.weights.tensors, sent[version - 1].tensors, experts, scale_format)
        held = decoded.weights
    return held.tensors, wire  # type: ignore[union-attr]


def check_experts(
    got: Mapping[str, torch.Tensor],
    sent: Mapping[str, torch.Tensor],
    experts: int,
    scale_format: quant.ScaleFormat,
) -> None:
    """Every expert linear's codes and scales as sent; every scale finite and positive, and a power of
    two under pow2 (what a replica's schema check refuses otherwise)."""
    assert set(got) == set(sent), sorted(set(got) ^ set(sent))[:3]
    for linear in expert_linears(experts):
        codes, scales = got[f"{linear}.weight"], got[f"{linear}.weight_scale_inv"]
        assert torch.equal(codes.view(torch.uint8), sent[f"{linear}.weight"].view(torch.uint8)), linear
        assert torch.equal(scales, sent[f"{linear}.weight_scale_inv"]), f"{linear}: scales differ from sent"
        assert bool((torch.isfinite(scales) & (scales > 0)).all()), f"{linear}: a scale not finite and > 0"
        if scale_format == "pow2":
            assert bool((torch.frexp(scales).mantissa == 0.5).all()), f"{linear}: a scale not a power of two"


def moe_gemms(experts: int = 8, tokens: int = 128, **shape: int) -> str:
    """Check (f), over what (e) delivered (or, where (e) could not run, fp8rl.quant's codes of the same
    weights)."""
    need_cuda()
    g = torch.Generator().manual_seed(8)
    worst, source = 0.0, "as (e) delivered them"
    for weight_format, scale_format in FORMATS.items():
        tensors = received.get(weight_format)
        if tensors is None:
            tensors, source = (
                quantized_experts(experts, scale_format, **shape),
                "fp8rl.quant's ((e) did not run)",
            )
        for linear in expert_linears(experts):
            qw, sw = tensors[f"{linear}.weight"].cuda(), tensors[f"{linear}.weight_scale_inv"].cuda()
            x = torch.randn(tokens, qw.shape[1], generator=g)
            x *= 10.0 ** torch.randint(-2, 3, (tokens, 1), generator=g).float()  # (per-token scales differ)
            qx, sx = quant.quantize_activation(x.cuda(), scale_format=scale_format, arithmetic="vllm")
            ratio = bound_ratio(qx, sx, qw, sw)
            assert ratio <= 1, f"{weight_format} {linear}: error {ratio:.2f} times the accumulation bound"
            worst = max(worst, ratio)
    return (
        f"{3 * experts} expert linears x {len(FORMATS)} formats (fp32 and pow2 scales), weights {source}, "
        f"{tokens} tokens each: worst error {worst:.2g} of the accumulation bound"
    )


def bound_ratio(qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor) -> float:
    """The largest error of torch's blockwise-scaled FP8 GEMM ``dq(qx) @ dq(qw).T`` (float32 out) as a
    fraction of fp8rl.accumulation's bound, against float64 over the same operands (on the GPU)."""
    try:
        got = blockwise_mm(qx, sx, qw, sw, torch.float32)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        if any(word in str(exc).lower() for word in UNSUPPORTED):
            raise SkipCheck(f"torch {torch.__version__} here has no blockwise FP8 GEMM: {exc}") from exc
        raise
    n, k = qw.shape
    a = qx.double() * sx.double().repeat_interleave(128, 1)[:, :k]  # (exact in float64)
    b = qw.double() * sw.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return ((got.double() - a @ b.t()).abs() / gemm_error_bound(a, b)).max().item()


def quantized_experts(experts: int, scale_format: quant.ScaleFormat, **shape: int) -> dict[str, torch.Tensor]:
    """Version 2 of :func:`fused_experts` per expert linear as fp8rl.quant quantizes it (what
    ``build_weight_set`` ships), for (f) where the codec cannot be imported."""
    shape = {**QWEN3_30B_A3B_EXPERT, **shape}
    fused = fused_experts(2, experts, **shape)
    gate_up, down = fused[f"{EXPERTS_PREFIX}.gate_up_proj"], fused[f"{EXPERTS_PREFIX}.down_proj"]
    i = shape["intermediate"]
    out = {}
    for e in range(experts):
        for name, w in (("gate_proj", gate_up[e, :i]), ("up_proj", gate_up[e, i:]), ("down_proj", down[e])):
            codes, scales = quant.quantize_blockwise(w, scale_format=scale_format)
            out[f"{EXPERTS_PREFIX}.{e}.{name}.weight"] = codes
            out[f"{EXPERTS_PREFIX}.{e}.{name}.weight_scale_inv"] = scales
    return out


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_checks: no CUDA device: the CUDA checks skip", flush=True)
    check("a quantizers", quantizers)
    for recipe in ("fp8", "fp8-pow2", "fp8-kv"):
        check(f"b rollout refits {recipe}", rollout_refits(recipe))
    check("c 10-step fp8 run", short_run)
    check("d GEMM time", gemm_times)
    check("e MoE expert refits (keyframe, delta)", moe_refits)
    check("f MoE expert block-FP8 GEMMs", moe_gemms)
    print("\n".join(results))
    return 1 if any(line.startswith("FAIL") for line in results) else 0


if __name__ == "__main__":
    sys.exit(main())
