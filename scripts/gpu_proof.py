"""The GPU proof a bare CUDA host can run as it is: Python and torch, nothing installed, no network.

    python scripts/gpu_proof.py        # from the repository root; docs/gpu.md says what to bring

One PASS / FAIL / SKIP line per check, with its figures; exit status 1 if any check failed. It imports
torch and this repository's torch-only modules (fp8rl.quant, fp8rl.accumulation, fp8rl.codec.device_planes,
the emulated FP8 linear of trainer_service/fp8_linear.py, tests/vllm_reference.py) and nothing else: no
pydantic, zstandard, vLLM, Transformer Engine or grpc. Without CUDA the CUDA checks SKIP with the reason.

a  the import chain: none of those packages was loaded;
b  fp8rl.quant on CUDA = on CPU, bit for bit: weights (fp32, pow2), activations (TE's and vLLM's
   arithmetic, each scale format), columnwise;
c  pow2 weights are the fixed point of vLLM's DeepGEMM re-quantization (on CUDA where there is one);
d  blockwise FP8 GEMM (torch's scaled_mm, 1x128 activations x 128x128 weights) against float64 over the
   same FP8 operands, within the accumulation bound of fp8rl/accumulation.py;
e  per-slice FP8 GEMM (torch._scaled_mm per 128-wide K slice, unit scales; what tests/unit/test_quant_gpu.py
   does) within the same bound;
f  the emulated FP8 trainer step (two FP8 linears, loss, backward, AdamW) on CUDA against the CPU;
g  FP8 against BF16 GEMM time at Llama-3.1-8B's linear shapes (the "FP8 GEMMs ~2x BF16" claim);
h  exact consistency's arithmetic (fp8rl/exact.py) on CUDA = on CPU, bit for bit (FP8 and high-precision
   linears, attention, RMSNorm, SiLU, rotary angles, routing), a row the same bits alone and inside a
   batch on CUDA, and what an exact linear costs against a bf16 GEMM at Llama-3.1-8B's shapes: the
   arithmetic an exact CUDA engine pair would run (docs/gpu.md);
i  the device planes of weight updates (fp8rl/codec/device_planes.py): one Llama-3.1-8B layer's FP8 set,
   quantized on the GPU, into a second process by CUDA IPC and, with two GPUs, by an NCCL broadcast, bit
   for bit, against a copy on the device (docs/weight-sync.md#device-planes).

``--dry-run-on-cpu`` runs the CUDA checks with the CPU in the GPU's place (small GEMM shapes, no
blockwise kernel): a test of this script's code (tests/integration/test_gpu_proof.py), not a proof of
anything.
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fp8rl import exact, quant  # noqa: E402
from fp8rl.accumulation import BITS, FP32_UNIT, abs_product_sum, gemm_error_bound  # noqa: E402
from fp8rl.codec import device_planes as planes  # noqa: E402
from tests import vllm_reference  # noqa: E402
from trainer_service.fp8_linear import fp8_linear  # noqa: E402

NOT_ON_THE_HOST = ("pydantic", "zstandard", "vllm", "transformer_engine", "transformer_engine_torch", "grpc")
NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"
GPU: str | None = "cuda" if torch.cuda.is_available() else None
"""The device the CUDA checks run on: CUDA, or the CPU under --dry-run-on-cpu, or none (they skip)."""

results: list[str] = []


class Skip(Exception):
    """A check that cannot run here; its message says why."""


def check(name: str, run: Callable[[], str]) -> None:
    """Run one check: it returns its figures, raises Skip to skip, anything else fails it."""
    start = time.perf_counter()
    try:
        line = f"PASS {name}: {run()}"
    except Skip as skip:
        line = f"SKIP {name}: {skip}"
    except Exception as exc:  # one failing check does not stop the others
        traceback.print_exc()
        line = f"FAIL {name}: {type(exc).__name__}: {exc}"
    line += f" [{time.perf_counter() - start:.1f} s]"
    results.append(line)
    print(line, flush=True)


def gpu_device() -> str:
    if GPU is None:
        raise Skip(NO_CUDA)
    return GPU


def fresh(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def import_chain() -> str:
    loaded = sorted({m.split(".")[0] for m in sys.modules} & set(NOT_ON_THE_HOST))
    assert not loaded, f"imported {loaded}"
    ours = sorted(m for m in sys.modules if m.split(".")[0] in ("fp8rl", "trainer_service", "tests"))
    return f"loaded {', '.join(ours)}; none of {', '.join(NOT_ON_THE_HOST)}"


def codes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def cuda_equals_cpu() -> str:
    device = gpu_device()
    g = fresh(1)
    w = torch.randn(640, 520, generator=g) * 10.0 ** torch.randint(-6, 4, (640, 1), generator=g).float()
    x = torch.randn(300, 1000, generator=g) * 10.0 ** torch.randint(-12, 12, (300, 1), generator=g).float()
    x[0], x[1, :128] = 0, 1e-39  # a zero row, a subnormal group
    compared = 0
    for fmt in quant.SCALE_FORMATS:
        for cpu, gpu in (
            (
                quant.quantize_blockwise(w, scale_format=fmt),
                quant.quantize_blockwise(w.to(device), scale_format=fmt),
            ),
            *(
                (
                    quant.quantize_activation(x, scale_format=fmt, arithmetic=arithmetic),
                    quant.quantize_activation(x.to(device), scale_format=fmt, arithmetic=arithmetic),
                )
                for arithmetic in ("te", "vllm")
            ),
        ):
            assert codes_equal(cpu[0], gpu[0]) and torch.equal(cpu[1], gpu[1].cpu()), fmt
            compared += cpu[0].numel()
        columnwise = quant.fake_quantize_columnwise(x, scale_format=fmt)
        assert torch.equal(
            columnwise, quant.fake_quantize_columnwise(x.to(device), scale_format=fmt).cpu()
        ), fmt
    return (
        f"{compared:,} codes and their scales identical (weights fp32/pow2; activations te/vllm x fp32/pow2)"
    )


def pow2_fixed_point() -> str:
    device = GPU or "cpu"
    g = fresh(2)
    spread = 2.0 ** (torch.rand(24, 1, 8, 1, generator=g) * 30 - 20)  # block amaxes over 30 octaves
    w = (torch.randn(24, 128, 8, 128, generator=g) * spread).reshape(24 * 128, 8 * 128)
    q, s = quant.quantize_blockwise(w.to(device), scale_format="pow2")
    held_q, held_s = vllm_reference.requantize_ue8m0(q, s)
    assert codes_equal(held_q, q) and torch.equal(held_s, s), "vLLM would rewrite the shipped weight"
    # TE's pow2 rule alone (no floor, no renormalisation): the blocks vLLM would rewrite.
    blocks = quant._as_blocks(w.to(device), quant.WEIGHT_BLOCK)
    te_q, te_s = quant._codes_and_scale_inv(blocks, blocks.abs().amax(dim=(1, 3), keepdim=True), "pow2", "te")
    te_q, te_s = quant._from_blocks(te_q, w.shape), te_s[:, 0, :, 0]
    rewritten = int((vllm_reference.requantize_ue8m0(te_q, te_s)[1] != te_s).sum())
    return (
        f"on {device}: all {s.numel()} blocks come back byte for byte ({int((s == 2.0**-22).sum())} at the "
        f"1e-4 floor); TE's rule alone would have {rewritten} rewritten"
    )


def scaled_operands(
    m: int, n: int, k: int, fmt: quant.ScaleFormat, seed: int, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 operands on ``device`` (codes and scales) and their exact float64 values on the CPU."""
    g = fresh(seed)
    x = torch.randn(m, k, generator=g) * 10.0 ** torch.randint(-2, 3, (m, 1), generator=g).float()
    w = torch.randn(n, k, generator=g) * 0.02
    qx, sx = quant.quantize_activation(x.to(device), scale_format=fmt)
    qw, sw = quant.quantize_blockwise(w.to(device), scale_format=fmt)
    a = qx.cpu().double() * sx.cpu().double().repeat_interleave(128, 1)[:, :k]  # (exact in float64)
    b = qw.cpu().double() * sw.cpu().double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return qx, sx, qw, sw, a, b


