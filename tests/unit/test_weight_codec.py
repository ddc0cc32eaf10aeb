"""The WeightSet codec: bit-exact round trips, tiny deltas, and every corruption rejected."""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8rl import quant
from fp8rl.codec import apply
from fp8rl.codec.decode import UpdateDecoder
from fp8rl.codec.encode import delta_parts, keyframe_parts
from fp8rl.codec.layout import header_segment, sealed
from fp8rl.codec.schema import build_weight_set
from fp8rl.codec.stream import Reassembler
from fp8rl.codec.testing import decode_update, encode_delta, encode_keyframe, read_metadata, to_bytes
from fp8rl.codec.weight_set import CHUNK_BYTES, WeightSet, bytes_digest, raw_bytes
from fp8rl.errors import BaseMismatchError, CorruptUpdateError, InvalidRequest, WeightCodecError
from fp8rl.formats import ScaleFormat


def model_like_state_dict(
    gen: torch.Generator, layers: int = 2, hidden: int = 256
) -> dict[str, torch.Tensor]:
    """Qwen2-shaped tensors (q/k/v with bias, gate/up/down, norms, embeddings, lm_head), float32."""
    sd = {
        "model.embed_tokens.weight": torch.randn(320, hidden, generator=gen),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (hidden, hidden),
            "self_attn.k_proj": (128, hidden),
            "self_attn.v_proj": (128, hidden),
            "self_attn.o_proj": (hidden, hidden),
            "mlp.gate_proj": (2 * hidden, hidden),
            "mlp.up_proj": (2 * hidden, hidden),
            "mlp.down_proj": (hidden, 2 * hidden),
        }
        for name, shape in shapes.items():
            sd[p + name + ".weight"] = torch.randn(shape, generator=gen) * 0.02
        for proj in ("q_proj", "k_proj", "v_proj"):
            sd[p + f"self_attn.{proj}.bias"] = torch.randn(
                sd[p + f"self_attn.{proj}.weight"].shape[0], generator=gen
            )
        sd[p + "input_layernorm.weight"] = torch.ones(hidden)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    sd["lm_head.weight"] = torch.randn(320, hidden, generator=gen) * 0.02
    return sd


def adam_like_step(
    sd: dict[str, torch.Tensor], gen: torch.Generator, relative: float
) -> dict[str, torch.Tensor]:
    return {k: v + relative * v.abs() * torch.randn(v.shape, generator=gen) for k, v in sd.items()}


def assert_sets_identical(a: WeightSet, b: WeightSet) -> None:
    assert a.format == b.format
    assert set(a.tensors) == set(b.tensors)
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert t.dtype == u.dtype and t.shape == u.shape, name
        assert (raw_bytes(t) == raw_bytes(u)).all(), name


def test_fp8_weight_setheader_segment(gen: torch.Generator) -> None:
    sd = model_like_state_dict(gen)
    ws = build_weight_set(sd, "fp8-block128")
    q_name = "model.layers.1.self_attn.k_proj.weight"
    assert ws.tensors[q_name].dtype == torch.float8_e4m3fn
    assert ws.tensors["model.layers.1.self_attn.k_proj.weight_scale_inv"].shape == (1, 2)
    codes, scales = quant.quantize_blockwise(sd[q_name])
    assert torch.equal(ws.tensors[q_name].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(ws.tensors["model.layers.1.self_attn.k_proj.weight_scale_inv"], scales)
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.input_layernorm.weight",
    ):
        assert ws.tensors[name].dtype == torch.bfloat16, name
    linears = [n for n in sd if ".layers." in n and n.endswith("_proj.weight")]
    assert len(ws.tensors) == len(sd) + len(linears)
    assert all(t.dtype == torch.bfloat16 for t in build_weight_set(sd, "bf16").tensors.values())
    f32 = build_weight_set(sd, "bf16", hp_dtype=torch.float32)
    assert f32.tensors[q_name].dtype == torch.float32
    before = f32.digest
    for t in sd.values():  # the optimizer moves the source: the set must not move with it
        t.add_(1.0)
    assert WeightSet(f32.format, dict(f32.tensors)).digest == before


def test_a_set_is_built_on_the_pool_in_order_and_in_the_caller_s_context(gen: torch.Generator) -> None:
    """Tensors are quantized on the codec's threads: the set keeps the state dict's order (each scale
    after its weight), equals one built a tensor at a time, and the caller's quant.nonfinite_passes
    reaches those threads (a NaN weight is refused without it, quantized to NaN codes within it)."""
    sd = model_like_state_dict(gen, layers=3)
    ws = build_weight_set(sd, "fp8-block128")
    one_by_one: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        one_by_one |= build_weight_set({name: t}, "fp8-block128").tensors
    assert list(ws.tensors) == list(one_by_one)
    assert_sets_identical(WeightSet("fp8-block128", one_by_one), ws)
    poisoned = {**sd, "model.layers.2.mlp.up_proj.weight": sd["model.layers.2.mlp.up_proj.weight"].clone()}
    poisoned["model.layers.2.mlp.up_proj.weight"][5, 7] = float("nan")
    with pytest.raises(quant.NonFiniteError):
        build_weight_set(poisoned, "fp8-block128")
    with quant.nonfinite_passes():
        codes = build_weight_set(poisoned, "fp8-block128").tensors["model.layers.2.mlp.up_proj.weight"]
    assert ((codes.view(torch.uint8) & 0x7F) == 0x7F).any()


