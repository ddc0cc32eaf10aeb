"""The rollout service against real vLLM on CPU (float32 tiny model), through a real gRPC server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from fp8rl.codec.encode import delta_parts
from fp8rl.codec.schema import build_weight_set
from fp8rl.codec.stream import parts_to_chunks, update_to_chunks
from fp8rl.codec.tcp_plane import TcpInbox
from fp8rl.codec.testing import encode_delta, encode_keyframe
from fp8rl.codec.weight_set import WeightSet
from fp8rl.v1 import common_pb2, rollout_pb2, weights_pb2
from tests.conftest import InProcessRollout
from tests.support import load_reference, reference_logprobs, set_weights
from trainer_service.publisher import Publisher, Reach, Target

FP8 = "fp8-block128"


def request(
    prompts: list[list[int] | str], n: int = 1, version: int = -1, **sampling
) -> rollout_pb2.GenerateRequest:
    sampling.setdefault("max_tokens", 8)
    msgs = [
        rollout_pb2.Prompt(id=f"p{i}", text=p)
        if isinstance(p, str)
        else rollout_pb2.Prompt(id=f"p{i}", token_ids=rollout_pb2.TokenIds(ids=p))
        for i, p in enumerate(prompts)
    ]
    return rollout_pb2.GenerateRequest(
        prompts=msgs, n=n, weight_version=version, sampling=common_pb2.SamplingParams(**sampling)
    )


def random_state(model_dir: Path, seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, or (seed > 0) a strongly different random set of the same shapes."""
    state = load_file(model_dir / "model.safetensors")
    if seed == 0:
        return state
    g = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.ndim == 2 else v
        for k, v in state.items()
    }


def push(stub, update) -> weights_pb2.UpdateWeightsResponse:  # type: ignore[no-untyped-def]
    return stub.UpdateWeights(update_to_chunks(update), timeout=120)


def push_keyframe(rollout: InProcessRollout, state: dict[str, torch.Tensor], version: int) -> WeightSet:
    ws = build_weight_set(state, FP8, hp_dtype=torch.float32)
    reply = push(rollout.stub, encode_keyframe(ws, version))
    assert (reply.version, reply.encoding) == (version, "keyframe")
    return ws


def test_generate_shapes_and_seeded_reproducibility(rollout_fp8: InProcessRollout) -> None:
    req = request([[5, 6, 7, 8], "12+34="], n=3, max_tokens=10, temperature=0.9, seed=7)
    first = rollout_fp8.stub.Generate(req, timeout=120)
    assert len(first.completions) == 6
    assert [(c.prompt_id, c.sample_index) for c in first.completions] == [
        (p, j) for p in ("p0", "p1") for j in range(3)
    ]
    for c in first.completions:
        assert len(c.logprobs) == len(c.token_ids) > 0
        assert all(lp <= 0 for lp in c.logprobs)
        assert c.finish_reason in ("stop", "length")
    assert first.completions[3].prompt_token_ids == [4 + ord(ch) for ch in "12+34="]
    assert len({tuple(c.token_ids) for c in first.completions[:3]}) > 1  # n samples differ
    again = rollout_fp8.stub.Generate(req, timeout=120)
    assert [list(c.token_ids) for c in again.completions] == [list(c.token_ids) for c in first.completions]
    assert first.usage.completion_tokens == sum(len(c.token_ids) for c in first.completions)


def test_generate_stream_yields_every_completion(rollout_fp8: InProcessRollout) -> None:
    stream = rollout_fp8.stub.GenerateStream(
        request([[9, 10], [11, 12, 13]], n=2, max_tokens=4, seed=1), timeout=120
    )
    got = sorted((c.prompt_id, c.sample_index) for c in stream)
    assert got == [("p0", 0), ("p0", 1), ("p1", 0), ("p1", 1)]


