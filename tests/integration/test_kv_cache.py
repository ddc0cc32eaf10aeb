"""FP8 attention over the FP8 KV cache of the `-kv` recipes: scales and rounding against float32
references, the trainer's emulation and calibration against Q, K and V recomputed here, and the scales
surviving a checkpoint. (The rollout's emulation in real vLLM, and the two engines' agreement:
tests/integration/test_consistency.py.)"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8rl import quant
from fp8rl.recipes import get_recipe
from fp8rl.sampling import SamplingSettings
from tests.support import trainer_config
from trainer_service.learner import Learner, SampleData

F32 = np.float32


def test_kv_cache_scale_is_amax_over_448_or_the_power_of_two_above() -> None:
    gen = torch.Generator().manual_seed(1)
    amax = torch.rand(5000, generator=gen) * torch.logspace(-30, 30, 5000)
    got = quant.kv_cache_scale(amax)
    want = torch.from_numpy(np.array([F32(a) / F32(448.0) for a in amax.numpy()], dtype=F32))
    assert torch.equal(got, want)  # (IEEE float32 division: one rounding)
    pow2 = quant.kv_cache_scale(amax, "pow2")
    for a, s in zip(amax.tolist(), pow2.tolist(), strict=True):
        assert s == 2.0 ** math.ceil(math.log2(float(F32(a) / F32(448.0)))) or (
            math.frexp(float(F32(a) / F32(448.0)))[0] == 0.5 and s == float(F32(a) / F32(448.0))
        )
    # Nothing measured (zero, NaN, inf): vLLM's 1.0; a subnormal amax still gives a positive scale.
    edge = quant.kv_cache_scale(torch.tensor([0.0, math.nan, math.inf, -math.inf, 1e-44]))
    assert edge[:4].tolist() == [1.0] * 4 and edge[4] > 0
    with pytest.raises(ValueError, match="scale format"):
        quant.kv_cache_scale(amax, "ue8m0")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quantize_kv_is_vllms_cache_write_then_read(dtype: torch.dtype) -> None:
    """``code = sat(x / scale)`` in float32, then ``code * scale``, bit for bit; ties and saturation
    included."""
    gen = torch.Generator().manual_seed(2)
    scale = torch.tensor(0.0137, dtype=torch.float32)
    x = torch.randn(4, 2, 33, 64, generator=gen) * 3
    x.view(-1)[:8] = torch.tensor([1e4, -1e4, 0.0, -0.0, 448 * 0.0137 * 2, 1e-30, 7.0, -7.0])
    # Exact midpoints between neighbouring E4M3 values (times the scale): rounding ties.
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[:-1] + grid[1:]) / 2 * scale
    x.view(-1)[8 : 8 + len(mids)] = mids
    x = x.to(dtype)
    got = quant.fake_quantize_kv(x, scale)
    a = x.float().numpy()
    codes = torch.from_numpy(np.clip(a / F32(scale.item()), -448.0, 448.0)).to(torch.float8_e4m3fn)
    want = torch.from_numpy(codes.float().numpy() * F32(scale.item())).to(dtype)
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert (got.float().abs() <= 448 * scale + 1e-6).all()


def test_fake_quantize_query_is_vllms_static_quantizer() -> None:
    """The query: ``code = sat(x * (1 / scale))`` in float32 (vLLM multiplies by the reciprocal), read
    back as ``code * scale``, bit for bit."""
    gen = torch.Generator().manual_seed(4)
    scale = torch.tensor(0.0191, dtype=torch.float32)
    x = (torch.randn(3, 4, 17, 64, generator=gen) * 4).to(torch.bfloat16)
    x.view(-1)[:4] = torch.tensor([1e4, -1e4, 0.0, 1e-30])
    got = quant.fake_quantize_query(x, scale)
    inverse = F32(1.0) / F32(scale.item())
    codes = torch.from_numpy(np.clip(x.float().numpy() * inverse, -448.0, 448.0)).to(torch.float8_e4m3fn)
    want = torch.from_numpy(codes.float().numpy() * F32(scale.item())).to(torch.bfloat16)
    assert torch.equal(got.view(torch.uint16), want.view(torch.uint16))
    # It is not the cache's division: on values at E4M3 rounding ties the two round apart somewhere.
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ties = ((grid[:-1] + grid[1:]) / 2)[None] * (torch.rand(64, 1, generator=gen) + 0.5)
    scales = ties[:, :1] / ((grid[1] + grid[2]) / 2)
    assert not torch.equal(quant.fake_quantize_query(ties, scales), quant.fake_quantize_kv(ties, scales))


def learner(model: Path, recipe: str = "fp8-kv", **overrides: object) -> Learner:
    config = trainer_config(model, recipe, micro_batch_size=2, **overrides)  # type: ignore[arg-type]
    return Learner(config, get_recipe(recipe))


def samples() -> list[SampleData]:
    """Six sequences of different lengths (the shorter ones padded in a batch), two groups."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for i in range(6):
        prompt = torch.randint(4, 200, (3 + i,), generator=gen).tolist()
        completion = torch.randint(4, 200, (2 + 2 * (i % 3),), generator=gen).tolist()
        out.append(SampleData(prompt, completion, [-5.0] * len(completion), float(i % 2), str(i // 3)))
    return out


def attention_inputs(learn: Learner, batch_samples: list[SampleData]) -> list[tuple[torch.Tensor, ...]]:
    """Per layer: Q and K after RoPE and V, [B, heads, L, head dim], recomputed from the projections'
    outputs in a forward of the learner's model, and the batch's real-token mask."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    model = learn.model
    batch = learn.collate(batch_samples)
    cfg = model.config
    dim = cfg.hidden_size // cfg.num_attention_heads
    captured: dict[str, list[torch.Tensor]] = {}  # per projection, its outputs micro-batch by micro-batch
    hooks = [
        getattr(layer.self_attn, proj).register_forward_hook(
            lambda _m, _i, out, key=f"{i}.{proj}": captured.setdefault(key, []).append(out.detach())
        )
        for i, layer in enumerate(model.model.layers)
        for proj in ("q_proj", "k_proj", "v_proj")
    ]
    try:
        learn.score(batch, SamplingSettings())
    finally:
        for hook in hooks:
            hook.remove()
    b, length = batch.input_ids.shape
    positions = torch.arange(length)[None].expand(b, length)
    outputs = {key: torch.cat(parts) for key, parts in captured.items()}
    cos, sin = model.model.rotary_emb(outputs["0.k_proj"], positions)
    out = []
    for i in range(cfg.num_hidden_layers):
        q, k, v = (
            outputs[f"{i}.{p}"].view(b, length, -1, dim).transpose(1, 2)
            for p in ("q_proj", "k_proj", "v_proj")
        )
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out.append((q, k, v, batch.attention_mask.bool()[:, None, :, None]))
    return out


def test_trainer_calibrates_next_scales_on_the_steps_real_tokens(tiny_model_dir_f32: Path) -> None:
    """After a step, each layer's q/k/v scale is amax(|Q|) / 448, amax(|K|) / 448 and amax(|V|) / 448 over
    the real tokens of the step's sequences (Q and K after RoPE, as the rollout's attention gets them),
    computed with the weights that scored them; padding does not count. Version 0's scales are 1.0. Under
    pow2 they are powers of two."""
    data = samples()
    for recipe in ("fp8-kv", "fp8-kv-pow2"):
        learn = learner(tiny_model_dir_f32, recipe)
        assert learn.kv_cache is not None and torch.equal(learn.kv_cache.scales, torch.ones(2, 3))
        want_amax, padded_amax = [], []
        for *inputs, real in attention_inputs(learn, data):
            want_amax.append([x.abs().masked_fill(~real, 0).amax() for x in inputs])
            padded_amax.append([x.abs().amax() for x in inputs])
        want_amax_t, padded_t = torch.tensor(want_amax), torch.tensor(padded_amax)
        # The batch is one where padding would change the amax: counting it is caught.
        assert not torch.equal(want_amax_t, padded_t)
        learn.train(data, SamplingSettings())
        scale_format = get_recipe(recipe).scale_format
        assert torch.equal(learn.kv_cache.scales, quant.kv_cache_scale(want_amax_t, scale_format))
        if scale_format == "fp32":  # (pow2 rounds both amaxes to one power of two)
            assert not torch.equal(learn.kv_cache.scales, quant.kv_cache_scale(padded_t, scale_format))
        assert torch.equal(learn.kv_cache.amax, torch.zeros(2, 3))  # the next step measures afresh
        published = dict(learn.published_weights())
        assert published["model.layers.1.self_attn.q_scale"] == learn.kv_cache.scales[1, 0]
        assert published["model.layers.1.self_attn.v_scale"] == learn.kv_cache.scales[1, 2]
        assert published["model.layers.0.self_attn.k_scale"].dtype == torch.float32
    unit = learner(tiny_model_dir_f32, kv_scales="unit")
    unit.train(data, SamplingSettings())
    assert unit.kv_cache is not None and torch.equal(unit.kv_cache.scales, torch.ones(2, 3))
    assert "model.layers.0.self_attn.k_scale" not in dict(
        learner(tiny_model_dir_f32, "fp8").published_weights()
    )


def test_trainer_attends_through_the_cache_with_the_held_scales(tiny_model_dir_f32: Path) -> None:
    """With the emulation the trainer's logprobs are those of attention over E4M3-rounded Q, K and V: equal
    to a forward whose attention is fed Q, K and V rounded here; without it, they are not; gradients pass
    straight through the rounding."""
    data = samples()
    emulated, plain = learner(tiny_model_dir_f32), learner(tiny_model_dir_f32, emulate_kv_cache=False)
    assert emulated.kv_cache is not None and plain.kv_cache is not None
    scales = torch.tensor([[0.01, 0.004, 0.002], [0.02, 0.003, 0.005]])  # small: Q, K, V saturate, visibly
    emulated.kv_cache.load(scales)
    plain.kv_cache.load(scales)
    batch, sampling = emulated.collate(data), SamplingSettings()
    with_cache, without = emulated.score(batch, sampling), plain.score(batch, sampling)
    support = batch.mask.bool()
    assert (with_cache - without)[support].abs().max() > 1e-3

    # The same attention, K and V rounded by a hook here (the reference), in the plain learner.
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounded(module, query, key, value, mask, **kwargs):  # type: ignore[no-untyped-def]
        i = module.layer_idx
        query = quant.fake_quantize_query(query, scales[i, 0])
        key = quant.fake_quantize_kv(key, scales[i, 1])
        value = quant.fake_quantize_kv(value, scales[i, 2])
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    AttentionInterface.register("test_rounded_kv", rounded)
    plain.model.set_attn_implementation("test_rounded_kv")
    reference = plain.score(batch, sampling)
    assert torch.equal(with_cache[support], reference[support])


def test_gradients_pass_straight_through_the_rounding() -> None:
    """Even where the rounding saturates (where a clamp's gradient would be zero)."""
    from trainer_service.kv_cache import _Rounded

    for query in (True, False):
        x = (torch.randn(2, 3, 5, 8) * 10).requires_grad_()
        y = _Rounded.apply(x, torch.tensor(0.001), query)
        assert (y.detach().abs() < x.detach().abs()).any()  # saturated somewhere
        (y * torch.arange(y.numel()).view_as(y)).sum().backward()
        assert torch.equal(x.grad, torch.arange(x.numel(), dtype=torch.float32).view_as(x))


def test_a_failed_step_records_nothing_and_the_reference_attends_alike(tiny_model_dir_f32: Path) -> None:
    """The next scales come from the step that succeeds alone (whatever an earlier one recorded is
    dropped); a KL reference model attends through the same FP8 attention, with the policy's scales."""
    clean, dirty = learner(tiny_model_dir_f32), learner(tiny_model_dir_f32, loss={"kl_coef": 0.01})
    assert clean.kv_cache is not None and dirty.kv_cache is not None and dirty.reference is not None
    assert all(
        m.fp8rl_kv_cache is dirty.kv_cache for m in dirty.reference.modules() if hasattr(m, "fp8rl_kv_cache")
    )
    dirty.kv_cache.amax.fill_(1e6)  # as a step that failed after scoring leaves it
    clean.train(samples(), SamplingSettings())
    dirty.train(samples(), SamplingSettings())
    assert torch.equal(clean.kv_cache.scales, dirty.kv_cache.scales)
    with pytest.raises(ValueError, match="positive"):
        clean.kv_cache.load(torch.zeros(2, 3))


def test_the_rollouts_hook_rounds_inputs_by_position_or_name_and_keeps_none() -> None:
    from types import SimpleNamespace

    from rollout_service.vllm_fp8 import _scales_in_force, _through_fp8_attention

    layer = SimpleNamespace(_q_scale_float=0.01, _k_scale_float=0.02, _v_scale_float=0.03)
    q, k, v = (torch.randn(4, 128) * 9 for _ in range(3))
    scale = torch.tensor
    want = (quant.fake_quantize_query(q, scale(0.01)), quant.fake_quantize_kv(k, scale(0.02)))
    args, kwargs = _through_fp8_attention(layer, (q, k), {"value": v, "output_shape": None})
    assert torch.equal(args[0], want[0]) and torch.equal(args[1], want[1])
    assert torch.equal(kwargs["value"], quant.fake_quantize_kv(v, scale(0.03)))
    assert kwargs["output_shape"] is None
    args, _ = _through_fp8_attention(layer, (q, None, None), {})
    assert args[1] is None and args[2] is None
    # vLLM's rule for scales a refit did not bring (-1).
    assert _scales_in_force(-1, -1, -1) == (1.0, 1.0, 1.0)
    assert _scales_in_force(0.5, 0.25, -1) == (0.5, 0.25, 0.25)
    assert _scales_in_force(-1, 0.25, 0.125) == (1.0, 0.25, 0.125)


def test_kv_scales_survive_a_checkpoint(tiny_model_dir_f32: Path, tmp_path: Path) -> None:
    from fp8rl.v1 import common_pb2, trainer_pb2
    from trainer_service.service import TrainerService

    config = trainer_config(tiny_model_dir_f32, "fp8-kv", checkpoint_dir=tmp_path)
    trainer = TrainerService(config)
    batch = [
        trainer_pb2.Sample(
            prompt_token_ids=s.prompt,
            completion_token_ids=s.completion,
            gen_logprobs=s.gen_logprobs,
            reward=s.reward,
            group_id=s.group,
        )
        for s in samples()
    ]
    trainer.train_step(
        trainer_pb2.TrainStepRequest(run_id="kv", step=0, samples=batch, sampling=common_pb2.SamplingParams())
    )
    assert trainer.learner.kv_cache is not None
    calibrated = trainer.learner.kv_cache.scales.clone()
    assert not torch.equal(calibrated, torch.ones(2, 3))
    resumed = TrainerService(config.model_copy(update={"resume": True}))
    assert resumed.step == 1 and resumed.learner.kv_cache is not None
    assert torch.equal(resumed.learner.kv_cache.scales, calibrated)
    # A checkpoint without scales (another recipe's, or one from before they were calibrated): 1.0.
    other = TrainerService(config.model_copy(update={"recipe": "fp8", "checkpoint_dir": tmp_path / "fp8"}))
    other.save_checkpoint()
    from_fp8 = TrainerService(config.model_copy(update={"resume": True, "checkpoint_dir": tmp_path / "fp8"}))
    assert from_fp8.learner.kv_cache is not None
    assert torch.equal(from_fp8.learner.kv_cache.scales, torch.ones(2, 3))
    for service in (trainer, resumed, other, from_fp8):
        service.publisher.close()
