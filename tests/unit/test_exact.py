"""Exact mode's arithmetic (fp8rl/exact.py): each op is close to a float64 reference, and a row's result
is bit-identical however the row is batched, padded or laid out (fresh random inputs each run)."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl import exact, quant

DTYPES = (torch.float32, torch.bfloat16)


def test_exp_log_sincos_match_libm(gen: torch.Generator) -> None:
    x = torch.empty(100_003, dtype=torch.float64).uniform_(-700, 700, generator=gen)
    assert torch.allclose(exact.exp(x), torch.exp(x), rtol=4e-16, atol=0)
    small = torch.randn(10_001, dtype=torch.float64, generator=gen)
    assert torch.allclose(exact.exp(small), torch.exp(small), rtol=4e-16, atol=0)
    positive = torch.exp(torch.empty(100_003, dtype=torch.float64).uniform_(-700, 700, generator=gen))
    # (a log near 0 is only as precise as its argument near 1, whose half ulp is 1.1e-16: seed 4183634207
    # drew x = 1.0704..., where the two logs differ by 2.8e-17, 4.08e-16 of the result)
    assert torch.allclose(exact.log(positive), torch.log(positive), rtol=4e-16, atol=1.2e-16)
    angles = torch.empty(100_003, dtype=torch.float64).uniform_(-2e5, 2e5, generator=gen)
    sin, cos = exact.sincos(angles)
    assert (sin - torch.sin(angles)).abs().max() < 1e-11  # (the argument's own ulp at 2e5 is 3e-11)
    assert (cos - torch.cos(angles)).abs().max() < 1e-11
    x32 = torch.empty(100_003).uniform_(-87, 88, generator=gen)
    assert torch.allclose(exact.exp(x32).double(), torch.exp(x32.double()), rtol=2.5e-7, atol=0)
    near = torch.empty(10_001, dtype=torch.float64).uniform_(-4, 4, generator=gen)
    sin, cos = exact.sincos(near)
    assert (sin - torch.sin(near)).abs().max() < 1e-15 and (cos - torch.cos(near)).abs().max() < 1e-15


def test_elementwise_math_does_not_depend_on_the_tensor_around_a_value(gen: torch.Generator) -> None:
    """A value's exp is the same alone, in a vector tail, or inside a long vectorized run (libm's and
    the SIMD widths' exp differ in the last bit; these are built from correctly rounded ops)."""
    x = torch.randn(1037, dtype=torch.float64, generator=gen) * 30
    whole = exact.exp(x)
    for i in (0, 15, 16, 1000, 1036):
        assert torch.equal(exact.exp(x[i : i + 1]), whole[i : i + 1])
        assert torch.equal(exact.log(whole[i : i + 1]), exact.log(whole)[i : i + 1])
    assert torch.equal(exact.silu(x[::7].float()), exact.silu(x.float())[::7])


def test_fixed_point_keeps_23_bits_of_the_largest_value_with_a_power_of_two_scale(
    gen: torch.Generator,
) -> None:
    x = torch.randn(64, 128, generator=gen) * torch.exp(torch.randn(64, 1, generator=gen) * 5)
    q, scale = exact.fixed_point(x, exact.HIGH_PRECISION_BITS)
    assert bool((q.abs() <= 2**23).all()) and torch.equal(q, q.round())
    assert torch.equal(torch.frexp(scale)[0], torch.full_like(scale, 0.5))  # powers of two
    assert ((q * scale - x.double()).abs() <= scale / 2).all()
    assert bool((q.abs().amax(-1) >= 2**22).all())  # the largest value's 23 bits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [None, "fp32", "pow2"])