def blockwise_mm(
    qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``dq(qx) @ dq(qw).T`` by torch's blockwise-scaled FP8 GEMM: activation scales [M, K/128] M-major,
    weight scales [K/128 padded to 4, N/128] K-major (the layout torch's meta checks state)."""
    if qx.device.type == "cpu":
        raise Skip("torch's blockwise FP8 GEMM has no CPU kernel")
    kb = sx.shape[1]
    padded = torch.zeros(sw.shape[0], -(-kb // 4) * 4, dtype=torch.float32, device=sw.device)
    padded[:, :kb] = sw
    scale_a, scale_b = sx.t().contiguous().t(), padded.t()
    functional = getattr(torch.nn.functional, "scaled_mm", None)
    if functional is not None:
        recipes = torch.nn.functional.ScalingType
        return functional(
            qx,
            qw.t(),
            scale_a,
            recipes.BlockWise1x128,
            scale_b,
            recipes.BlockWise128x128,
            output_dtype=out_dtype,
        )
    if not hasattr(torch, "_scaled_mm"):
        raise Skip(
            f"torch {torch.__version__} has neither torch.nn.functional.scaled_mm nor torch._scaled_mm"
        )
    return torch._scaled_mm(qx, qw.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


UNSUPPORTED = ("not supported", "unsupported", "only supported", "not implemented", "notimplemented")


def within_bound(
    got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, extra: torch.Tensor | float = 0.0
) -> str:
    exact = a @ b.t()
    error = (got.double() - exact).abs()
    bound = gemm_error_bound(a, b) + extra
    ratio = (error / bound).max().item()
    assert ratio <= 1, f"error {error.max().item():.3g} exceeds the {BITS}-bit bound (x{ratio:.2f})"
    fp32_units = (error / (FP32_UNIT * abs_product_sum(a, b))).max().item()
    worst = error.max().item()
    return f"max |err| {worst:.2e} = {ratio:.2g} of the bound = {fp32_units:.3g} FP32 units of sum|ab|"


def blockwise_gemm() -> str:
    device = gpu_device()
    figures = []
    for fmt in quant.SCALE_FORMATS:
        qx, sx, qw, sw, a, b = scaled_operands(
            256, 384, 896, fmt, seed=3, device=device
        )  # 7 K blocks: the scales pad to 8
        errors = []
        for out_dtype in (torch.float32, torch.bfloat16):
            try:
                got = blockwise_mm(qx, sx, qw, sw, out_dtype).cpu()
            except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
                errors.append(f"{out_dtype}: {exc}".splitlines()[0])
                continue
            # A bf16 output rounds once more: half a unit in its 8-bit significand's last place.
            extra = 2.0**-8 * got.double().abs() if out_dtype == torch.bfloat16 else 0.0
            figures.append(
                f"{fmt} ({str(out_dtype).removeprefix('torch.')} out) {within_bound(got, a, b, extra)}"
            )
            break
        else:
            if all(any(word in e.lower() for word in UNSUPPORTED) for e in errors):
                raise Skip(f"torch {torch.__version__} here has no blockwise FP8 GEMM: {'; '.join(errors)}")
            raise AssertionError("; ".join(errors))
    return "; ".join(figures)


def sliced_gemm() -> str:
    device = gpu_device()
    figures = []
    for fmt in quant.SCALE_FORMATS:
        qx, sx, qw, sw, a, b = scaled_operands(64, 256, 512, fmt, seed=4, device=device)
        one = torch.ones((), device=device)
        out = torch.zeros(64, 256, dtype=torch.float64)
        for j in range(512 // 128):
            cols = slice(j * 128, (j + 1) * 128)
            partial = torch._scaled_mm(
                qx[:, cols].contiguous(),
                qw[:, cols].contiguous().t(),
                scale_a=one,
                scale_b=one,
                out_dtype=torch.float32,
            )
            out += (
                partial.cpu().double()
                * sx[:, j : j + 1].cpu().double()
                * sw[:, j].cpu().double().repeat_interleave(128)[None, :256]
            )
        figures.append(f"{fmt} {within_bound(out, a, b)}")
    return "; ".join(figures)


def trainer_step(device: str, fmt: quant.ScaleFormat, autocast: bool) -> dict[str, torch.Tensor]:
    """One step of a two-layer FP8 MLP (the emulated linear of the trainer, AdamW): 4 sequences of 48
    tokens (192 in wgrad's 128-token groups: one whole, one partial)."""
    g = fresh(5)
    w1, w2 = torch.randn(512, 256, generator=g) * 0.05, torch.randn(256, 512, generator=g) * 0.05
    x, target = torch.randn(4, 48, 256, generator=g), torch.randn(4, 48, 256, generator=g)
    params = [w1.to(device).requires_grad_(), w2.to(device).requires_grad_()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        hidden = torch.nn.functional.gelu(fp8_linear(x.to(device), params[0], None, fmt))
        y = fp8_linear(hidden, params[1], None, fmt)
        loss = (y.float() - target.to(device)).pow(2).mean()
    loss.backward()
    grads = [p.grad.detach().clone() for p in params]  # type: ignore[union-attr]
    optimizer.step()
    return {
        "loss": loss.detach().cpu()[None],
        "grad w1": grads[0].cpu(),
        "grad w2": grads[1].cpu(),
        "w1": params[0].detach().cpu(),
        "w2": params[1].detach().cpu(),
    }


def emulated_step() -> str:
    device = gpu_device()
    # TF32 would shorten the float32 GEMMs' significands: the emulation multiplies in IEEE float32.
    torch.backends.cuda.matmul.allow_tf32 = False
    figures = []
    # The CPU and cuBLAS sum each GEMM in other orders (float32: ~K * 2^-24 relative); where a value
    # sits that close to an FP8 rounding boundary of a later quantization, its code differs by one step
    # (2^-4 relative), so a few elements move further. Thresholds: far above that, far below a broken
    # path (a wrong quantizer moves whole tensors by ~2^-4 of their norm).
    for fmt in quant.SCALE_FORMATS:
        for autocast, tolerance in ((False, 1e-4), (True, 1e-2)):
            cpu, gpu = trainer_step("cpu", fmt, autocast), trainer_step(device, fmt, autocast)
            worst = max(((gpu[k] - cpu[k]).norm() / cpu[k].norm()).item() for k in cpu)
            same = sum(
                codes_equal(
                    quant.quantize_blockwise(gpu[k], scale_format=fmt)[0],
                    quant.quantize_blockwise(cpu[k], scale_format=fmt)[0],
                )
                for k in ("w1", "w2")
            )
            label = f"{fmt}{' bf16' if autocast else ' fp32'}"
            assert worst <= tolerance, f"{label}: relative difference {worst:.2e} > {tolerance:g}"
            figures.append(f"{label} max rel. diff {worst:.1e}, updated weights' codes equal {same}/2")
    return "; ".join(figures)


LLAMA_8B = {  # (N, K) of Llama-3.1-8B's block linears
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
TOKENS = 8192


def elapsed_ms(fn: Callable[[], object], repeat: int = 20) -> float:
    """Mean time of ``fn`` in milliseconds after 5 warm-up calls (by CUDA events on CUDA)."""
    for _ in range(5):
        fn()
    if GPU != "cuda":
        start_s = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - start_s) * 1e3 / repeat
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def shape_times(m: int, n: int, k: int, device: str) -> dict[str, float | str]:
    """Milliseconds of an [m, k] x [k, n] GEMM: bf16, FP8 with unit per-tensor scales, blockwise FP8
    (or why it cannot run: the value is then a string)."""
    a, b = torch.randn(m, k, device=device), torch.randn(n, k, device=device)
    a16, b16 = a.bfloat16(), b.bfloat16()
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    times: dict[str, float | str] = {
        "bf16": elapsed_ms(lambda: a16 @ b16.t()),
        "fp8": elapsed_ms(
            lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        ),
    }
    qx, sx = quant.quantize_activation(a)
    qw, sw = quant.quantize_blockwise(b)
    try:
        blockwise_mm(qx, sx, qw, sw, torch.bfloat16)
    except (Skip, RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        times["fp8 blockwise"] = str(exc).splitlines()[0]
    else:
        times["fp8 blockwise"] = elapsed_ms(lambda: blockwise_mm(qx, sx, qw, sw, torch.bfloat16))
    return times


def gemm_times() -> str:
    device = gpu_device()
    scale = 1 if device == "cuda" else 32  # (the dry run: shapes small enough for a CPU)
    figures, totals = [], {"bf16": 0.0, "fp8": 0.0, "fp8 blockwise": 0.0}
    for name, (n, k) in LLAMA_8B.items():
        m, n, k = TOKENS // scale, n // scale, k // scale
        times = shape_times(m, n, k, device)
        bf16 = float(times["bf16"])
        speedups = []
        for key in ("fp8", "fp8 blockwise"):
            value = times[key]
            if isinstance(value, str):
                totals.pop(key, None)
                speedups.append(f"{key} unavailable ({value})")
                continue
            if key in totals:
                totals[key] += value
            speedups.append(f"{key} {bf16 / value:.2f}x")
        totals["bf16"] += bf16
        tflops = 2 * m * n * k / bf16 / 1e9
        figures.append(
            f"{name} {m}x{n}x{k}: bf16 {bf16:.2f} ms ({tflops:.3g} TFLOP/s), {', '.join(speedups)}"
        )
    overall = ", ".join(f"{key} {totals['bf16'] / totals[key]:.2f}x" for key in totals if key != "bf16")
    verdict = "held" if totals["bf16"] / totals["fp8"] >= 1.9 else "not reached"
    return f"{'; '.join(figures)}. A layer's four linears: {overall} over bf16 (the ~2x claim: {verdict})"


def exact_cuda_equals_cpu() -> str:
    device = gpu_device()
    g = fresh(8)
    x = torch.randn(257, 576, generator=g) * torch.exp(torch.randn(257, 1, generator=g))
    w = torch.randn(320, 576, generator=g) * 0.05
    q, k, v = (torch.randn(3, 8 if i == 0 else 2, 45, 64, generator=g) for i in range(3))
    allowed = torch.ones(45, 45, dtype=torch.bool).tril()[None, None]
    logits = torch.randn(57, 8, generator=g)
    positions = torch.arange(0, 8192, 37)
    inv_freq = exact.rope_inv_freq(64, {"rope_type": "default", "rope_theta": 1e5})

    def ops(on: str) -> list[torch.Tensor]:
        xd, wd = x.to(on), w.to(on)
        out = [
            exact.linear(xd, exact.prepared_weight(wd, fp8=fmt, dtype=torch.float32), None, fp8=fmt)
            for fmt in (None, "fp32", "pow2")
        ]
        out.append(exact.attention(q.to(on), k.to(on), v.to(on), allowed.to(on), 0.125))
        out += [exact.rms_norm(xd, wd[0, :576].abs() + 0.5, 1e-5), exact.silu(xd)]
        out += [*exact.rope_cos_sin(positions.to(on), inv_freq.to(on), torch.float32)]
        out += list(exact.route(logits.to(on), 2, True))
        return [t.cpu() for t in out]

    cpu, gpu = ops("cpu"), ops(device)
    same = [torch.equal(a, b) for a, b in zip(cpu, gpu, strict=True)]
    assert all(same), f"differ: {[i for i, s in enumerate(same) if not s]}"
    weight = exact.prepared_weight(w.to(device), fp8="fp32", dtype=torch.float32)
    whole = exact.linear(x.to(device), weight, None, fp8="fp32")
    assert torch.equal(exact.linear(x[100:101].to(device), weight, None, fp8="fp32"), whole[100:101])
    scale = 1 if device == "cuda" else 32
    m, n, kk = 1024 // scale, LLAMA_8B["down"][0] // scale, LLAMA_8B["down"][1] // scale
    a = torch.randn(m, kk, device=device)
    b = exact.prepared_weight(torch.randn(n, kk, device=device), fp8="fp32", dtype=torch.float32)
    b16 = torch.randn(n, kk, device=device, dtype=torch.bfloat16)
    exact_ms = elapsed_ms(lambda: exact.linear(a, b, None, fp8="fp32"), repeat=3)
    bf16_ms = elapsed_ms(lambda: a.bfloat16() @ b16.t())
    return (
        f"{sum(t.numel() for t in cpu):,} values bit-identical on {device} and the CPU; a row alone = in "
        f"a batch; an exact FP8 linear {m}x{n}x{kk}: {exact_ms:.1f} ms, {exact_ms / bf16_ms:.0f}x bf16"
    )


LLAMA_8B_LAYER = {  # (out, in) of one decoder layer's linears, unfused as a checkpoint names them
    "self_attn.q_proj": (4096, 4096),
    "self_attn.k_proj": (1024, 4096),
    "self_attn.v_proj": (1024, 4096),
    "self_attn.o_proj": (4096, 4096),
    "mlp.gate_proj": (14336, 4096),
    "mlp.up_proj": (14336, 4096),
    "mlp.down_proj": (4096, 14336),
}

# The receiving worker: a process of its own, given the plane, the plan and (broadcast) the rendezvous
# on stdin; it answers each loaded tensor's fingerprint and how long receiving and checking took.
RECEIVER = """
import pickle, sys, time, torch
from fp8rl.codec import device_planes as planes
plane, device, info, init = pickle.load(sys.stdin.buffer)
device = torch.device(device)
if device.type == "cuda":
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    torch.cuda.set_device(device)
receiver = (planes.IpcReceiver if plane == "ipc" else planes.BroadcastReceiver)(device, max_bytes=1 << 36)
if init is not None:
    receiver.init_transfer_engine(init)
    print("joined", flush=True)
    sys.stdin.readline()
loaded = []
start = time.perf_counter()
receiver.receive_weights(info, loaded.extend)
if device.type == "cuda":
    torch.cuda.synchronize()
seconds = time.perf_counter() - start
prints = [(n, planes.fingerprint(t.contiguous().view(-1).view(torch.uint8))) for n, t in loaded]
sys.stdout.buffer.write(pickle.dumps((seconds, prints)))
"""


def layer_set(device: str, scale: int) -> list[tuple[str, torch.Tensor]]:
    """One Llama-3.1-8B decoder layer (its shapes divided by ``scale``) quantized on ``device`` as the
    trainer publishes it: FP8 codes and float32 block scales per linear."""
    g = torch.Generator(device=device).manual_seed(9)
    named = []
    for module, (n, k) in LLAMA_8B_LAYER.items():
        codes, scales = quant.quantize_blockwise(
            torch.randn(n // scale, k // scale, generator=g, device=device)
        )
        named += [
            (f"model.layers.0.{module}.weight", codes),
            (f"model.layers.0.{module}.weight_scale_inv", scales),
        ]
    return planes.named_tensors(named)


def receive_in_another_process(
    plane: str,
    device: str,
    info: planes.UpdateInfo,
    sender: planes.BroadcastSender | None = None,
    named: list[tuple[str, torch.Tensor]] | None = None,
) -> tuple[float, list]:
    """Run RECEIVER for ``plane`` on ``device``: what it took, and each tensor's fingerprint there. A
    broadcast's ``sender`` forms the group with it, then sends ``named``."""
    init = sender.init if sender is not None else None
    child = subprocess.Popen(
        [sys.executable, "-c", RECEIVER],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(pickle.dumps((plane, device, info, init)))
        child.stdin.flush()
        if sender is not None and named is not None:
            sender.trainer_init()  # (returns once the child has joined)
            assert child.stdout.readline().strip() == b"joined"
            child.stdin.write(b"go\n")
            child.stdin.flush()
            sender.send_weights(named, info)
        out, _ = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, f"the receiving process exited {child.returncode}"
    return pickle.loads(out)


def device_planes() -> str:
    device = gpu_device()
    scale = 1 if device == "cuda" else 8  # (the dry run moves an eighth of each dimension)
    named = layer_set(device, scale)
    want = [(n, planes.fingerprint(t.contiguous().view(-1).view(torch.uint8))) for n, t in named]
    total = sum(t.numel() * t.element_size() for _, t in named)
    copy_ms = elapsed_ms(lambda: [t.clone() for _, t in named], repeat=5)
    figures = [f"{total / 1e9:.3f} GB ({len(named)} tensors); a copy on the device {copy_ms:.1f} ms"]
    if device == "cuda":
        sender = planes.IpcSender(torch.device("cuda", torch.cuda.current_device()))
        start = time.perf_counter()
        info = sender.send_weights(named, bucket_bytes=256 << 20)
        torch.cuda.synchronize()
        send_s = time.perf_counter() - start
        seconds, got = receive_in_another_process("ipc", device, info)
        sender.release()
        assert got == want, "CUDA IPC: a tensor did not arrive as sent"
        figures.append(
            f"CUDA IPC into another process bit for bit: packed {send_s * 1e3:.1f} ms, received and "
            f"checked {seconds * 1e3:.1f} ms ({total / seconds / 1e9:.1f} GB/s, "
            f"{copy_ms / (seconds * 1e3):.2f} of the copy's speed)"
        )
    else:
        figures.append("CUDA IPC: not on a CPU")
    if device == "cuda" and torch.cuda.device_count() < 2:
        figures.append("NCCL broadcast: one GPU (NCCL takes one rank per device)")
        return "; ".join(figures)
    backend, other = ("nccl", "cuda:1") if device == "cuda" else ("gloo", "cpu")
    # (a receiver that never joins leaves NCCL's watchdog to end this process: the timeout bounds it)
    broadcaster = planes.BroadcastSender.listen("127.0.0.1", 2, backend=backend, device=device, timeout_s=120)
    info = broadcaster.plan(named, bucket_bytes=256 << 20)
    seconds, got = receive_in_another_process(backend, other, info, broadcaster, named)
    broadcaster.shutdown()
    assert got == want, f"{backend} broadcast: a tensor did not arrive as sent"
    figures.append(
        f"{backend.upper()} broadcast to {other} bit for bit: received and checked {seconds * 1e3:.1f} ms "
        f"({total / seconds / 1e9:.2f} GB/s)"
    )
    return "; ".join(figures)


def main(argv: list[str] | None = None) -> int:
    global GPU
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dry-run-on-cpu", action="store_true", help="run the CUDA checks on the CPU (a test)"
    )
    args = parser.parse_args(argv)
    if args.dry_run_on_cpu:
        GPU = "cpu"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        where = f"{torch.cuda.get_device_name()} (compute capability {major}.{minor})"
    else:
        where = "no CUDA device"
    dry = " -- DRY RUN ON THE CPU: tests this script, proves nothing" if args.dry_run_on_cpu else ""
    print(f"gpu_proof: Python {platform.python_version()}, torch {torch.__version__}, ", end="")
    print(f"CUDA {torch.version.cuda}, {where}{dry}", flush=True)
    start = time.perf_counter()
    check("a import chain", import_chain)
    check("b fp8rl.quant CUDA = CPU", cuda_equals_cpu)
    check("c pow2 fixed point of vLLM's re-quantization", pow2_fixed_point)
    check("d blockwise FP8 GEMM (scaled_mm 1x128 x 128x128)", blockwise_gemm)
    check("e per-slice FP8 GEMM (_scaled_mm)", sliced_gemm)
    check("f emulated FP8 trainer step CUDA = CPU", emulated_step)
    check("g FP8 vs BF16 GEMM time, Llama-3.1-8B shapes", gemm_times)
    check("h exact consistency's arithmetic CUDA = CPU", exact_cuda_equals_cpu)
    check("i device planes of weight updates (CUDA IPC, NCCL)", device_planes)
    counts = {word: sum(line.startswith(word) for line in results) for word in ("PASS", "FAIL", "SKIP")}
    summary = ", ".join(f"{count} {word}" for word, count in counts.items())
    print(f"gpu_proof: {summary} in {time.perf_counter() - start:.0f} s{dry}", flush=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
