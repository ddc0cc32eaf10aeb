"""FP8 linear layers for training, behind one interface (:func:`convert_linears`).

* ``emulated`` (anywhere): an autograd function that computes what Transformer Engine's
  ``Float8BlockScaling`` recipe computes, with :mod:`fp8rl.quant` in TE's arithmetic (under no_grad its
  forward alone). Each GEMM quantizes its operands as TE does, from high precision:

  ============  =====================================================================
  fprop  Y=XWᵀ  X rowwise (1x128 along K, per token), W in 128x128 blocks
  dgrad  dX=dYW dY rowwise (1x128 along N, per token), W in the same 128x128 blocks
  wgrad  dW=dYᵀX dY and X columnwise (1x128 along the tokens, per feature)
  ============  =====================================================================

  The weight codes are exactly those the WeightSet ships, so under the ``fp8`` recipe trainer and
  rollout compute with bit-identical FP8 weights. Like TE's GEMMs, each applies the FP32 scales in
  float32 and rounds once, to the compute dtype; the learner pads sequences to TE's 16 positions, so
  wgrad's 128-token groups are TE's. What still differs from TE: its tensor cores add with ~14 bits
  (fp8rl/accumulation.py), the emulation in float32; and a NaN or inf operand, which the emulation
  refuses (:class:`fp8rl.quant.NonFiniteError`, reported as a non-finite gradient) while TE's quantizer
  never raises (scale 1 for a non-finite amax, then a saturating cast: inf becomes ±448, NaN stays NaN).
  A NaN reaches the gradient norm under either, which skips the step; an inf is refused only by the
  emulation.
* ``te`` (CUDA with Transformer Engine >= 2.3): ``te.Linear`` under the ``Float8BlockScaling`` recipe,
  its scale format set on the recipe object (:func:`block_scaling_recipe`).

Only linears inside the transformer blocks are converted; embeddings, lm_head, norms and attention stay
in the compute dtype. Parameter names do not change.

Mixture-of-experts layers (transformers' fused experts, ``mlp.experts.gate_up_proj`` [E, 2I, H] and
``mlp.experts.down_proj`` [E, H, I]) run the dense contract per expert: its own 128x128 weight blocks
(with I a multiple of 128, the plan's condition for FP8 experts, the blocks of ``gate_up_proj[e]`` are
exactly those of the gate and up weights the WeightSet ships per expert), the expert's tokens, in
sequence order, as the activations and, for wgrad, the 128-token columnwise groups. The master weights
stay the fused float32 parameters under both backends (checkpoints, optimizer state and publishing see
transformers' names); the router (``mlp.gate``, not an ``nn.Linear``) is never converted.

* ``emulated``: every expert's two GEMMs through :func:`fp8_linear` with that expert's 2-D slice of the
  fused parameter as the weight (:class:`EmulatedFP8Experts`).
* ``te``: each of the two GEMMs is one ``te.GroupedLinear`` call over all experts
  (:class:`TEFP8Experts`), whose per-expert weights are, for that call, the expert slices of the fused
  parameters (``torch.func.functional_call``); the GroupedLinear is built on the meta device and owns
  nothing. Its split-quantize path quantizes each expert's rows apart, as the emulation does, and TE's
  own tests hold it bit-identical to one ``te.Linear`` per expert under ``Float8BlockScaling``. Each
  expert's rows are padded to a multiple of 16 with zero rows (TE's FP8 GEMM rule, te.Fp8Padding's
  alignment), which changes no scale: a zero row has its own 1x128 scales and adds nothing to a
  column's amax. Refused, with the layer and the reason (:func:`te_experts_refusal`): a Transformer
  Engine older than 2.3 or not importable, and H or I not a multiple of 16.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Collection, Iterator
from typing import Any, Literal

import torch
import torch.nn.functional as F

from fp8rl import quant
from fp8rl.architectures import EXPERT_GEMMS, is_router
from fp8rl.quant import ScaleFormat

Backend = Literal["emulated", "te"]


class _FP8LinearFunction(torch.autograd.Function):
    """Each GEMM runs in float32 over the dequantized operands and is cast to the compute dtype once, as
    TE's cuBLAS GEMMs apply the FP32 scales to an FP32 accumulator and round only the output: casting the
    dequantized operands to bf16 first would round every value a second time. (TE's tensor cores add
    with ~14 bits, fp8rl/accumulation.py; float32 adds with 24: the one difference left in a GEMM.)"""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale_format: ScaleFormat
    ) -> torch.Tensor:
        y, x32, wq = _fprop(x, weight, bias, scale_format)
        # wgrad's X: the same activations quantized along the other axis (128 tokens per feature); not
        # made when no weight gradient is wanted (a frozen weight).
        x_columnwise = x.new_empty(0, dtype=torch.float32)
        if ctx.needs_input_grad[1]:
            x_columnwise = quant.fake_quantize_columnwise(
                x32.reshape(-1, x.shape[-1]), scale_format=scale_format
            )
        ctx.save_for_backward(x_columnwise, wq)
        ctx.has_bias, ctx.scale_format, ctx.compute = bias is not None, scale_format, y.dtype
        ctx.nonfinite_passes = quant.nonfinite_passing()  # the backward may run on another thread
        return y

    @staticmethod
    def backward(
        ctx: Any, dy: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, None]:
        x_columnwise, wq = ctx.saved_tensors
        fmt = ctx.scale_format
        if ctx.nonfinite_passes:
            with quant.nonfinite_passes():
                return _FP8LinearFunction._backward(ctx, dy, x_columnwise, wq, fmt)
        return _FP8LinearFunction._backward(ctx, dy, x_columnwise, wq, fmt)

    @staticmethod
    def _backward(
        ctx: Any, dy: torch.Tensor, x_columnwise: torch.Tensor, wq: torch.Tensor, fmt: ScaleFormat
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, None]:
        # The straight-through estimator for the fake quantizers; dY quantized per GEMM, as TE does.
        dy32 = dy.float()
        with torch.autocast(dy.device.type, enabled=False):
            dx = (quant.fake_quantize_activation(dy32, scale_format=fmt) @ wq).to(ctx.compute)
            dw = None
            if ctx.needs_input_grad[1]:
                dy_columnwise = quant.fake_quantize_columnwise(
                    dy32.reshape(-1, dy.shape[-1]), scale_format=fmt
                )
                dw = dy_columnwise.t() @ x_columnwise
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
        return dx, dw, db, None


def _fprop(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale_format: ScaleFormat
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward GEMM in the compute dtype (autocast's, else ``x``'s); ``x`` as float32 (wgrad's
    columnwise X is quantized from it) and the dequantized weight (dgrad's)."""
    device = x.device.type
    compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    x32 = x.float()
    xq = quant.fake_quantize_activation(x32, scale_format=scale_format)
    wq = quant.fake_quantize_weight(weight.detach().float(), scale_format=scale_format)
    with torch.autocast(device, enabled=False):  # (float32 GEMM, TE's epilogue adds the bias)
        y = F.linear(xq, wq, None if bias is None else bias.float())
    return y.to(compute), x32, wq


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale_format: ScaleFormat = "fp32",
) -> torch.Tensor:
    """``y = dq(q(x)) · dq(q(W))ᵀ + b`` with blockwise-FP8 fake quantization, and TE's quantization of
    every backward GEMM. Under no_grad (scoring) the forward GEMM alone: an autograd function's
    ``needs_input_grad`` follows ``requires_grad``, not grad mode, so it would quantize wgrad's operand
    for a backward that never runs."""
    if not torch.is_grad_enabled():
        return _fprop(x, weight, bias, scale_format)[0]
    return _FP8LinearFunction.apply(x, weight, bias, scale_format)


