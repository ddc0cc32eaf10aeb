"""Which tensors the rollout holds, under which names, in which dtype — and :func:`build_weight_set`, which
converts a model state dict (HF names) into them.

For ``fp8-block128`` (and ``-pow2``) every linear weight inside the transformer blocks ships as
``<module>.weight`` (float8_e4m3fn) plus ``<module>.weight_scale_inv`` (float32 block scales); under a
recipe with an FP8 KV cache, each layer's ``self_attn.q_scale``, ``k_scale`` and ``v_scale`` (float32
scalars); everything else in the high-precision dtype.

Mixture-of-experts layers ship per expert, under the checkpoint names vLLM's MoE loaders take:
transformers' fused ``mlp.experts.gate_up_proj`` [E, 2I, H] is split into
``mlp.experts.{e}.gate_proj.weight`` (rows [0, I) of expert e) and ``.up_proj.weight`` (rows [I, 2I)),
``mlp.experts.down_proj`` [E, H, I] into ``mlp.experts.{e}.down_proj.weight``; each is then a block
linear like any other (codes plus one 128x128 scale grid per expert under FP8). The router
``mlp.gate.weight`` is never a block linear: it ships in the high-precision dtype.
"""

from __future__ import annotations

import contextvars
from collections import deque
from collections.abc import Collection, Mapping
from concurrent.futures import Future, wait

import torch

from fp8rl import quant
from fp8rl.architectures import EXPERTS, is_router
from fp8rl.codec.weight_set import WeightSet, pool
from fp8rl.recipes import WEIGHT_FORMATS, WeightFormat, is_fp8, weight_scale_format

SCALE_SUFFIX = "weight_scale_inv"
ATTENTION_SCALES = ("q_scale", "k_scale", "v_scale")
"""The per-layer scales of FP8 attention, in this order: the query's and the KV cache's (vLLM's names)."""
_IN_FLIGHT = 4  # tensors converted or waiting at a time while a set is built (memory, not speed)


def is_block_linear(name: str, ndim: int) -> bool:
    """True for linear weights inside transformer blocks — the ones FP8 recipes quantize.

    Norms are 1-D, biases end in ``.bias``, and embeddings / lm_head live outside ``.layers.``. An MoE
    router (``model.layers.N.mlp.gate.weight``, matched by its exact module name: ``gate_proj`` and
    ``gate_up_proj`` are not routers; fp8rl.architectures.ROUTERS) is not one.
    """
    if name.endswith(".weight") and is_router(name.removesuffix(".weight")):
        return False
    return ndim == 2 and name.endswith(".weight") and ".layers." in name