@pytest.mark.parametrize(
    ("req", "field"),
    [
        (rollout_pb2.GenerateRequest(n=1, sampling=common_pb2.SamplingParams(max_tokens=4)), "prompts"),
        (request([[]]), "prompts[0].token_ids"),
        (request([""]), "prompts[0]"),
        (request([[5] * 256]), "prompts[0].token_ids"),
        (request(["x" * 300]), "prompts[0]"),
        (request([[5]], n=0), "n"),
        (request([[5]], n=1000), "n"),
        (request([[5]], max_tokens=0), "sampling.max_tokens"),
        (request([[5]], max_tokens=100_000), "sampling.max_tokens"),
        (request([[5]], temperature=-0.5), "sampling.temperature"),
        (request([[5]], top_p=0.0), "sampling.top_p"),
        (request([[5]], top_p=1.5), "sampling.top_p"),
        (request([[5, 99999]]), "prompts[0].token_ids"),
        (request([[5, -1]]), "prompts[0].token_ids"),
        (request([[300] * 200] * 12_000), "request"),  # ~4.8 MB: over the 4 MiB request limit
    ],
)
def test_bad_requests_name_the_field(rollout_fp8: InProcessRollout, req, field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        rollout_fp8.stub.Generate(req, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":"), err.value.details()
    assert len(rollout_fp8.stub.Generate(request([[5, 6]], max_tokens=2), timeout=60).completions) == 1


def test_fp8_logprobs_match_a_fake_quant_reference(rollout_fp8: InProcessRollout) -> None:
    push_keyframe(rollout_fp8, random_state(rollout_fp8.model_dir, 0), version=0)
    prompts = [[4 + ord(c) for c in s] for s in ("12+34=", "7*8=", "hello")]
    reply = rollout_fp8.stub.Generate(
        request(prompts, n=2, max_tokens=12, temperature=0.8, seed=3), timeout=120
    )
    with_act = load_reference(rollout_fp8.model_dir, fp8=True, arithmetic="vllm")
    without_act = load_reference(rollout_fp8.model_dir, fp8=True, activation_fake_quant=False)
    errors = {"fp8 reference": [], "no activation fake-quant": []}
    for c in reply.completions:
        got = torch.tensor(list(c.logprobs), dtype=torch.float64)
        for name, model in (("fp8 reference", with_act), ("no activation fake-quant", without_act)):
            ref = reference_logprobs(model, list(c.prompt_token_ids), list(c.token_ids), temperature=0.8)
            errors[name].append((ref - got).abs())
    mean = {k: torch.cat(v).mean().item() for k, v in errors.items()}
    print("mean |logprob - reference|:", mean)
    assert mean["fp8 reference"] < 1e-2
    assert mean["no activation fake-quant"] > 10 * mean["fp8 reference"]  # the emulation is active


def engine_weight_set(rollout: InProcessRollout) -> dict[str, torch.Tensor]:
    """The engine's weights re-expressed as a WeightSet: fused q/k/v and gate/up split back into HF names,
    dequantized linears divided by the scales the engine holds (which gives back their codes exactly)."""
    engine = rollout.service.engine_weights()
    out: dict[str, torch.Tensor] = {}
    fused = {
        "qkv_proj": (("q_proj", "k_proj", "v_proj"), [256, 128, 128]),
        "gate_up_proj": (("gate_proj", "up_proj"), [512, 512]),
    }
    for name, t in engine.items():
        pieces = [(name, t)]
        for fused_name, (shard_names, rows) in fused.items():
            if fused_name in name:
                if name.endswith("weight_scale_inv"):
                    rows = [r // 128 for r in rows]
                pieces = [
                    (name.replace(fused_name, s), p) for s, p in zip(shard_names, t.split(rows), strict=True)
                ]
        out.update(pieces)
    for name in [n for n in out if n.endswith("weight_scale_inv")]:
        weight_name = name.removesuffix("_scale_inv")
        w, scales = out[weight_name], out[name]
        per_element = scales.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        out[weight_name] = (w / per_element).to(torch.float8_e4m3fn)
    return out


def overlapping(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> list[tuple[str, str]]:
    """Pairs of tensors, one from each mapping, whose bytes share memory."""

    def span(t: torch.Tensor) -> tuple[int, int]:
        begin = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
        return begin, begin + t.numel() * t.element_size()

    spans = [(span(t), name) for name, t in b.items() if t.numel()]
    return [
        (x, y)
        for x, t in a.items()
        if t.numel()
        for (lo, hi), y in spans
        if span(t)[0] < hi and lo < span(t)[1]
    ]


def assert_engine_holds(rollout: InProcessRollout, ws: WeightSet) -> None:
    held = engine_weight_set(rollout)
    assert set(held) == set(ws.tensors)
    for name, t in ws.tensors.items():
        assert held[name].dtype == t.dtype, name
        assert torch.equal(held[name].view(torch.uint8), t.view(torch.uint8)), name


def logprob_error_vs_reference(
    model_dir: Path, state: dict[str, torch.Tensor], prompt: list[int], completion: rollout_pb2.Completion
) -> torch.Tensor:
    """|engine logprob - float64 fake-quant reference| per token of a greedy ``completion``. Greedy logprobs
    are those of the unscaled distribution. FP8 rounding turns 1e-7 differences of kernel arithmetic into
    the odd flipped code (~1e-3 in a logprob); stale KV or stale weights would be far off."""
    reference = load_reference(model_dir, fp8=True, arithmetic="vllm")
    set_weights(reference, state, fp8=True)
    got = torch.tensor(list(completion.logprobs))
    return (reference_logprobs(reference, prompt, list(completion.token_ids)) - got).abs()


def test_keyframe_then_deltas_reach_the_engine_bit_exact(rollout_fp8: InProcessRollout) -> None:
    stub, model_dir = rollout_fp8.stub, rollout_fp8.model_dir
    state = random_state(model_dir, 0)
    sent = push_keyframe(rollout_fp8, state, version=10)
    assert_engine_holds(rollout_fp8, sent)
    long_prompt = [4 + (i * 7) % 90 for i in range(200)]  # longer than a KV block: exercises the prefix cache
    greedy = request([long_prompt], max_tokens=6, temperature=0.0)
    before = stub.Generate(greedy, timeout=120).completions[0]
    g = torch.Generator().manual_seed(5)
    for version in (11, 12, 13):
        state = {k: v + 0.3 * v.std() * torch.randn(v.shape, generator=g) for k, v in state.items()}
        new = build_weight_set(state, FP8, hp_dtype=torch.float32)
        reply = push(stub, encode_delta(new, sent, version=version, base_version=version - 1))
        assert (reply.version, reply.encoding) == (version, "delta")
        assert_engine_holds(rollout_fp8, new)
        # The replica applies deltas to its host copy in place: the engine must hold its own copy.
        assert not overlapping(rollout_fp8.service.held.tensors, rollout_fp8.service.engine_weights())
        sent = new
        after = stub.Generate(
            request([long_prompt], max_tokens=6, temperature=0.0, seed=1), timeout=120
        ).completions[0]
        assert after.weight_version == version
        assert list(after.logprobs) != list(before.logprobs)
        error = logprob_error_vs_reference(model_dir, state, long_prompt, after)
        print(f"version {version}: |logprob - reference| mean {error.mean():.1e} max {error.max():.1e}")
        assert error.mean() < 1e-2 and error.max() < 0.1
        before = after
    assert stub.GetStatus(common_pb2.GetStatusRequest()).weight_version == 13


def test_rejected_updates_change_nothing(rollout_fp8: InProcessRollout) -> None:
    stub = rollout_fp8.stub
    base_state = random_state(rollout_fp8.model_dir, 0)
    base = push_keyframe(rollout_fp8, base_state, version=20)
    new = build_weight_set(random_state(rollout_fp8.model_dir, 2, scale=0.1), FP8, hp_dtype=torch.float32)
    wrong_base = encode_delta(new, base, version=22, base_version=21)
    with pytest.raises(grpc.RpcError) as err:
        push(stub, wrong_base)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "holds version 20" in err.value.details()

    good = list(update_to_chunks(encode_delta(new, base, version=21, base_version=20), chunk_bytes=64 * 1024))
    corrupted = [*good]
    flipped = bytearray(corrupted[3].data)
    flipped[100] ^= 0xFF
    corrupted[3] = weights_pb2.WeightChunk(data=bytes(flipped))
    for name, chunks in {
        "corrupted": corrupted,
        "truncated": good[:-1],
        "reordered": [good[0], good[2], good[1], *good[3:]],
    }.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.UpdateWeights(iter(chunks), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    assert stub.GetStatus(common_pb2.GetStatusRequest()).weight_version == 20
    assert_engine_holds(rollout_fp8, base)
    assert len(stub.Generate(request([[5, 6]], version=20), timeout=60).completions) == 1
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(request([[5, 6]], version=21), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stub.UpdateWeights(iter(good), timeout=60).version == 21  # the intact stream still applies


def test_an_update_streamed_in_parts_is_applied_whole_or_not_at_all(rollout_fp8: InProcessRollout) -> None:
    """A delta in parts of 64 KiB: each part is applied to the held set as it arrives, and a stream that
    fails after some parts (a corrupt part, one of another update, the sender breaking off) leaves the
    held set and the engine as they were; the trainer's publisher streams it whole."""
    stub = rollout_fp8.stub
    base = push_keyframe(rollout_fp8, random_state(rollout_fp8.model_dir, 0), version=40)
    new = build_weight_set(random_state(rollout_fp8.model_dir, 5, scale=0.1), FP8, hp_dtype=torch.float32)
    small = 64 * 1024
    good = list(parts_to_chunks(delta_parts(new, base, 41, 40, part_bytes=small), chunk_bytes=small))
    starts = [i for i, c in enumerate(good) if c.WhichOneof("part") == "header"]
    assert len(starts) > 3
    other = list(parts_to_chunks(delta_parts(new, base, 42, 40, part_bytes=small), chunk_bytes=small))
    corrupted = [*good]
    flipped = bytearray(good[starts[2] - 1].data)  # the last data chunk of part 1
    flipped[-1] ^= 0xFF
    corrupted[starts[2] - 1] = weights_pb2.WeightChunk(data=bytes(flipped))

    def broken_off() -> Iterator[weights_pb2.WeightChunk]:
        yield from good[: starts[2]]
        raise ConnectionError("the trainer went away")

    for name, chunks in {
        "a corrupt part": iter(corrupted),
        "a part of another update": iter(good[: starts[1]] + other[starts[1] :]),
        "the last part missing": iter(good[: starts[-1]]),
        "broken off": broken_off(),
    }.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.UpdateWeights(chunks, timeout=60)
        # (A sender that breaks off sees its own error; the replica sees the stream cancelled.)
        assert err.value.code() == (
            grpc.StatusCode.UNKNOWN if name == "broken off" else grpc.StatusCode.INVALID_ARGUMENT
        ), name
        assert stub.GetStatus(common_pb2.GetStatusRequest()).weight_version == 40, name
    assert_engine_holds(rollout_fp8, base)
    # The held set was put back bit for bit: a delta against it rebuilds every tensor's digest.
    assert stub.UpdateWeights(iter(good), timeout=60).version == 41
    assert_engine_holds(rollout_fp8, new)

    newer = build_weight_set(random_state(rollout_fp8.model_dir, 6, scale=0.1), FP8, hp_dtype=torch.float32)
    publisher = Publisher(FP8, torch.float32, "fp8", part_bytes=small)
    publisher.last = (41, new)
    try:
        [delivery] = publisher.publish(42, dict, [Target(rollout_fp8.server.address, 41)], built=newer)
    except BaseException:
        publisher.close()
        raise
    assert delivery.ok and delivery.encoding == "delta", delivery.error
    assert delivery.plane == "shared-memory"  # (the replica is on this host: its parts by memfd)
    assert 0 < delivery.wire_bytes < newer.nbytes and 0 < delivery.density <= 1
    assert_engine_holds(rollout_fp8, newer)

    # The trainer's encoder fails at the last part, after the replica applied the others: the publish
    # fails (no keyframe can be made of that set either), and the replica puts every part back.
    unencodable = WeightSet(newer.format, {**new.tensors, "zz.unknown": torch.zeros(4, dtype=torch.int16)})
    publisher.last = (42, newer)
    with pytest.raises(RuntimeError, match="encoding the delta failed"):
        publisher.publish(43, dict, [Target(rollout_fp8.server.address, 42)], built=unencodable)
    publisher.close()
    assert stub.GetStatus(common_pb2.GetStatusRequest()).weight_version == 42
    assert_engine_holds(rollout_fp8, newer)
    assert stub.UpdateWeights(parts_to_chunks(delta_parts(new, newer, 43, 42)), timeout=60).version == 43
    assert_engine_holds(rollout_fp8, new)


def test_each_update_takes_the_first_data_plane_that_reaches_the_replica(
    rollout_fp8: InProcessRollout,
) -> None:
    """The publisher finds the replica's planes (GetStatus): on this host, it hands it each part as shared
    memory; with shared memory off (or out of reach: another network namespace), it sends the parts over
    the replica's TCP port on parallel connections; with both off or out of reach, over gRPC. A keyframe,
    then deltas, reach the engine bit for bit on every plane."""
    address, model_dir = rollout_fp8.server.address, rollout_fp8.model_dir
    status = rollout_fp8.stub.GetStatus(common_pb2.GetStatusRequest())
    assert status.segment_inbox.startswith("fp8rl-segments-") and status.tcp_updates_port > 0
    with socket.socket() as unused:  # (a port nobody listens on)
        unused.bind(("127.0.0.1", 0))
        closed_port = unused.getsockname()[1]
    sets = [build_weight_set(random_state(model_dir, seed), FP8, hp_dtype=torch.float32) for seed in range(6)]
    publishers = {
        "shared-memory": Publisher(FP8, torch.float32, "fp8", part_bytes=64 * 1024),
        "tcp": Publisher(FP8, torch.float32, "fp8", part_bytes=64 * 1024, shared_memory=False, tcp_streams=3),
        "tcp, shared memory out of reach": Publisher(FP8, torch.float32, "fp8", part_bytes=64 * 1024),
        "off": Publisher(FP8, torch.float32, "fp8", shared_memory=False, tcp_streams=0),
        "out of reach": Publisher(FP8, torch.float32, "fp8"),
    }
    publishers["tcp, shared memory out of reach"]._reach[address] = Reach(
        "fp8rl-segments-elsewhere", status.tcp_updates_port
    )
    publishers["out of reach"]._reach[address] = Reach("fp8rl-segments-elsewhere", closed_port)
    try:
        held = -1
        runs = [("shared-memory", publishers["shared-memory"]), *publishers.items()]
        for version, (name, publisher) in enumerate(runs, 60):
            weights = sets[version - 60]
            publisher.last = (held, sets[held - 60]) if held >= 60 else None
            [delivery] = publisher.publish(version, dict, [Target(address, held)], built=weights)
            plane = name.split(",")[0] if name.startswith(("shared", "tcp")) else "grpc"
            expected = ("keyframe" if held < 0 else "delta", plane)
            assert delivery.ok and (delivery.encoding, delivery.plane) == expected, (name, delivery)
            assert_engine_holds(rollout_fp8, weights)
            held = version
    finally:
        for publisher in publishers.values():
            publisher.close()
    assert rollout_fp8.service.tcp_inbox is not None
    deadline = time.monotonic() + 10
    while rollout_fp8.service.tcp_inbox.connections() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rollout_fp8.service.tcp_inbox.connections() == 0  # every connection closed with its update


def test_an_update_whose_tcp_plane_breaks_goes_again_over_grpc(rollout_fp8: InProcessRollout) -> None:
    """The trainer's connections reach something that is not the replica's plane (a decoy inbox, which
    never hears the tickets and drops them after a second): the call ends as soon as the connection
    breaks, the replica drops the update it was waiting for, and the same update goes over gRPC; the TCP
    plane is left alone for the next updates, which go over gRPC at once."""
    address, model_dir = rollout_fp8.server.address, rollout_fp8.model_dir
    decoy = TcpInbox("127.0.0.1", 0, idle_s=1.0)
    sets = [build_weight_set(random_state(model_dir, seed), FP8, hp_dtype=torch.float32) for seed in (7, 8)]
    publisher = Publisher(FP8, torch.float32, "fp8", part_bytes=64 * 1024, shared_memory=False)
    publisher._reach[address] = Reach("", decoy.port)
    try:
        started = time.monotonic()
        [delivery] = publisher.publish(70, dict, [Target(address, 69)], built=sets[0])
        assert delivery.ok and (delivery.encoding, delivery.plane) == ("keyframe", "grpc"), delivery
        assert time.monotonic() - started < 15  # (not the replica's idle limit of 30 s)
        assert_engine_holds(rollout_fp8, sets[0])
        assert publisher._tcp_paused[address] > time.monotonic()
        [delivery] = publisher.publish(71, dict, [Target(address, 70)], built=sets[1])
        assert delivery.ok and (delivery.encoding, delivery.plane) == ("delta", "grpc"), delivery
        assert_engine_holds(rollout_fp8, sets[1])
    finally:
        publisher.close()
        decoy.close()


def test_no_completion_mixes_weight_versions(rollout_fp8: InProcessRollout) -> None:
    """Generate concurrently while the weights flip between two very different versions; every
    completion's logprobs must match the reference of the one version it reports."""
    stub, model_dir = rollout_fp8.stub, rollout_fp8.model_dir
    states = {30: random_state(model_dir, 0), 31: random_state(model_dir, 3)}
    sets = {v: build_weight_set(s, FP8, hp_dtype=torch.float32) for v, s in states.items()}
    push(stub, encode_keyframe(sets[30], 30))
    results: list[rollout_pb2.Completion] = []
    errors: list[BaseException] = []

    def client(seed: int) -> None:
        try:
            for k in range(3):
                reply = stub.Generate(
                    request([[5 + seed, 6, 7]], n=2, max_tokens=24, seed=seed * 10 + k), timeout=120
                )
                results.extend(reply.completions)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    held = 30
    for version in (31, 32, 33, 34):
        target = 31 if version % 2 else 30
        ws_new = sets[target]
        reply = push(stub, encode_keyframe(WeightSet(ws_new.format, dict(ws_new.tensors)), version))
        assert reply.version == version
        held = version
    for t in threads:
        t.join()
    assert not errors, errors
    assert held == 34 and len(results) == 18
    references = {}
    for v, s in states.items():
        references[v] = load_reference(model_dir, fp8=True, arithmetic="vllm")
        set_weights(references[v], s, fp8=True)
    versions_seen = set()
    for c in results:
        source = 30 if c.weight_version in (30, 32, 34) else 31
        versions_seen.add(c.weight_version)
        own = reference_logprobs(references[source], list(c.prompt_token_ids), list(c.token_ids))
        other = reference_logprobs(references[61 - source], list(c.prompt_token_ids), list(c.token_ids))
        got = torch.tensor(list(c.logprobs), dtype=torch.float64)
        assert (own - got).abs().mean() < 1e-2, f"completion at version {c.weight_version} does not match it"
        # Token by token: wherever the two versions disagree clearly, the logprob is its own version's.
        telling = (own - other).abs() > 0.1
        assert telling.sum() >= len(c.token_ids) // 2
        assert ((own - got).abs() < (other - got).abs())[telling].all(), (
            f"mixed versions at {c.weight_version}"
        )
    print("versions seen by completions:", sorted(versions_seen))


NARROWED = "model.layers.1.mlp.down_proj.weight"
NARROWED_SCALE = NARROWED.removesuffix("weight") + "weight_scale_inv"


def with_narrow_down_proj(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with layer 1's down_proj (and its scales) cut to 256 of its 512 input columns."""
    return tensors | {
        NARROWED: tensors[NARROWED][:, :256].contiguous(),
        NARROWED_SCALE: tensors[NARROWED_SCALE][:, :2].contiguous(),
    }


def test_a_set_the_model_cannot_take_is_refused_before_the_engine(rollout_fp8: InProcessRollout) -> None:
    stub = rollout_fp8.stub
    good = push_keyframe(rollout_fp8, random_state(rollout_fp8.model_dir, 0), version=40)
    # Digests check out (they were computed over these very bytes), but the model has no room for a
    # down_proj of this shape: refused before anything reaches the engine.
    broken = with_narrow_down_proj(good.tensors)
    missing = {k: v for k, v in good.tensors.items() if k != "lm_head.weight"}
    for bad in (broken, missing):
        with pytest.raises(grpc.RpcError) as err:
            push(stub, encode_keyframe(WeightSet(FP8, bad), 41))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(
            "weights:"
        )
    status = stub.GetStatus(common_pb2.GetStatusRequest(), timeout=10)
    assert status.weight_version == 40 and not status.needs_keyframe
    assert_engine_holds(rollout_fp8, good)
    assert len(stub.Generate(request([[5, 6]], version=40), timeout=60).completions) == 1
    # A delta is XORed into the held set in place before its values are checked: a NaN it brings is
    # refused, and the held set is put back, bit for bit.
    poisoned = dict(good.tensors)
    poisoned["model.norm.weight"] = poisoned["model.norm.weight"].clone()
    poisoned["model.norm.weight"][3] = float("nan")
    with pytest.raises(grpc.RpcError) as err:
        push(stub, encode_delta(WeightSet(FP8, poisoned), good, version=41, base_version=40))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in err.value.details()
    assert WeightSet(FP8, dict(rollout_fp8.service.held.tensors)).digest == good.digest  # hashed afresh
    assert_engine_holds(rollout_fp8, good)


def test_an_engine_that_fails_midway_is_healed_by_a_keyframe(rollout_fp8: InProcessRollout) -> None:
    stub, service = rollout_fp8.stub, rollout_fp8.service
    good = push_keyframe(rollout_fp8, random_state(rollout_fp8.model_dir, 0), version=50)
    # A set vLLM itself refuses partway through the refit: layer 0 loads, then layer 1's down_proj has no
    # room. The replica's own shape check would refuse it first, so the test widens that check.
    other = build_weight_set(random_state(rollout_fp8.model_dir, 3), FP8, hp_dtype=torch.float32)
    broken = with_narrow_down_proj(other.tensors)
    schema = dict(service.schema)
    service.schema = {**schema, NARROWED: ((256, 256), True), NARROWED_SCALE: ((2, 2), False)}
    try:
        with pytest.raises(grpc.RpcError) as err:
            push(stub, encode_keyframe(WeightSet(FP8, broken), 51))
    finally:
        service.schema = schema
    print("engine failure:", err.value.code(), err.value.details()[:300])
    assert stub.GetStatus(common_pb2.GetStatusRequest(), timeout=10).needs_keyframe
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(request([[5, 6]]), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "needs keyframe" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # a delta has nothing to apply to
        push(stub, encode_delta(other, good, version=51, base_version=50))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    state = random_state(rollout_fp8.model_dir, 4, scale=0.1)
    healed = push_keyframe(rollout_fp8, state, version=52)
    assert not stub.GetStatus(common_pb2.GetStatusRequest(), timeout=10).needs_keyframe
    assert_engine_holds(rollout_fp8, healed)
    prompt = [4 + (i * 5) % 90 for i in range(40)]
    after = stub.Generate(request([prompt], max_tokens=6, temperature=0.0, version=52), timeout=120)
    error = logprob_error_vs_reference(rollout_fp8.model_dir, state, prompt, after.completions[0])
    assert error.mean() < 1e-2 and error.max() < 0.1


def test_a_refit_whose_prefix_cache_is_not_reset_fails_and_heals(
    rollout_fp8: InProcessRollout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's reset_prefix_cache() returns False when it could not drop the cache: KV computed under the
    old weights could then be reused, so the refit fails (and the replica heals with a keyframe)."""
    stub, engine = rollout_fp8.stub, rollout_fp8.service.engine
    monkeypatch.setattr(engine.llm, "reset_prefix_cache", lambda *args, **kwargs: False)
    with pytest.raises(grpc.RpcError) as err:
        push_keyframe(rollout_fp8, random_state(rollout_fp8.model_dir, 0), version=60)
    assert "prefix cache" in err.value.details()
    assert stub.GetStatus(common_pb2.GetStatusRequest(), timeout=10).needs_keyframe
    healed = push_keyframe(rollout_fp8, random_state(rollout_fp8.model_dir, 0), version=61)  # a fresh engine
    assert_engine_holds(rollout_fp8, healed)


def test_replica_refuses_scales_outside_the_contract(tiny_model_dir_f32: Path) -> None:
    """Scales must be positive and finite, and powers of two when the replica serves pow2 weights; no
    tensor may hold NaN or inf."""
    from fp8rl.errors import InvalidRequest
    from rollout_service.service import check_schema, expected_schema

    state = random_state(tiny_model_dir_f32, 0)
    scale = "model.layers.0.mlp.up_proj.weight_scale_inv"
    for weight_format in ("fp8-block128", "fp8-block128-pow2"):
        schema = expected_schema(tiny_model_dir_f32, weight_format)  # type: ignore[arg-type]
        good = build_weight_set(state, weight_format, hp_dtype=torch.float32)  # type: ignore[arg-type]
        check_schema(good, schema)
        for bad_value in (0.0, -1.0, float("nan"), float("inf")):
            tensors = dict(good.tensors)
            tensors[scale] = tensors[scale].clone()
            tensors[scale][0, 0] = bad_value
            with pytest.raises(InvalidRequest, match=r"positive and finite|NaN or inf"):
                check_schema(WeightSet(weight_format, tensors), schema)  # type: ignore[arg-type]
    nan_weights = dict(good.tensors)  # a NaN in a high-precision tensor, and E4M3's NaN code
    nan_weights["model.norm.weight"] = nan_weights["model.norm.weight"].clone()
    nan_weights["model.norm.weight"][3] = float("nan")
    with pytest.raises(InvalidRequest, match=r"model\.norm\.weight holds NaN or inf"):
        check_schema(WeightSet("fp8-block128-pow2", nan_weights), schema)
    nan_code = dict(good.tensors)
    codes = nan_code["model.layers.1.mlp.down_proj.weight"].clone()
    codes.view(torch.uint8)[0, 0] = 0xFF
    nan_code["model.layers.1.mlp.down_proj.weight"] = codes
    with pytest.raises(InvalidRequest, match=r"down_proj\.weight holds NaN or inf"):
        check_schema(WeightSet("fp8-block128-pow2", nan_code), schema)
    fp32_scales = build_weight_set(state, "fp8-block128", hp_dtype=torch.float32).tensors
    with pytest.raises(
        InvalidRequest, match=r"weights: model\.layers\..* holds a scale that is not a power of two"
    ):
        check_schema(WeightSet("fp8-block128-pow2", fp32_scales), schema)


def test_replica_with_an_fp8_kv_cache_takes_float32_scalar_kv_scales(tiny_model_dir_f32: Path) -> None:
    """A -kv replica's sets carry each layer's q_scale, k_scale and v_scale (float32 scalars, positive
    and finite, powers of two under pow2); a set without them, or one that brings them to a replica
    without an FP8 cache, is refused by name."""
    from fp8rl.errors import InvalidRequest
    from rollout_service.service import admit_tensor, check_schema, expected_schema

    state = random_state(tiny_model_dir_f32, 0)
    kv = {f"model.layers.{i}.self_attn.{x}_scale": torch.tensor(0.25) for i in range(2) for x in "qkv"}
    for weight_format in ("fp8-block128", "fp8-block128-pow2"):
        schema = expected_schema(tiny_model_dir_f32, weight_format, kv_cache_scales=True)  # type: ignore[arg-type]
        good = build_weight_set(state | kv, weight_format, hp_dtype=torch.bfloat16)  # type: ignore[arg-type]
        assert good.tensors["model.layers.1.self_attn.v_scale"].dtype == torch.float32  # not hp_dtype
        check_schema(good, schema)
        without = {n: t for n, t in good.tensors.items() if n not in kv}
        with pytest.raises(InvalidRequest, match=r"missing \['model\.layers\.0\.self_attn\.k_scale'"):
            check_schema(WeightSet(weight_format, without), schema)  # type: ignore[arg-type]
        plain_schema = expected_schema(tiny_model_dir_f32, weight_format)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match=r"extra \['model\.layers\.0\.self_attn\.k_scale'"):
            check_schema(good, plain_schema)
        for bad in (0.0, -0.25, float("nan"), float("inf")):
            tensors = dict(good.tensors) | {"model.layers.0.self_attn.v_scale": torch.tensor(bad)}
            with pytest.raises(InvalidRequest, match=r"self_attn\.v_scale holds"):
                check_schema(WeightSet(weight_format, tensors), schema)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match=r"k_scale has shape \(1,\)"):
        admit_tensor(schema, "model.layers.0.self_attn.k_scale", torch.float32, (1,))
    with pytest.raises(InvalidRequest, match=r"k_scale has dtype torch.bfloat16"):
        admit_tensor(schema, "model.layers.0.self_attn.k_scale", torch.bfloat16, ())
    not_pow2 = dict(good.tensors) | {"model.layers.1.self_attn.k_scale": torch.tensor(0.3)}
    with pytest.raises(InvalidRequest, match=r"k_scale holds a scale that is not a power of two"):
        check_schema(WeightSet("fp8-block128-pow2", not_pow2), schema)


def test_vllm_environment_follows_the_scale_format() -> None:
    from rollout_service.engine import pin_vllm_fp8_environment

    for scale_format, e8m0 in (("fp32", "0"), ("pow2", "1")):
        env: dict[str, str] = {}
        pin_vllm_fp8_environment(scale_format, env)  # type: ignore[arg-type]
        assert env == {"VLLM_USE_DEEP_GEMM_E8M0": e8m0, "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0"}
    with pytest.raises(ValueError, match="VLLM_USE_DEEP_GEMM_E8M0=1 conflicts with the recipe's fp32"):
        pin_vllm_fp8_environment("fp32", {"VLLM_USE_DEEP_GEMM_E8M0": "1"})


def test_platform_checks_name_what_the_recipe_needs(tiny_model_dir_f32: Path) -> None:
    from rollout_service.config import RolloutConfig
    from rollout_service.engine import Platform, unsupported_reason

    def reason(recipe: str, platform: Platform, dtype: str = "auto") -> str | None:
        return unsupported_reason(
            RolloutConfig(model=tiny_model_dir_f32, recipe=recipe, dtype=dtype), platform
        )  # type: ignore[arg-type]

    cpu = Platform(None)  # (FP8 GEMMs and the FP8 KV cache are emulated on any CPU)
    assert reason("fp8-kv", cpu) is None and reason("fp8-kv-pow2", cpu) is None
    assert reason("fp8", cpu, "float32") is None
    hopper, ampere = Platform((9, 0)), Platform((8, 0))
    assert reason("fp8", hopper, "bfloat16") is None and reason("fp8-kv", hopper, "float16") is None
    assert "dtype float32" in str(reason("fp8", hopper, "float32"))
    assert reason("fp8", hopper) is None  # auto: vLLM computes a float32 checkpoint in bfloat16
    assert "compute capability 9.0" in str(reason("fp8", ampere, "bfloat16"))
    assert reason("bf16", ampere, "float32") is None
    exact = {"consistency": "exact"}
    on_cpu = RolloutConfig(model=tiny_model_dir_f32, recipe="fp8", dtype="float32", precision=exact)
    assert unsupported_reason(on_cpu, cpu) is None
    assert "CUDA wiring is not written" in str(unsupported_reason(on_cpu, hopper))
    sharded = on_cpu.model_copy(update={"tensor_parallel_size": 2})
    assert "tensor_parallel_size 1" in str(unsupported_reason(sharded, cpu))


def test_refit_api_is_checked_before_the_engine_loads() -> None:
    """The installed vLLM has the refit signature; a vLLM whose runner has the old ``reload_weights(self)``
    (before 2026) is refused with the version to install."""
    from rollout_service.engine import TESTED_VLLM, UnsupportedPlatform, check_refit_api

    check_refit_api()

    class OldRunner:
        def reload_weights(self) -> None: ...

    class NoRunnerMethod: ...

    for runner in (OldRunner, NoRunnerMethod):
        with pytest.raises(UnsupportedPlatform, match=f"install vllm=={TESTED_VLLM}"):
            check_refit_api(runner)


def test_capacity_limits_answer_resource_exhausted_and_health_keeps_serving(
    rollout_fp8: InProcessRollout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-request samples, queue depth and concurrent Generate calls are capped (RESOURCE_EXHAUSTED, the
    field or setting named; a full queue or full slots flagged busy, which asking again may get past, a
    request over the per-request cap not); a text too long for the context is refused before tokenizing;
    a stalled UpdateWeights stream is cancelled after stream_idle_s; health and status answer throughout."""
    import dataclasses

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from fp8rl.serving import BUSY_METADATA, Capacity

    stub, service, servicer = rollout_fp8.stub, rollout_fp8.service, rollout_fp8.servicer
    push_keyframe(rollout_fp8, random_state(rollout_fp8.model_dir, 0), version=70)
    health = health_pb2_grpc.HealthStub(rollout_fp8.channel)

    def still_serving() -> None:
        assert (
            health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            == health_pb2.HealthCheckResponse.SERVING
        )
        assert stub.GetStatus(common_pb2.GetStatusRequest(), timeout=5).weight_version == 70

    def refused(req: rollout_pb2.GenerateRequest) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(req, timeout=60)
        return err.value

    def busy(err: grpc.RpcError) -> bool:
        return any(key == BUSY_METADATA for key, _ in err.trailing_metadata() or ())

    monkeypatch.setattr(
        service, "limits", dataclasses.replace(service.limits, max_samples=4, max_prompt_bytes=100)
    )
    err = refused(request([[5, 6], [7, 8]], n=3))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.details().startswith(
        "prompts x n: 6 samples"
    )
    assert not busy(err)
    err = refused(request(["1+1=" * 30]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "120 bytes of text cannot fit" in err.details()
    monkeypatch.setattr(service.loop, "max_queued", 2)
    err = refused(request([[5, 6], [7, 8], [9, 10]]))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queued_samples" in err.details()
    assert busy(err)
    still_serving()

    # One Generate slot: while one call holds it (waiting behind an exclusive engine job), a second call
    # is refused at once, and health and status still answer.
    monkeypatch.setattr(servicer, "generating", Capacity("Generate", 1))
    release, replies = threading.Event(), []
    job = threading.Thread(target=service.loop.run_exclusive, args=(lambda: release.wait(30),))
    job.start()
    holder = threading.Thread(
        target=lambda: replies.append(stub.Generate(request([[5, 6]], max_tokens=2), timeout=60))
    )
    holder.start()
    while servicer.generating.in_use == 0:  # the first call holds the slot (waiting behind the job)
        time.sleep(0.05)
    err = refused(request([[5, 6]], max_tokens=2))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Generate: 1 calls in flight" in err.details()
    assert busy(err)
    still_serving()
    release.set()
    job.join()
    holder.join()
    assert len(replies) == 1

    # A stream that sends its header, then nothing: cancelled after stream_idle_s, its thread freed.
    monkeypatch.setattr(service.config, "stream_idle_s", 0.5)
    keyframe = encode_keyframe(
        build_weight_set(random_state(rollout_fp8.model_dir, 0), FP8, torch.float32), 71
    )
    header = next(iter(update_to_chunks(keyframe, 1 << 20)))
    stalled = threading.Event()

    def chunks():  # type: ignore[no-untyped-def]
        yield header
        stalled.wait(30)

    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as stream_err:
        stub.UpdateWeights(chunks(), timeout=30)
    stalled.set()
    assert stream_err.value.code() == grpc.StatusCode.CANCELLED and time.monotonic() - started < 10
    still_serving()
    assert len(stub.Generate(request([[5, 6]], max_tokens=2), timeout=60).completions) == 1