class EmulatedFP8Linear(torch.nn.Linear):
    """An ``nn.Linear`` whose matmul runs through :func:`fp8_linear`."""

    scale_format: ScaleFormat = "fp32"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.scale_format)


class EmulatedFP8Experts(torch.nn.Module):
    """Mixed into transformers' fused experts class (:func:`convert_linears`): the same routing
    arithmetic as its eager forward (act(gate) * up, down, times the routing weight, summed per token),
    every GEMM through :func:`fp8_linear`."""

    scale_format: ScaleFormat = "fp32"
    gate_up_proj: torch.nn.Parameter
    down_proj: torch.nn.Parameter
    act_fn: Any

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``hidden_states`` [T, H]; ``top_k_index`` [T, k] (int, experts chosen per token);
        ``top_k_weights`` [T, k] (their routing weights) -> [T, H] in ``hidden_states``' dtype."""
        out = torch.zeros_like(hidden_states)
        experts = self.gate_up_proj.shape[0]
        for expert in torch.unique(top_k_index).tolist():
            if not 0 <= expert < experts:  # (transformers marks dropped slots with E)
                continue
            tokens, slot = torch.where(top_k_index == expert)  # (sequence order)
            gate, up = fp8_linear(
                hidden_states[tokens], self.gate_up_proj[expert], None, self.scale_format
            ).chunk(2, dim=-1)
            y = fp8_linear(self.act_fn(gate) * up, self.down_proj[expert], None, self.scale_format)
            out.index_add_(0, tokens, (y * top_k_weights[tokens, slot, None]).to(out.dtype))
        return out