def test_linear_rows_are_exact_and_independent_of_the_batch(
    dtype: torch.dtype, fp8: quant.ScaleFormat | None, gen: torch.Generator
) -> None:
    """One row alone, inside a batch of 37 and inside one of 300 gives the same bits; every K-group's
    dot product is exact (against float64 of the same operands)."""
    k, n = 576, 320  # (4.5 groups of 128: a partial last group)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = (torch.randn(300, k, generator=gen) * torch.exp(torch.randn(300, 1, generator=gen))).to(dtype)
    bias = torch.randn(n, generator=gen)
    weight = exact.prepared_weight(w, fp8=fp8, dtype=dtype)
    whole = exact.linear(x, weight, bias, fp8=fp8)
    assert whole.dtype == dtype
    for rows in (slice(5, 6), slice(0, 37), slice(263, 300)):
        assert torch.equal(exact.linear(x[rows], weight, bias, fp8=fp8), whole[rows])
    assert torch.equal(exact.linear(x.view(10, 30, k), weight, bias, fp8=fp8), whole.view(10, 30, n))
    # Against the float64 GEMM of the same (dequantized) operands.
    if fp8 is None:
        xd = x.double()
        wd = w.to(dtype).double()
    else:
        xd = quant.fake_quantize_activation(x.float(), scale_format=fp8).double()
        wd = quant.fake_quantize_weight(w, scale_format=fp8).double()
    reference = xd @ wd.t() + bias.to(dtype).double()
    tolerance = 2e-6 if fp8 is None and dtype == torch.float32 else 1e-2
    assert (whole.double() - reference).abs().max() <= tolerance * reference.abs().max()
    if fp8 is not None:  # before rounding to the dtype, the FP8 GEMM is float64's of codes x scales
        codes, scale_inv = quant.quantize_activation(x.float(), scale_format=fp8)
        x64 = codes.double().view(300, -1) * scale_inv.double().repeat_interleave(128, -1)[:, :k]
        w_codes, w_scale = quant.quantize_blockwise(w, scale_format=fp8)
        w64 = w_codes.double() * w_scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        operand = exact.GroupedOperand.fp8_activation(x, fp8)
        assert torch.allclose(exact.matmul(operand, weight), x64 @ w64.t(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_silu_rows_are_batch_invariant_and_close_to_float64(
    dtype: torch.dtype, gen: torch.Generator
) -> None:
    x = (torch.randn(301, 576, generator=gen) * 3).to(dtype)
    weight = torch.rand(576, generator=gen) + 0.5
    normed = exact.rms_norm(x, weight, 1e-5)
    assert torch.equal(exact.rms_norm(x[7:8], weight, 1e-5), normed[7:8])
    assert torch.equal(exact.rms_norm(x.view(7, 43, 576), weight, 1e-5), normed.view(7, 43, 576))
    x64 = x.double()
    reference = weight.to(dtype).double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    ulp = 2e-7 if dtype == torch.float32 else 1e-2
    assert torch.allclose(normed.double(), reference, rtol=ulp, atol=ulp)
    gate_up = (torch.randn(33, 2 * 96, generator=gen) * 4).to(dtype)
    fused = exact.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(fused, exact.silu(gate) * up)
    reference = torch.nn.functional.silu(gate.double()) * up.double()
    assert torch.allclose(fused.double(), reference, rtol=ulp, atol=ulp)


def test_rope_matches_transformers_rotation_and_float64_angles(gen: torch.Generator) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inv_freq = exact.rope_inv_freq(64, {"rope_type": "default", "rope_theta": 100000.0})
    reference = 1.0 / (100000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    assert torch.allclose(inv_freq, reference, rtol=1e-15)
    positions = torch.tensor([0, 1, 17, 4095, 8191])
    cos, sin = exact.rope_cos_sin(positions, inv_freq, torch.float32)
    angles = positions.double()[:, None] * reference
    assert torch.allclose(cos.double(), torch.cos(angles), atol=1e-7)
    assert torch.allclose(sin.double(), torch.sin(angles), atol=1e-7)
    q, k = torch.randn(2, 3, 9, 5, 64, generator=gen)  # [batch, heads, positions, head_dim]
    full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, full_cos.expand(3, 5, 64), full_sin.expand(3, 5, 64))
    assert torch.equal(exact.apply_rope(q, cos[None, None], sin[None, None]), q_hf)
    assert torch.equal(exact.apply_rope(k, cos[None, None], sin[None, None]), k_hf)


def test_llama3_rope_scaling_follows_transformers(gen: torch.Generator) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=parameters)
    hf, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert torch.allclose(exact.rope_inv_freq(128, parameters), hf.double(), rtol=1e-6)
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        exact.rope_inv_freq(128, {"rope_type": "yarn", "rope_theta": 1e4})


def _causal(lq: int, lk: int, offset: int = 0) -> torch.Tensor:
    """[1, 1, lq, lk]: query i sits at position offset + i."""
    return (torch.arange(lk)[None, :] <= offset + torch.arange(lq)[:, None])[None, None]


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_is_close_to_float64_softmax_attention(dtype: torch.dtype, gen: torch.Generator) -> None:
    b, h, kv, length, d = 3, 8, 2, 70, 64
    q = (torch.randn(b, h, length, d, generator=gen) * 2).to(dtype)
    k = (torch.randn(b, kv, length, d, generator=gen) * 2).to(dtype)
    v = (
        torch.randn(b, kv, length, d, generator=gen) * torch.exp(torch.randn(b, kv, length, 1, generator=gen))
    ).to(dtype)
    out = exact.attention(q, k, v, _causal(length, length), 0.125)
    assert out.dtype == dtype
    scores = q.double() @ k.double().repeat_interleave(h // kv, 1).transpose(-1, -2) * 0.125
    scores = scores.masked_fill(~_causal(length, length), -math.inf)
    reference = torch.softmax(scores, -1) @ v.double().repeat_interleave(h // kv, 1)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - reference).abs().max() <= tolerance * reference.abs().max()


def test_attention_of_a_query_is_the_same_in_prefill_decode_batches_and_padding(gen: torch.Generator) -> None:
    """The trainer attends whole padded sequences; the rollout one new token over its cache, or a chunk
    of a prompt, beside other requests: each query's output must be the same bits everywhere. (Decoding
    zeroes other value classes on the weights' side, the padded batch on the values': the same sums.)"""
    h, kv, d = 6, 2, 64
    lengths = (11, 40, 23)
    seqs = [
        (
            torch.randn(h, n, d, generator=gen),
            torch.randn(kv, n, d, generator=gen),
            torch.randn(kv, n, d, generator=gen),
        )
        for n in lengths
    ]
    longest = max(lengths) + 5  # (right padding past the longest, as the trainer's collation)
    q_b, k_b, v_b = (
        torch.zeros(len(seqs), t.shape[0], longest, d) for t in (seqs[0][0], seqs[0][1], seqs[0][1])
    )
    real = torch.zeros(len(seqs), longest, dtype=torch.bool)
    for i, (q, k, v) in enumerate(seqs):
        n = q.shape[1]
        q_b[i, :, :n], k_b[i, :, :n], v_b[i, :, :n] = q, k, v
        k_b[i, :, n:] = torch.randn(kv, longest - n, d, generator=gen)  # (padding keys hold garbage)
        real[i, :n] = True
    allowed = _causal(longest, longest) & real[:, None, None, :]
    padded = exact.attention(q_b, k_b, v_b, allowed, 0.125)
    for i, (q, k, v) in enumerate(seqs):
        n = q.shape[1]
        alone = exact.attention(q[None], k[None], v[None], _causal(n, n), 0.125)
        assert torch.equal(alone[0], padded[i, :, :n])
        for t in (0, n // 2, n - 1):  # decode: one query over the keys so far
            decoded = exact.attention(
                q[None, :, t : t + 1], k[None, :, : t + 1], v[None, :, : t + 1], _causal(1, t + 1, t), 0.125
            )
            assert torch.equal(decoded[0, :, 0], padded[i, :, t])
        chunk = exact.attention(q[None, :, 3:7], k[None, :, :7], v[None, :, :7], _causal(4, 7, 3), 0.125)
        assert torch.equal(chunk[0], padded[i, :, 3:7])


def test_attention_sums_exactly_across_key_chunks(gen: torch.Generator) -> None:
    """Past KEY_CHUNK keys the weighted values are summed chunk by chunk: a query still gets the same
    bits alone and batched, and stays close to float64."""
    n, d = exact.KEY_CHUNK + 300, 64
    q, k, v = (torch.randn(1, 2, n, d, generator=gen) for _ in range(3))
    q = q[:, :, -3:]
    allowed = _causal(3, n, n - 3)
    out = exact.attention(q, k, v, allowed, 0.125)
    again = exact.attention(q[:, :, 1:2], k, v, allowed[:, :, 1:2], 0.125)
    assert torch.equal(out[:, :, 1:2], again)
    scores = (q.double() @ k.double().transpose(-1, -2) * 0.125).masked_fill(~allowed, -math.inf)
    reference = torch.softmax(scores, -1) @ v.double()
    assert (out.double() - reference).abs().max() < 1e-5


def test_route_picks_the_largest_logits_and_weighs_them(gen: torch.Generator) -> None:
    logits = torch.randn(57, 8, generator=gen) * 3
    weights, ids = exact.route(logits, 2, renormalize=True)
    top = logits.double().topk(2, dim=-1)
    assert torch.equal(ids, top.indices)
    assert torch.allclose(weights.double(), torch.softmax(top.values, -1), rtol=1e-6)
    weights, _ = exact.route(logits, 2, renormalize=False)
    assert torch.allclose(
        weights.double(), torch.softmax(logits.double(), -1).gather(-1, top.indices), rtol=1e-6
    )
    assert torch.equal(exact.route(logits[3:4], 2, True)[0], exact.route(logits, 2, True)[0][3:4])