FUSED_EXPERTS: dict[str, tuple[str, ...]] = {
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
"""transformers' fused 3-D expert parameters (``mlp.experts.<key>``) and the per-expert linears they
hold, in row order (gate first: transformers concatenates ``gate_proj`` then ``up_proj``, and its forward
takes ``chunk(2)`` as gate, up)."""


def split_experts(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """A fused expert parameter (``model.layers.N.mlp.experts.gate_up_proj`` [E, 2I, H] or
    ``...down_proj`` [E, H, I]) as per-expert 2-D weights under their checkpoint names, in expert order
    (views of ``t``); ``None`` for any other tensor."""
    prefix, _, fused = name.rpartition(".")
    if t.ndim != 3 or not prefix.endswith(f".{EXPERTS}") or fused not in FUSED_EXPERTS:
        return None
    parts = FUSED_EXPERTS[fused]
    rows = t.shape[1] // len(parts)
    if rows * len(parts) != t.shape[1]:
        raise ValueError(f"{name}: {t.shape[1]} rows do not split into {len(parts)} equal parts {parts}")
    return [
        (f"{prefix}.{e}.{part}.weight", t[e, i * rows : (i + 1) * rows])
        for e in range(t.shape[0])
        for i, part in enumerate(parts)
    ]


def is_fp8_linear(name: str, ndim: int, high_precision: Collection[str] = frozenset()) -> bool:
    """True for the block linears an FP8 format ships as codes and scales: all but ``high_precision``
    (module names, e.g. ``model.layers.0.self_attn.q_proj``)."""
    return is_block_linear(name, ndim) and name.removesuffix(".weight") not in high_precision


def attention_scale_names(attention_module: str) -> list[str]:
    """The names an attention module's scales ship under (``model.layers.0.self_attn.q_scale``, ...)."""
    return [f"{attention_module}.{scale}" for scale in ATTENTION_SCALES]


def is_attention_scale(name: str) -> bool:
    """True for the per-layer scales of FP8 attention (float32 scalars)."""
    return name.endswith(tuple(f".self_attn.{scale}" for scale in ATTENTION_SCALES))


def scale_name(weight_name: str) -> str:
    """The name an FP8 weight's block scales ship under (``....weight`` → ``....weight_scale_inv``)."""
    return weight_name.removesuffix("weight") + SCALE_SUFFIX


def build_weight_set(
    state_dict: Mapping[str, torch.Tensor],
    weight_format: WeightFormat,
    hp_dtype: torch.dtype = torch.bfloat16,
    high_precision: Collection[str] = frozenset(),
) -> WeightSet:
    """Convert a model state dict (HF names) to the rollout's format; fused expert parameters ship per
    expert (module docstring).

    ``hp_dtype`` is the dtype of every tensor that is not FP8 (bf16 normally; float32 for exactness
    checks). FP8 codes and scales are exactly :func:`fp8rl.quant.quantize_blockwise` of the weight, in
    the format's scale format. ``high_precision``: block linears (module names, as
    :class:`fp8rl.architectures.FP8Plan` keeps them) that ship in ``hp_dtype`` under an FP8 format.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r}; expected one of {WEIGHT_FORMATS}")
    scale_format = weight_scale_format(weight_format)

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        experts = split_experts(name, t)
        if experts is None:
            return convert_one(name, t)
        return {n: c for expert, w in experts for n, c in convert_one(expert, w).items()}

    def convert_one(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        # On the weight's own device, then to the host: a GPU quantizes fast and sends the host a quarter
        # of the bytes, and its codes equal the CPU's bit for bit (tests/unit/test_quant_gpu.py).
        if is_fp8(weight_format) and is_fp8_linear(name, t.ndim, high_precision):
            codes, scales = quant.quantize_blockwise(t, scale_format=scale_format)
            return {name: codes.cpu(), scale_name(name): scales.cpu()}
        if is_attention_scale(name):  # scales stay float32, as the engines use them
            return {name: t.to(torch.float32, copy=True).cpu().contiguous()}
        # Always a copy: a set must never alias live parameters the optimizer keeps changing.
        return {name: t.to(hp_dtype, copy=True).cpu().contiguous()}

    # Tensors are read in order on this thread (a sharded learner gathers each one, collectively, as it
    # is read). CPU tensors are converted on the pool (quantizing is many small torch ops: two tensors
    # at a time keep two cores busy), at most _IN_FLIGHT at a time, so that a gathered model is never
    # held whole. GPU tensors are converted on this thread: their kernels queue on the device anyway,
    # and a pool thread's current CUDA device is not this one's.
    out: dict[str, torch.Tensor] = {}
    workers, pending = pool(), deque[Future[dict[str, torch.Tensor]]]()
    try:
        for name, t in state_dict.items():
            t = t.detach()
            if t.device.type != "cpu":
                while pending:  # (in order)
                    out.update(pending.popleft().result())
                out.update(convert(name, t))
                continue
            # The caller's context (e.g. quant.nonfinite_passes) goes with the work to the pool's thread.
            pending.append(workers.submit(contextvars.copy_context().run, convert, name, t))
            while len(pending) >= _IN_FLIGHT:
                out.update(pending.popleft().result())
        while pending:
            out.update(pending.popleft().result())
    finally:
        for future in pending:  # after an error: nothing keeps converting once this returns
            future.cancel()
        wait(pending)
    return WeightSet(weight_format, out, owned=True)