TE_ROW_MULTIPLE = 16
"""Rows each expert's share of a grouped GEMM is padded to under ``te`` (TE's FP8 GEMMs take a token
count that is a multiple of 8; te.Fp8Padding aligns to 16)."""
TE_MIN_VERSION = (2, 3)  # the first Transformer Engine with Float8BlockScaling


def expert_rows(
    top_k_index: torch.Tensor, experts: int, multiple: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The rows of a grouped expert GEMM: expert by expert, each expert's tokens in sequence order, then
    padding rows up to a multiple of ``multiple``. ``top_k_index`` [T, k] (the experts each token
    chose; an index outside [0, E) marks a dropped slot, as transformers does, and is skipped). Returns
    ``rows`` [R] (int64: each row's token, T for padding), ``slots`` [R] (the top-k slot that chose the
    row's expert; 0 for padding) and the rows of each expert (E ints, multiples of ``multiple``; 0 for
    an expert no token chose), R their sum."""
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    chosen = torch.nonzero((flat >= 0) & (flat < experts)).flatten()  # token-major: sequence order
    expert = flat[chosen]
    order = torch.argsort(expert, stable=True)  # (stable: each expert's tokens stay in sequence order)
    chosen, expert = chosen[order], expert[order]
    counts = torch.bincount(expert, minlength=experts)
    padded = (counts + multiple - 1) // multiple * multiple
    rank = torch.arange(len(expert), device=flat.device) - (counts.cumsum(0) - counts)[expert]
    at = (padded.cumsum(0) - padded)[expert] + rank
    rows = torch.full((int(padded.sum()),), tokens, dtype=torch.long, device=flat.device)
    slots = torch.zeros_like(rows)
    rows[at], slots[at] = chosen // k, chosen % k
    return rows, slots, padded.tolist()


class TEFP8Experts(torch.nn.Module):
    """Mixed into transformers' fused experts class under ``te`` (:func:`convert_linears`): the routing
    arithmetic of :class:`EmulatedFP8Experts`, each GEMM one ``te.GroupedLinear`` call over every
    expert with the fused parameters' expert slices as its weights (module docstring)."""

    gate_up_proj: torch.nn.Parameter
    down_proj: torch.nn.Parameter
    act_fn: Any
    te_gemms: tuple[Any, Any]
    """The gate_up and down GroupedLinears, on the meta device; a tuple, so not submodules: they add no
    parameters or state to the model."""

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """As :meth:`EmulatedFP8Experts.forward`: [T, H], [T, k], [T, k] -> [T, H]."""
        tokens = hidden_states.shape[0]
        rows, slots, splits = expert_rows(top_k_index, self.gate_up_proj.shape[0], TE_ROW_MULTIPLE)
        x = F.pad(hidden_states, (0, 0, 0, 1))[rows]  # (row T is zeros: the padding)
        gate, up = self.grouped_gemm(0, self.gate_up_proj, x, splits).chunk(2, dim=-1)
        y = self.grouped_gemm(1, self.down_proj, self.act_fn(gate) * up, splits)
        real = rows < tokens
        token = rows[real]
        weighted = y[real] * top_k_weights[token, slots[real], None]
        return torch.zeros_like(hidden_states).index_add_(0, token, weighted.to(hidden_states.dtype))

    def grouped_gemm(
        self, which: int, weight: torch.Tensor, x: torch.Tensor, splits: list[int]
    ) -> torch.Tensor:
        """``x`` [R, K] cut into ``splits`` rows per expert, expert e's rows times ``weight[e]`` [N, K]ᵀ:
        [R, N] (gradients flow into ``weight``, the fused parameter)."""
        views = {f"weight{e}": weight[e] for e in range(weight.shape[0])}
        return torch.func.functional_call(self.te_gemms[which], views, (x, splits))


def te_experts_refusal(te_version: str, hidden: int, intermediate: int) -> str | None:
    """Why Transformer Engine ``te_version`` cannot run experts of hidden size H and intermediate size
    I in blockwise FP8 (te.GroupedLinear under Float8BlockScaling), or None if it can."""
    found = re.match(r"(\d+)\.(\d+)", te_version)
    if found is None or tuple(map(int, found.groups())) < TE_MIN_VERSION:
        return f"Transformer Engine {te_version} is older than 2.3 (no Float8BlockScaling)"
    if hidden % 16 or intermediate % 16:
        return f"H = {hidden} and I = {intermediate} must be multiples of 16 (TE's FP8 GEMMs)"
    return None


def _te_gemms(name: str, module: Any) -> tuple[Any, Any]:
    """The gate_up and down GroupedLinears for ``module``'s experts, or ValueError saying why not."""
    experts, rows, hidden = module.gate_up_proj.shape
    try:
        import transformer_engine
        import transformer_engine.pytorch as te
    except ImportError as exc:
        raise _te_experts_refused(name, f"Transformer Engine does not import ({exc})") from exc
    reason = te_experts_refusal(transformer_engine.__version__, hidden, rows // 2)
    if reason is not None:
        raise _te_experts_refused(name, reason)
    dtype = module.gate_up_proj.dtype

    def grouped(k: int, n: int) -> Any:  # (owns no weights: each call brings them)
        return te.GroupedLinear(experts, k, n, bias=False, params_dtype=dtype, device="meta")

    return grouped(hidden, rows), grouped(rows // 2, hidden)


def _te_experts_refused(name: str, reason: str) -> ValueError:
    return ValueError(
        f"{name}: MoE experts cannot run in FP8 under fp8_backend te: {reason}; use fp8_backend: emulated"
    )


_MIXED_CLASSES: dict[tuple[type, type], type] = {}


def mixed_class(mixin: type, cls: type) -> type:
    """A transformers class (experts, router) with ``mixin``'s forward mixed in (one per pair)."""
    name = f"{mixin.__name__.removesuffix('Experts')}{cls.__name__}"
    return _MIXED_CLASSES.setdefault((mixin, cls), type(name, (mixin, cls), {}))


def block_experts(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """The fused expert modules inside the transformer blocks (``model.layers.N.mlp.experts``): a 3-D
    ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], in transformers' default layout."""
    for name, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)):
            continue
        if gate_up.ndim != 3 or ".layers." not in f".{name}.":
            continue
        layout = {k: getattr(module, k, d) for k, d in (("is_transposed", False), ("has_bias", False))}
        if any(layout.values()) or not getattr(module, "is_concatenated", True):
            raise ValueError(f"{name}: experts in a layout fp8rl does not convert ({layout})")
        yield name, module


def block_linears(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Linear]]:
    """The linear layers inside the transformer blocks (the ones the FP8 recipe quantizes); never a
    router (an ``nn.Linear`` in some MoE families: fp8rl.architectures.ROUTERS)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}." and not is_router(name):
            yield name, module


def resolve_backend(requested: str, cuda: bool | None = None) -> Backend:
    """``auto`` -> ``te`` on CUDA, ``emulated`` elsewhere. On CUDA without an importable Transformer
    Engine ``auto`` fails: training there with the emulation is slow and is only done when asked for."""
    if requested in ("emulated", "te"):
        return requested  # type: ignore[return-value]
    if not (torch.cuda.is_available() if cuda is None else cuda):
        return "emulated"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            f"fp8_backend auto: CUDA is present but Transformer Engine cannot be imported ({exc}); use the "
            "trainer GPU image (Dockerfile.trainer-gpu) or install the gpu-trainer extra, or set "
            "fp8_backend: emulated to train with the emulation on purpose"
        ) from exc
    return "te"


def convert_linears(
    model: torch.nn.Module,
    backend: Backend,
    scale_format: ScaleFormat = "fp32",
    high_precision: Collection[str] = frozenset(),
) -> int:
    """Swap every block linear but ``high_precision`` (module names: fp8rl.architectures) for its FP8
    version in place, and every MoE layer's fused experts whose per-expert names
    (``...mlp.experts.{e}.gate_proj``, ...) are not in ``high_precision``; returns how many linears were
    converted, an expert's gate, up and down counting as three. (Under ``te`` the scale format is the
    recipe's, :func:`fp8_context`.)"""
    converted = [(n, m) for n, m in block_linears(model) if n not in high_precision]
    experts = [(n, m) for n, m in block_experts(model) if _experts_in_fp8(n, m, high_precision)]
    te_gemms = [_te_gemms(n, m) for n, m in experts] if backend == "te" else []  # (refused: nothing changed)
    for _, linear in converted:
        if backend == "emulated":
            linear.__class__ = EmulatedFP8Linear
            linear.scale_format = scale_format  # type: ignore[assignment]
        else:
            _to_te_linear(model, linear)
    for i, (_, module) in enumerate(experts):
        if backend == "te":
            module.__class__ = mixed_class(TEFP8Experts, type(module))
            module.te_gemms = te_gemms[i]
        else:
            module.__class__ = mixed_class(EmulatedFP8Experts, type(module))
            module.scale_format = scale_format
    return len(converted) + sum(len(EXPERT_GEMMS) * m.gate_up_proj.shape[0] for _, m in experts)


def _experts_in_fp8(name: str, module: Any, high_precision: Collection[str]) -> bool:
    """All of a layer's experts are FP8 or none is (vLLM quantizes a fused MoE layer whole)."""
    names = [f"{name}.{e}.{g}" for e in range(module.gate_up_proj.shape[0]) for g in EXPERT_GEMMS]
    kept = sum(n in high_precision for n in names)
    if kept not in (0, len(names)):
        raise ValueError(f"{name}: {kept} of its {len(names)} expert linears in high precision; all or none")
    return kept == 0


def _to_te_linear(model: torch.nn.Module, linear: torch.nn.Linear) -> None:
    import transformer_engine.pytorch as te

    if linear.in_features % 16 or linear.out_features % 16:  # TE's FP8 GEMMs need K, N % 16 == 0
        raise ValueError(
            f"a {linear.in_features}x{linear.out_features} linear cannot run in Transformer Engine FP8 "
            "(both dimensions must be multiples of 16); use fp8_backend: emulated"
        )

    replacement = te.Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        params_dtype=linear.weight.dtype,
        device=linear.weight.device,
    )
    with torch.no_grad():
        replacement.weight.copy_(linear.weight)
        if linear.bias is not None:
            replacement.bias.copy_(linear.bias)
    parent_name, _, child = next(n for n, m in model.named_modules() if m is linear).rpartition(".")
    setattr(model.get_submodule(parent_name), child, replacement)


