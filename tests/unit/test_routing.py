"""Routed experts: their wire packing, the disagreement count, and routing replay in the trainer's
routers (a small random float32 Qwen3-MoE built in memory)."""

from __future__ import annotations

import pytest
import torch

from fp8rl import routing
from trainer_service.routing import moe_routers, own_routing, routed


@pytest.mark.parametrize("experts", [8, 256, 257, 1024])
def test_ids_pack_and_unpack_losslessly(experts: int, gen: torch.Generator) -> None:
    ids = torch.randint(0, experts, (13, 3, 4), generator=gen)
    data = routing.pack(ids, experts)
    width = routing.id_bytes(experts)
    assert len(data) == ids.numel() * width == ids.numel() * (1 if experts <= 256 else 2)
    assert torch.equal(routing.unpack(data, width, 3, 4), ids)


def test_unpacking_refuses_what_is_not_whole_positions() -> None:
    with pytest.raises(ValueError, match="not whole positions"):
        routing.unpack(bytes(7), 1, 2, 2)
    with pytest.raises(ValueError, match="id_bytes"):
        routing.unpack(bytes(8), 3, 2, 2)
    with pytest.raises(ValueError, match="outside"):
        routing.pack(torch.tensor([[[8]]]), 8)


def test_mismatch_compares_sets_and_skips_unknown_positions() -> None:
    own = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 1], [0, 1]], [[1, 2], [3, 4]]])
    other = torch.tensor(
        [
            [[1, 0], [3, 2]],  # the same sets, in another order
            [[4, 5], [6, 0]],  # one layer differs
            [[routing.UNKNOWN] * 2] * 2,  # no routing received
            [[7, 6], [5, 4]],  # both differ, but the position is not scored
        ]
    )
    where = torch.tensor([True, True, True, False])
    seen = routing.mismatch(own, other, where)
    assert seen == routing.Mismatch(decisions=4, differing_decisions=1, positions=2, differing_positions=1)
    assert seen.metrics() == {"routing_mismatch": 0.25, "routing_mismatch_positions": 0.5}
    assert routing.Mismatch().metrics() == {}


def tiny_moe(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    return Qwen3MoeForCausalLM(config).float()


def test_replaying_the_routers_own_choice_changes_nothing_and_another_changes_the_logits(
    gen: torch.Generator,
) -> None:
    model = tiny_moe()
    routers = moe_routers(model)
    assert len(routers) == 2
    ids = torch.randint(0, 128, (3, 9), generator=gen)
    with routed(routers) as chosen:
        plain = model(input_ids=ids).logits
    own = own_routing(chosen, 3, 9)
    assert own.shape == (3, 9, 2, 2)

    with routed(routers, own) as chosen:
        replayed = model(input_ids=ids).logits
    assert torch.equal(replayed, plain)  # (the replayed scores are the router's own, bit for bit)

    other = (own + 1) % 6  # every decision moved to other experts...
    other[1] = routing.UNKNOWN  # ...but in sequence 1, which the routers route themselves
    with routed(routers, other) as chosen:
        moved = model(input_ids=ids).logits
    # Recorded is the router's own choice, not the replayed one: in the first layer, whose input the
    # replay cannot change (later layers see other experts' outputs, so they may choose otherwise).
    assert torch.equal(own_routing(chosen, 3, 9)[:, :, 0], own[:, :, 0])
    assert not torch.allclose(moved[0], plain[0]) and not torch.allclose(moved[2], plain[2])
    # (Sequence 1 routes as before, but its experts' GEMMs now batch other rows with its own: equal up
    # to float32 rounding, not bit for bit.)
    torch.testing.assert_close(moved[1], plain[1], atol=1e-6, rtol=1e-5)


def test_gradients_reach_the_router_under_replay(gen: torch.Generator) -> None:
    model = tiny_moe()
    routers = moe_routers(model)
    ids = torch.randint(0, 128, (2, 7), generator=gen)
    forced = torch.randint(0, 6, (2, 7, 2, 1), generator=gen).expand(2, 7, 2, 2).clone()
    forced[..., 1] = (forced[..., 0] + 1) % 6
    with routed(routers, forced):
        model(input_ids=ids).logits.logsumexp(-1).sum().backward()
    for router in routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_a_dense_model_has_no_routers() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    assert moe_routers(Qwen2ForCausalLM(config)) == []


def test_a_samples_routed_experts_are_checked_against_the_model() -> None:
    from fp8rl.errors import InvalidRequest
    from fp8rl.v1 import common_pb2
    from trainer_service.service import parse_routed_experts

    routers = moe_routers(tiny_moe())
    field = "samples[0].routed_experts"

    def message(
        ids: torch.Tensor, layers: int = 2, top_k: int = 2, width: int = 1
    ) -> common_pb2.RoutedExperts:
        data = ids.numpy().astype("u1" if width == 1 else "<u2").tobytes()
        return common_pb2.RoutedExperts(moe_layers=layers, top_k=top_k, id_bytes=width, expert_ids=data)

    good = torch.randint(0, 6, (5, 2, 2))
    assert torch.equal(parse_routed_experts(field, message(good), routers, 5), good)
    for bad, match in (
        (message(good, layers=1, top_k=4), "the model routes 2 layers"),
        (message(good, width=2), "id_bytes 2"),
        (message(good), "5 positions, the sequence computes 6"),
        (message(torch.full((5, 2, 2), 6)), "expert id 6 outside"),
    ):
        with pytest.raises(InvalidRequest, match=match) as raised:
            parse_routed_experts(field, bad, routers, 6 if "computes 6" in match else 5)
        assert raised.value.field == field
    with pytest.raises(InvalidRequest, match="no mixture-of-experts"):
        parse_routed_experts(field, message(good), [], 5)