@pytest.mark.parametrize("fmt", ["fp8-block128", "bf16"])
def test_keyframe_then_deltas_round_trip_bit_exact(fmt: str, gen: torch.Generator) -> None:
    master = model_like_state_dict(gen)
    sent = build_weight_set(master, fmt)  # type: ignore[arg-type]
    update = encode_keyframe(sent, version=0, recipe="fp8")
    held = decode_update(to_bytes(update))
    assert held.version == 0 and held.encoding == "keyframe"
    assert_sets_identical(sent, held.weights)
    for version in range(1, 4):
        master = adam_like_step(master, gen, 1e-3)
        new = build_weight_set(master, fmt)  # type: ignore[arg-type]
        delta = encode_delta(new, sent, version=version, base_version=version - 1)
        assert 0 < delta.density < 1
        assert delta.wire_bytes < update.wire_bytes
        held = decode_update(to_bytes(delta), held.weights, held_version=version - 1)
        assert held.version == version and held.encoding == "delta"
        assert_sets_identical(new, held.weights)
        assert held.weights.digest == new.digest
        sent = new


def moe_state_dict(
    gen: torch.Generator, layers: int = 2, hidden: int = 256, inter: int = 256, experts: int = 4
) -> dict[str, torch.Tensor]:
    """Qwen3-MoE-shaped tensors as transformers 5 holds them: fused experts ([E, 2I, H] gate_up_proj,
    [E, H, I] down_proj) and the router ``mlp.gate.weight`` [E, H], float32."""
    sd = {
        "model.embed_tokens.weight": torch.randn(320, hidden, generator=gen),
        "lm_head.weight": torch.randn(320, hidden, generator=gen) * 0.02,
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.o_proj.weight"] = torch.randn(hidden, hidden, generator=gen) * 0.02
        sd[p + "mlp.experts.gate_up_proj"] = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02
        sd[p + "mlp.experts.down_proj"] = torch.randn(experts, hidden, inter, generator=gen) * 0.02
        sd[p + "mlp.gate.weight"] = torch.randn(experts, hidden, generator=gen) * 0.02
        sd[p + "input_layernorm.weight"] = torch.ones(hidden)
    return sd


@pytest.mark.parametrize("fmt", ["fp8-block128", "fp8-block128-pow2"])
def test_moe_experts_ship_per_expert_under_vllm_s_checkpoint_names(fmt: str, gen: torch.Generator) -> None:
    """gate = rows [0, I) of gate_up_proj[e], up = rows [I, 2I) (transformers concatenates gate, up and
    its forward chunks them so), down = down_proj[e]; each quantized exactly as a dense linear of that
    2-D weight; the router in the high-precision dtype; deltas round-trip."""
    master = moe_state_dict(gen, hidden=320)  # (H = 2.5 blocks: partial edge blocks per expert)
    scale_format: ScaleFormat = "pow2" if fmt.endswith("pow2") else "fp32"
    sent = build_weight_set(master, fmt, torch.float32)  # type: ignore[arg-type]
    experts = [
        f"model.layers.{i}.mlp.experts.{e}.{g}"
        for i in range(2)
        for e in range(4)
        for g in ("gate_proj", "up_proj", "down_proj")
    ]
    assert set(sent.tensors) == {
        "model.embed_tokens.weight",
        "lm_head.weight",
        *(
            f"model.layers.{i}.{m}"
            for i in range(2)
            for m in (
                "self_attn.o_proj.weight",
                "self_attn.o_proj.weight_scale_inv",
                "mlp.gate.weight",
                "input_layernorm.weight",
            )
        ),
        *(f"{e}.{t}" for e in experts for t in ("weight", "weight_scale_inv")),
    }
    for i in range(2):
        gate_up, down = (
            master[f"model.layers.{i}.mlp.experts.gate_up_proj"],
            master[f"model.layers.{i}.mlp.experts.down_proj"],
        )
        for e in range(4):
            prefix = f"model.layers.{i}.mlp.experts.{e}"
            for name, w in (
                ("gate_proj", gate_up[e, :256]),
                ("up_proj", gate_up[e, 256:]),
                ("down_proj", down[e]),
            ):
                codes, scales = quant.quantize_blockwise(w, scale_format=scale_format)
                got = sent.tensors[f"{prefix}.{name}.weight"]
                assert got.dtype == torch.float8_e4m3fn and torch.equal(
                    got.view(torch.uint8), codes.view(torch.uint8)
                )
                scale = sent.tensors[f"{prefix}.{name}.weight_scale_inv"]
                assert scale.dtype == torch.float32 and scale.shape == (
                    math.ceil(w.shape[0] / 128),
                    math.ceil(w.shape[1] / 128),
                )
                assert torch.equal(scale, scales)
        router = sent.tensors[f"model.layers.{i}.mlp.gate.weight"]
        assert router.dtype == torch.float32 and torch.equal(
            router, master[f"model.layers.{i}.mlp.gate.weight"]
        )
    held = decode_update(to_bytes(encode_keyframe(sent, version=0, recipe="fp8")))
    assert_sets_identical(sent, held.weights)
    master = adam_like_step(master, gen, 1e-3)
    new = build_weight_set(master, fmt, torch.float32)  # type: ignore[arg-type]
    delta = encode_delta(new, sent, version=1, base_version=0)
    assert 0 < delta.density < 1
    held = decode_update(to_bytes(delta), held.weights, held_version=0)
    assert_sets_identical(new, held.weights)


def test_identical_sets_give_a_tiny_delta(gen: torch.Generator) -> None:
    ws = build_weight_set(model_like_state_dict(gen), "fp8-block128")
    delta = encode_delta(ws, ws, version=1, base_version=0)
    assert delta.density == 0.0 and delta.tensors_changed == 0
    assert delta.wire_bytes < 1024, delta.wire_bytes
    out = decode_update(to_bytes(delta), ws, held_version=0)
    assert out.tensors_updated == 0
    assert_sets_identical(ws, out.weights)


def test_delta_handles_added_removed_and_reshaped_tensors(gen: torch.Generator) -> None:
    base = WeightSet(
        "bf16",
        {
            "a": torch.randn(8, generator=gen).bfloat16(),
            "b": torch.zeros(3).bfloat16(),
            "c": torch.ones(2, 2).bfloat16(),
        },
    )
    new = WeightSet(
        "bf16", {"a": base.tensors["a"], "c": torch.ones(4).bfloat16(), "d": torch.arange(5.0).bfloat16()}
    )
    delta = encode_delta(new, base, version=5, base_version=4)
    out = decode_update(to_bytes(delta), base, held_version=4)
    assert_sets_identical(new, out.weights)
    assert out.tensors_updated == 3  # b removed, c reshaped, d added


def test_wrong_base_is_a_distinct_error(gen: torch.Generator) -> None:
    sd = model_like_state_dict(gen)
    v0 = build_weight_set(sd, "fp8-block128")
    v1 = build_weight_set(adam_like_step(sd, gen, 1e-2), "fp8-block128")
    delta = encode_delta(v1, v0, version=1, base_version=0)
    with pytest.raises(BaseMismatchError, match="version 0"):
        decode_update(to_bytes(delta), v0, held_version=3)
    with pytest.raises(BaseMismatchError):
        decode_update(to_bytes(delta), None, held_version=None)
    with pytest.raises(BaseMismatchError, match="digest"):  # right version number, other bytes
        decode_update(to_bytes(delta), v1, held_version=0)


def test_every_flipped_byte_is_rejected_and_held_set_untouched(gen: torch.Generator) -> None:
    sd = model_like_state_dict(gen, layers=1)
    v0 = build_weight_set(sd, "fp8-block128")
    v1 = build_weight_set(adam_like_step(sd, gen, 1e-2), "fp8-block128")
    before = v0.digest
    for blob, held in ((to_bytes(encode_keyframe(v1, 1)), None), (to_bytes(encode_delta(v1, v0, 1, 0)), v0)):
        positions = [*torch.randint(0, len(blob), (40,), generator=gen).tolist(), 0, 8, len(blob) - 1]
        for pos in positions:
            corrupted = bytearray(blob)
            corrupted[pos] ^= 1 << int(torch.randint(0, 8, (1,), generator=gen))
            with pytest.raises(WeightCodecError):
                decode_update(bytes(corrupted), held, held_version=0)
        with pytest.raises(CorruptUpdateError):
            decode_update(blob[: len(blob) // 2], held, held_version=0)
    assert WeightSet(v0.format, dict(v0.tensors)).digest == before


def mixed_step(sd: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A step that changes some tensors sparsely (xor-sparse entries) and others densely (xor-zstd)."""
    small, large = adam_like_step(sd, gen, 1e-4), adam_like_step(sd, gen, 1e-1)
    return {k: (large if i % 2 else small)[k] for i, k in enumerate(sd)}


def encodings(blob: bytes) -> set[str]:
    return {c[0] for e in json.loads(read_metadata(blob)["tensors"]).values() for c in e["chunks"]}


def snapshot(ws: WeightSet) -> dict[str, bytes]:
    return {n: raw_bytes(t).tobytes() for n, t in ws.tensors.items()}


def with_payload(blob: bytes, name: str, packed: bytes) -> bytes:
    """``blob`` with one tensor's packed bytes replaced (and the entry's packed digest and the layout
    made to match): a well-formed update whose stream for ``name`` decodes to the wrong length."""
    header_len = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + header_len])
    metadata = {k: v for k, v in header.pop("__metadata__").items() if k != "metadata_digest"}
    entries = json.loads(metadata["tensors"])
    entries[name]["chunks"] = [["xor-zstd", len(packed), 0, bytes_digest(packed)]]  # a one-chunk tensor
    metadata["tensors"] = json.dumps(entries, sort_keys=True)
    data = blob[8 + header_len :]
    payloads = {n: data[spec["data_offsets"][0] : spec["data_offsets"][1]] for n, spec in header.items()}
    payloads[name] = packed
    layout = {n: (torch.uint8, [len(b)], len(b)) for n, b in payloads.items()}
    return header_segment(layout, sealed(metadata)) + b"".join(payloads.values())


@pytest.mark.parametrize("fmt", ["fp8-block128", "bf16"])
def test_a_delta_is_applied_in_place_and_any_refusal_puts_every_byte_back(
    fmt: str, gen: torch.Generator
) -> None:
    """The delta rewrites the held tensors in their own memory (no second copy of the set); a refusal at
    any point (a tensor's digest after its XORs were applied, a stream that ends early part-way through a
    tensor, the receiver's ``accept``) leaves the held set bit for bit as it was, whatever other tensors
    had already been rewritten on other threads."""
    import zstandard

    sd = model_like_state_dict(gen)
    v0, v1 = build_weight_set(sd, fmt), build_weight_set(mixed_step(sd, gen), fmt)  # type: ignore[arg-type]
    delta = to_bytes(encode_delta(v1, v0, 1, 0))
    assert encodings(delta) == {"xor-sparse", "xor-zstd"}
    entries = json.loads(read_metadata(delta)["tensors"])
    sparse = next(n for n, e in entries.items() if e["chunks"][0][0] == "xor-sparse")
    dense = next(n for n, e in entries.items() if e["chunks"][0][0] == "xor-zstd")
    half = raw_bytes(v1.tensors[dense]) ^ raw_bytes(v0.tensors[dense])
    short = zstandard.ZstdCompressor().compress(half[: half.size // 2 + 3].tobytes())

    def refuse(decoded: Any) -> None:
        raise InvalidRequest("weights", "refused by the receiver")

    before, digest = snapshot(v0), v0.digest
    wrong_result = recrafted(delta, lambda e: e[sparse].update(digest=e[dense]["digest"]))
    for bad, error in (
        (wrong_result, CorruptUpdateError),
        (with_payload(delta, dense, short), CorruptUpdateError),
        (delta, InvalidRequest),
    ):
        with pytest.raises(error):
            decode_update(bad, v0, held_version=0, accept=refuse if bad is delta else None)
        assert snapshot(v0) == before and fresh_digest(v0) == digest

    seen: list[int] = []
    out = decode_update(delta, v0, held_version=0, accept=lambda d: seen.append(d.version))
    assert seen == [1]
    assert_sets_identical(v1, out.weights)
    for name in (sparse, dense):  # rewritten where it was held
        assert out.weights.tensors[name].data_ptr() == v0.tensors[name].data_ptr()
    with pytest.raises(BaseMismatchError, match="consumed"):  # the held set no longer passes for version 0
        decode_update(delta, v0, held_version=0)
    with pytest.raises(ValueError, match="consumed"):
        v0.digest  # noqa: B018


@pytest.mark.parametrize("fmt", ["fp8-block128", "bf16"])
def test_an_update_in_parts_is_applied_as_they_come_and_put_back_whole_if_any_fails(
    fmt: str, gen: torch.Generator
) -> None:
    """Each part is applied in place as it is added; a later part that is corrupt, missing, out of
    order or from another update, a stream that breaks (abort) or an interrupt puts back every part
    already applied, bit for bit."""
    sd = model_like_state_dict(gen)
    v0, v1 = build_weight_set(sd, fmt), build_weight_set(mixed_step(sd, gen), fmt)  # type: ignore[arg-type]
    small = 1 << 16
    parts = [to_bytes(p) for p in delta_parts(v1, v0, 1, 0, part_bytes=small)]
    assert len(parts) >= 4 and all(read_metadata(b)["parts"] == str(len(parts)) for b in parts)
    other_version = [to_bytes(p) for p in delta_parts(v1, v0, 2, 0, part_bytes=small)]
    other_cut = [to_bytes(p) for p in delta_parts(v1, v0, 1, 0, part_bytes=2 * small)]
    with_data = max(i for i, b in enumerate(parts) if len(b) > 8 + int.from_bytes(b[:8], "little"))
    flipped = bytearray(parts[with_data])
    flipped[-1] ^= 1
    before, digest = snapshot(v0), v0.digest

    def fails_after(sent: list[bytes], finish: bool = True) -> None:
        decoder = UpdateDecoder(v0, 0)
        decoder.add(parts[0])
        assert snapshot(v0) != before  # part 0 was applied in place, before any other part arrived
        for blob in sent:
            decoder.add(blob)
        if finish:
            decoder.finish()

    cases: dict[str, tuple[Callable[[], None], str]] = {
        "a corrupt part": (lambda: fails_after([*parts[1:with_data], bytes(flipped)]), "digest mismatch"),
        "the last part missing": (lambda: fails_after(parts[1:-1]), "truncated"),
        "a part skipped": (lambda: fails_after(parts[2:3], finish=False), "was due"),
        "a part twice": (lambda: fails_after(parts[:1], finish=False), "was due"),
        "a part of another version": (
            lambda: fails_after([other_version[1]], finish=False),
            "another update",
        ),
        "a part of another cut": (lambda: fails_after([other_cut[1]], finish=False), "another update"),
    }
    for name, (case, message) in cases.items():
        with pytest.raises(CorruptUpdateError, match=message):
            case()
        assert snapshot(v0) == before and fresh_digest(v0) == digest, name

    # Parts crafted by someone holding no secret (every digest recomputed): refused all the same.
    last = parts[-1]
    removing_updated = resealed(last, lambda m: m.update(removed=json.dumps(sorted(entries_of(parts[0])))))
    beyond = resealed(parts[0], lambda m: m.update(part=str(len(parts)), tensors="{}"), keep_tensors=False)
    for name, crafted, message in (
        ("a tensor in two parts", [resealed(parts[0], lambda m: m.update(part="1"))], "two parts"),
        ("a removed tensor updated", [*parts[1:-1], removing_updated], "removed"),
        (
            "removed, not names",
            [*parts[1:-1], resealed(last, lambda m: m.update(removed="[[1]]"))],
            "removed",
        ),
        ("a part after the last", [*parts[1:], beyond], "was due"),
    ):
        with pytest.raises(CorruptUpdateError, match=message):
            fails_after(crafted)
        assert snapshot(v0) == before and fresh_digest(v0) == digest, name

    with UpdateDecoder(v0, 0) as decoder:  # the stream broke after two parts: the caller aborts
        decoder.add(parts[0])
        decoder.add(parts[1])
    assert snapshot(v0) == before
    with pytest.raises(KeyboardInterrupt), UpdateDecoder(v0, 0) as decoder:
        decoder.add(parts[0])
        raise KeyboardInterrupt
    assert snapshot(v0) == before and fresh_digest(v0) == digest

    keyframe = UpdateDecoder()
    for part in keyframe_parts(v0, 0, part_bytes=small):
        keyframe.add(bytearray(to_bytes(part)))
    assert_sets_identical(v0, keyframe.finish().weights)
    decoder = UpdateDecoder(v0, 0)
    for blob in parts:
        decoder.add(blob)
    out = decoder.finish()
    assert_sets_identical(v1, out.weights)
    assert out.tensors_updated == sum(before[n] != b for n, b in snapshot(v1).items()) > len(parts)
    assert v0.consumed
    whole = encode_delta(v1, build_weight_set(sd, fmt), 1, 0)  # type: ignore[arg-type]
    assert sum(len(b) for b in parts) > whole.wire_bytes > 0  # parts cost a header each, nothing else


def fresh_digest(ws: WeightSet) -> str:
    """The set's digest from its bytes, hashed afresh (``ws.digest`` is cached)."""
    return WeightSet(ws.format, dict(ws.tensors)).digest


def entries_of(blob: bytes) -> dict[str, Any]:
    return json.loads(read_metadata(blob)["tensors"])


def resealed(blob: bytes, edit: Callable[[dict[str, str]], None], keep_tensors: bool = True) -> bytes:
    """``blob`` with its metadata edited and sealed again (as anyone could), its tensors kept or dropped."""
    header_len = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + header_len])
    metadata = {k: v for k, v in header.pop("__metadata__").items() if k != "metadata_digest"}
    edit(metadata)
    if not keep_tensors:
        return header_segment({}, sealed(metadata))
    layout = {
        n: (torch.uint8, spec["shape"], spec["data_offsets"][1] - spec["data_offsets"][0])
        for n, spec in header.items()
    }
    return header_segment(layout, sealed(metadata)) + blob[8 + header_len :]


def test_big_tensors_are_cut_into_chunks_each_encoded_its_own_way(gen: torch.Generator) -> None:
    """A tensor over 16 MiB is hashed, packed and unpacked in chunks on every core: an unchanged chunk
    ships nothing, a sparse one its pairs, a dense one its XOR stream, a new tensor's chunks their bytes;
    a refusal after every chunk was applied puts every chunk back."""
    per_chunk = CHUNK_BYTES // 4
    base_t = torch.randn(2 * per_chunk + 1000, generator=gen)  # three chunks, the last one short
    new_t = base_t.clone()
    new_t[per_chunk + 4 : per_chunk + 8] += 1.0
    new_t[2 * per_chunk :] = torch.randn(1000, generator=gen)
    base = WeightSet("bf16", {"big": base_t, "small": torch.ones(3)})
    new = WeightSet(
        "bf16", {"big": new_t, "small": torch.ones(3), "fresh": torch.randn(per_chunk + 1, generator=gen)}
    )
    delta = to_bytes(encode_delta(new, base, 1, 0))
    entries = json.loads(read_metadata(delta)["tensors"])
    assert [c[0] for c in entries["big"]["chunks"]] == ["same", "xor-sparse", "xor-zstd"]
    assert [c[0] for c in entries["fresh"]["chunks"]] == ["zstd", "zstd"]
    assert entries["big"]["chunks"][1][2] == 2  # four float32 changed: two 8-byte words
    assert WeightSet("bf16", dict(new.tensors)).digest == new.digest  # chunked digests, computed two ways

    before = snapshot(base)
    wrong = recrafted(delta, lambda e: e["big"].update(digest=e["fresh"]["digest"]))
    with pytest.raises(CorruptUpdateError, match="digest mismatch for tensor 'big'"):
        decode_update(wrong, base, held_version=0)
    assert snapshot(base) == before
    out = decode_update(delta, base, held_version=0)
    assert_sets_identical(new, out.weights)


def owned(tensors: dict[str, torch.Tensor]) -> WeightSet:
    return WeightSet("bf16", tensors, owned=True)


def test_tensors_that_share_memory_are_not_rewritten_in_place(gen: torch.Generator) -> None:
    """Only memory no other tensor of the set reads is rewritten, strided views' whole storage counted."""
    shared, strided = torch.randn(64, generator=gen).bfloat16(), torch.randn(256, generator=gen).bfloat16()
    base = owned(
        {
            "a": shared,
            "b": shared,
            "c": shared[:32],
            "d": torch.zeros(8).bfloat16(),
            "every other": strided[::2],  # reads bytes all over the storage...
            "tail": strided[96:],  # ...that this one, contiguous, also covers
        }
    )
    new = WeightSet(
        "bf16", {**base.tensors, "a": shared + 1, "d": torch.ones(8).bfloat16(), "tail": strided[96:] + 1}
    )
    before = snapshot(base)
    out = decode_update(to_bytes(encode_delta(new, base, 1, 0)), base, held_version=0)
    assert_sets_identical(new, out.weights)
    for name in ("b", "c", "every other"):  # still read the old bytes
        assert raw_bytes(base.tensors[name]).tobytes() == before[name]
    assert out.weights.tensors["d"].data_ptr() == base.tensors["d"].data_ptr()  # alone: in place
    assert WeightSet("bf16", dict(out.weights.tensors)).digest == new.digest  # hashed afresh


def test_memory_the_codec_does_not_own_is_never_written(gen: torch.Generator) -> None:
    """A set over the caller's tensors (not built nor decoded by the codec) is read, never written: here
    they sit in immutable ``bytes``, which numpy and torch would both let a careless decoder write."""
    import warnings

    data = bytes(raw_bytes(torch.randn(64, generator=gen).bfloat16()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the buffer is not writable: that is the point
        held = WeightSet("bf16", {"w": torch.frombuffer(data, dtype=torch.bfloat16)})
    original = bytearray(data)  # a copy (bytes(data) would be the same object)
    new = WeightSet("bf16", {"w": held.tensors["w"] + 1})
    out = decode_update(to_bytes(encode_delta(new, held, 1, 0)), held, held_version=0)
    assert_sets_identical(new, out.weights)
    assert data == original and not held.consumed


def test_an_interrupt_while_chunks_are_applied_leaves_the_held_set_as_it_was(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (or any BaseException) part-way through: every chunk still being written finishes, then all
    are undone, then the interrupt propagates."""
    sd = model_like_state_dict(gen)
    v0, v1 = build_weight_set(sd, "bf16"), build_weight_set(mixed_step(sd, gen), "bf16")
    delta = to_bytes(encode_delta(v1, v0, 1, 0))
    before, digest = snapshot(v0), v0.digest
    real, calls = apply.unpack_chunk, []

    def interrupted(target: Any, i: int) -> Any:
        calls.append(i)
        if len(calls) == 5:  # after others were applied, on whichever thread runs it
            raise KeyboardInterrupt
        return real(target, i)

    monkeypatch.setattr(apply, "unpack_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        decode_update(delta, v0, held_version=0)
    assert len(calls) > 5 and snapshot(v0) == before and fresh_digest(v0) == digest and not v0.consumed


def test_a_chunk_that_cannot_be_put_back_consumes_the_held_set(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dense chunk that fails part-way and then fails to undo itself (out of memory): the held set is
    consumed, so that it can no longer pass for its version; the replica then needs a keyframe."""
    sd = model_like_state_dict(gen)
    v0, v1 = build_weight_set(sd, "bf16"), build_weight_set(mixed_step(sd, gen), "bf16")
    real, calls = apply.unpack_chunk, []

    def unrestorable(target: Any, i: int) -> Any:
        calls.append(i)
        if len(calls) == 3:
            raise apply.Unrestorable("a chunk could not be put back")
        return real(target, i)

    monkeypatch.setattr(apply, "unpack_chunk", unrestorable)
    with pytest.raises(CorruptUpdateError, match="could not be put back"):
        decode_update(to_bytes(encode_delta(v1, v0, 1, 0)), v0, held_version=0)
    assert v0.consumed
    with pytest.raises(BaseMismatchError, match="consumed"):
        decode_update(to_bytes(encode_delta(v1, build_weight_set(sd, "bf16"), 1, 0)), v0, held_version=0)


@pytest.mark.slow  # an exhaustive sweep: about 100,000 decodes, half a minute
def test_every_bit_of_the_header_is_covered(gen: torch.Generator) -> None:
    """Flip each bit of the safetensors header in turn (names, dtypes, shapes, offsets and the metadata,
    version numbers included): every one is refused with a codec error, none is read as another update."""
    sd = model_like_state_dict(gen, layers=1)
    v0 = build_weight_set(sd, "fp8-block128")
    v1 = build_weight_set(adam_like_step(sd, gen, 1e-2), "fp8-block128")
    for blob, held in ((to_bytes(encode_keyframe(v1, 1)), None), (to_bytes(encode_delta(v1, v0, 1, 0)), v0)):
        header_end = 8 + int.from_bytes(blob[:8], "little")
        corrupted = bytearray(blob)  # (one buffer, each bit flipped and restored: no copy per flip)
        for pos in range(header_end):
            for bit in range(8):
                corrupted[pos] ^= 1 << bit
                with pytest.raises(WeightCodecError):
                    decode_update(corrupted, held, held_version=0)
                corrupted[pos] ^= 1 << bit
        assert corrupted == blob


def test_chunks_reassemble_and_reject_truncation_and_reordering(gen: torch.Generator) -> None:
    """Pieces cut across segment boundaries reassemble to the update; a missing, reordered or extra piece
    is refused by the reassembler or, at the latest, by the decoder (the header seals every digest)."""
    sd = model_like_state_dict(gen, layers=1)
    update = encode_keyframe(build_weight_set(sd, "fp8-block128"), 1)
    pieces = list(update.pieces(30_000))
    assert len(update.segments) > 10 and {len(p) for p in pieces[:-1]} == {30_000}
    assert b"".join(pieces) == to_bytes(update) and len(to_bytes(update)) == update.wire_bytes

    def reassembled(parts: list[bytes]) -> bytearray:
        r = Reassembler(update.wire_bytes, update.digest)
        for part in parts:
            r.add(part)
        return r.finish()

    assert decode_update(reassembled(pieces)).weights.digest == decode_update(to_bytes(update)).weights.digest
    with pytest.raises(CorruptUpdateError, match="truncated"):
        reassembled(pieces[:-1])
    with pytest.raises(CorruptUpdateError, match="more than"):
        reassembled([*pieces, b"x"])
    for order in ([pieces[1], pieces[0], *pieces[2:]], [*pieces[:2], pieces[3], pieces[2], *pieces[4:]]):
        with pytest.raises(CorruptUpdateError, match="digest"):
            decode_update(reassembled(order))
    with pytest.raises(CorruptUpdateError):
        Reassembler(100, update.digest, max_bytes=10)


def test_updates_are_safetensors_files(gen: torch.Generator) -> None:
    """What the codec writes by hand is the safetensors layout: safetensors itself reads it."""
    from safetensors.torch import load

    v0 = build_weight_set(model_like_state_dict(gen, layers=1), "fp8-block128")
    v1 = build_weight_set(adam_like_step(model_like_state_dict(gen, layers=1), gen, 1e-2), "fp8-block128")
    loaded = load(to_bytes(encode_keyframe(v0, 0)))
    assert_sets_identical(WeightSet(v0.format, loaded), v0)
    assert set(load(to_bytes(encode_delta(v1, v0, 1, 0)))) <= set(v1.tensors)


_DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn]


@st.composite
def weight_set_pairs(draw: st.DrawFn) -> tuple[WeightSet, WeightSet]:
    """A base set and a new one that changes, adds, removes or keeps tensors."""
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    names = draw(st.lists(st.text("abcdefgh.", min_size=1, max_size=6), min_size=1, max_size=6, unique=True))
    base, new = {}, {}
    for name in names:
        shape = draw(st.lists(st.integers(1, 7), min_size=1, max_size=3))
        dtype = draw(st.sampled_from(_DTYPES))
        t = (torch.randn(shape, generator=g) * 10).clamp(-400, 400).to(dtype)
        base[name] = t
        action = draw(st.sampled_from(["keep", "change", "remove", "reshape"]))
        if action == "keep":
            new[name] = t
        elif action == "change":
            u = t.clone().view(torch.uint8).reshape(-1)
            u[draw(st.integers(0, u.numel() - 1))] ^= draw(st.integers(1, 127))
            new[name] = u.view(dtype).reshape(t.shape)
        elif action == "reshape":
            new[name] = t.reshape(-1).to(torch.float32)
    if draw(st.booleans()):
        new["new.tensor"] = torch.randn(3, generator=g).bfloat16()
    return WeightSet("bf16", base), WeightSet("bf16", new)


@settings(max_examples=60, deadline=None)
@given(weight_set_pairs())
def test_property_delta_round_trip(pair: tuple[WeightSet, WeightSet]) -> None:
    base, new = pair
    key = decode_update(to_bytes(encode_keyframe(base, 7)))
    assert_sets_identical(base, key.weights)
    out = decode_update(to_bytes(encode_delta(new, base, 8, 7)), key.weights, held_version=7)
    assert out.version == 8
    assert_sets_identical(new, out.weights)


def recrafted(blob: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """``blob`` with its delta entries edited and every digest and length recomputed, as an attacker
    holding no secret could: only the receiver's own bounds can refuse it."""
    header_len = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + header_len])
    metadata = {k: v for k, v in header.pop("__metadata__").items() if k != "metadata_digest"}
    entries = json.loads(metadata["tensors"])
    edit(entries)
    metadata["tensors"] = json.dumps(entries, sort_keys=True)
    layout = {
        n: (torch.uint8, spec["shape"], spec["data_offsets"][1] - spec["data_offsets"][0])
        for n, spec in header.items()
    }
    return header_segment(layout, sealed(metadata)) + blob[8 + header_len :]


def test_sizes_claimed_by_an_update_are_bounded_before_anything_is_allocated(gen: torch.Generator) -> None:
    sd = model_like_state_dict(gen, layers=1)
    v0 = build_weight_set(sd, "fp8-block128")
    stepped = adam_like_step(sd, gen, 1e-4)  # sparse changes: xor-sparse entries
    fresh = {**stepped, "model.extra.weight": torch.randn(64, 64, generator=gen)}  # no base: a zstd entry
    delta = to_bytes(encode_delta(build_weight_set(fresh, "fp8-block128"), v0, 1, 0))

    def claim(shape: list[int]) -> Callable[[dict[str, Any]], None]:
        return lambda entries: entries["model.extra.weight"].update(shape=shape)

    with pytest.raises(CorruptUpdateError, match="claims"):
        decode_update(recrafted(delta, claim([2**20, 2**20])), v0, held_version=0)
    with pytest.raises(CorruptUpdateError, match="bad entry"):
        decode_update(recrafted(delta, claim([2**32, 2**32])), v0, held_version=0)

    def refuse(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        if name == "model.extra.weight":
            raise InvalidRequest("weights", f"{name} is not a tensor of this model")

    with pytest.raises(InvalidRequest, match="not a tensor of this model"):
        decode_update(delta, v0, held_version=0, admit=refuse)
    entries = json.loads(read_metadata(delta)["tensors"])
    sparse = next(n for n, e in entries.items() if e["chunks"][0][0] == "xor-sparse")
    too_many = math.prod(entries[sparse]["shape"])  # more (index, XOR) pairs than the tensor has words

    def pairs(count: Any) -> Callable[[dict[str, Any]], None]:
        return lambda e: e[sparse]["chunks"][0].__setitem__(2, count)

    for count in (too_many, 0, -1, 1.5, True):
        with pytest.raises(CorruptUpdateError, match="bad entry"):
            decode_update(recrafted(delta, pairs(count)), v0, held_version=0)
    with pytest.raises(CorruptUpdateError, match="bad entry"):  # a chunk's size beyond the packed bytes
        decode_update(
            recrafted(delta, lambda e: e[sparse]["chunks"][0].__setitem__(1, 2**40)), v0, held_version=0
        )


def test_an_empty_tensor_claiming_an_absurd_dimension_is_corrupt(gen: torch.Generator) -> None:
    """[0, 2**64] holds no byte, so its size (0) passed every bound, and torch.empty raised a TypeError
    that the servicer answered INTERNAL (found writing the fuzz target codec_decode, tests/fuzz)."""
    blob = to_bytes(encode_keyframe(build_weight_set(model_like_state_dict(gen, layers=1), "bf16"), 1))
    header_len = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + header_len])
    metadata = {k: v for k, v in header.pop("__metadata__").items() if k != "metadata_digest"}
    end = max(spec["data_offsets"][1] for spec in header.values())
    for shape in ([0, 2**64], [0, 2**63 - 1], [2**41, 0]):
        header["empty"] = {"dtype": "F32", "shape": shape, "data_offsets": [end, end]}
        text = json.dumps({"__metadata__": sealed(metadata), **header}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        crafted = len(text).to_bytes(8, "little") + text + blob[8 + header_len :]
        with pytest.raises(CorruptUpdateError, match="a dimension outside"):
            decode_update(crafted)


def test_only_the_canonical_header_is_accepted(gen: torch.Generator) -> None:
    """Whitespace is invisible to JSON: a header re-spelled with it must still be refused."""
    blob = to_bytes(encode_keyframe(build_weight_set(model_like_state_dict(gen, layers=1), "bf16"), 1))
    header_len = int.from_bytes(blob[:8], "little")
    spaced = json.dumps(json.loads(blob[8 : 8 + header_len])).encode()  # ", " and ": " separators
    spaced += b" " * (-len(spaced) % 8)
    with pytest.raises(CorruptUpdateError, match="canonical"):
        decode_update(len(spaced).to_bytes(8, "little") + spaced + blob[8 + header_len :])
    padded = bytearray(blob)
    padded[8 + header_len - 1] = ord("\n")  # the last padding space (or the closing brace) as a newline
    with pytest.raises(CorruptUpdateError):
        decode_update(bytes(padded))


def test_the_services_never_import_the_whole_update_helpers() -> None:
    """fp8rl.codec.testing (an update as one part in one buffer) is for tests and benches: the services
    stream updates part by part."""
    root = Path(__file__).resolve().parents[2]
    for package in ("fp8rl", "rollout_service", "trainer_service", "coordinator"):
        for path in (root / package).rglob("*.py"):
            imported: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    imported |= {alias.name for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module:
                    imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
            assert "fp8rl.codec.testing" not in imported or path.name == "testing.py", path