QUANTIZERS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")


@functools.cache
def block_scaling_recipe(power_2_scales: bool = False) -> Any:
    """TE's ``Float8BlockScaling`` (X and dY 1x128, W 128x128, E4M3) with its scale format set on the
    recipe object: FP32 scales (the study's) unless ``power_2_scales`` (UE8M0, the ``pow2`` format).

    TE reads ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` once, into class defaults, when its recipe module is
    imported; setting the variable any later changes nothing, so the quantizer parameters are replaced
    here and checked on the object in force. Under pow2 the weight quantizer floors the amax at vLLM's
    re-quantization floor (:func:`amax_epsilon`), so the trainer computes with the values vLLM holds.
    """
    from transformer_engine.common.recipe import Float8BlockScaling, QParams

    scale_format: ScaleFormat = "pow2" if power_2_scales else "fp32"
    recipe = Float8BlockScaling()
    for name in QUANTIZERS:
        epsilon = amax_epsilon(2 if name == "fp8_quant_fwd_weight" else 1, scale_format)
        setattr(recipe, name, QParams(power_2_scale=power_2_scales, amax_epsilon=epsilon))
    in_force = {name: getattr(recipe, name).power_2_scale for name in QUANTIZERS}
    if set(in_force.values()) != {power_2_scales}:
        raise RuntimeError(f"Transformer Engine kept other scale formats than asked: {in_force}")
    return recipe


def amax_epsilon(block_scaling_dim: int, scale_format: ScaleFormat) -> float:
    """The amax floor of TE's quantizer for 1x128 (1) or 128x128 (2) tiles: fp8rl.quant's, i.e. none,
    save for pow2 weights (:data:`fp8rl.quant.DEEPGEMM_AMAX_FLOOR`)."""
    return quant.DEEPGEMM_AMAX_FLOOR if block_scaling_dim == 2 and scale_format == "pow2" else 0.0


def te_quantizer(block_scaling_dim: int, rowwise: bool, scale_format: ScaleFormat) -> Any:
    """Transformer Engine's own blockwise quantizer (1: 1x128 tiles, rowwise or columnwise; 2: 128x128),
    with the amax epsilon and scale format of :func:`block_scaling_recipe`: for checks against
    :mod:`fp8rl.quant`."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    return Float8BlockQuantizer(
        tex.DType.kFloat8E4M3,
        rowwise=rowwise,
        columnwise=not rowwise,
        amax_epsilon=amax_epsilon(block_scaling_dim, scale_format),
        force_pow_2_scales=scale_format == "pow2",
        block_scaling_dim=block_scaling_dim,
    )


def fp8_context(
    backend: Backend | None, scale_format: ScaleFormat = "fp32"
) -> contextlib.AbstractContextManager[Any]:
    """The context the forward (and backward) pass runs in: TE's FP8 autocast with the blockwise recipe
    in ``scale_format`` for ``te``; nothing otherwise (the emulated layers quantize themselves)."""
    if backend != "te":
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te

    recipe = block_scaling_recipe(power_2_scales=scale_format == "pow2")
    if hasattr(te, "autocast"):  # TE >= 2.9; fp8_autocast is deprecated there
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)
