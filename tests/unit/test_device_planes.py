"""The device planes (fp8rl/codec/device_planes.py): the bucket plan both sides share, the fingerprint,
and a real broadcast over Gloo from this process to replica workers in processes of their own, bit for
bit, all or nothing. CUDA IPC and NCCL need a GPU (marked gpu; scripts/gpu_proof.py check i)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fp8rl import quant
from fp8rl.codec import device_planes as planes
from fp8rl.codec.device_planes import ALIGN, BroadcastSender, UpdateInfo

ROOT = Path(__file__).resolve().parents[2]


def weight_set(
    seed: int, layers: int = 2, hidden: int = 256, inter: int = 640
) -> list[tuple[str, torch.Tensor]]:
    """A small FP8 weight set as the trainer publishes one: block-quantized codes and their scales,
    bf16 norms, odd sizes (an 81-element tensor is not a multiple of anything)."""
    g = torch.Generator().manual_seed(seed)
    named: list[tuple[str, torch.Tensor]] = []
    for layer in range(layers):
        for module, shape in (("mlp.up_proj", (inter, hidden)), ("mlp.down_proj", (hidden, inter))):
            codes, scales = quant.quantize_blockwise(torch.randn(shape, generator=g))
            named += [(f"model.layers.{layer}.{module}.weight", codes)]
            named += [(f"model.layers.{layer}.{module}.weight_scale_inv", scales)]
        named.append(
            (f"model.layers.{layer}.input_layernorm.weight", torch.randn(hidden, generator=g).bfloat16())
        )
    named.append(("model.odd", torch.randn(81, generator=g)))
    return planes.named_tensors(named)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_buckets_hold_every_tensor_aligned_in_order_and_within_their_size() -> None:
    named = weight_set(seed=1)
    for bucket_bytes in (ALIGN, 4096, 100_000, 1 << 30):
        info = planes.update_info(named, bucket_bytes)
        buckets = planes.plan_buckets(info)
        slots = [slot for bucket in buckets for slot in bucket]
        assert [s.index for s in slots] == list(range(len(named)))
        for bucket in buckets:
            assert bucket[0].offset == 0 and all(s.offset % ALIGN == 0 for s in bucket)
            # over the size only where one tensor alone is larger
            assert planes.bucket_size(bucket) <= bucket_bytes or len(bucket) == 1
            ends = [s.offset + s.nbytes for s in bucket]
            assert all(end <= nxt.offset for end, nxt in zip(ends, bucket[1:], strict=False))
        if bucket_bytes == 1 << 30:
            assert len(buckets) == 1
        packed = [planes.pack(b, [t for _, t in named], "cpu") for b in buckets]
        back = [
            nt for buffer, b in zip(packed, buckets, strict=True) for nt in planes.unpack(buffer, b, info)
        ]
        assert [n for n, _ in back] == [n for n, _ in named]
        assert all(same_bits(t, u) for (_, t), (_, u) in zip(named, back, strict=True))


def planned(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> UpdateInfo:
    return planes.plan_update(named, torch.device("cpu"), bucket_bytes)


def test_a_plan_is_refused_by_the_field_that_is_wrong_before_anything_is_allocated() -> None:
    named = weight_set(seed=2)
    info = planned(named, 4096)
    total = planes.check_update_info(info, max_bytes=1 << 20)
    assert total == sum(info.tensor_bytes())
    cases = {
        "dtype_names": replace(info, dtype_names=("int64",) * len(info.names)),
        "shapes": replace(info, names=info.names[:1], dtype_names=info.dtype_names[:1], shapes=((-1, 4),)),
        "names": replace(info, names=(info.names[0],) * len(info.names)),
        "packed_buffer_size_bytes": replace(info, packed_buffer_size_bytes=16),
        "fingerprints": replace(info, fingerprints=info.fingerprints[:1]),
    }
    cases["shapes "] = replace(info, shapes=((0, 2**70), *info.shapes[1:]))  # (no product overflows)
    cases["fingerprints "] = replace(info, fingerprints=())  # (a plan without them is never received)
    cases["ipc_handles"] = info  # (none, where IPC needs one per bucket)
    cases["digests"] = replace(info, digests=("00" * 32,) * (len(info.digests) - 1))
    cases["digests "] = replace(info, digests=("not hex",) * len(info.digests))
    for field, bad in cases.items():
        with pytest.raises(ValueError, match=field.strip()):
            planes.check_update_info(bad, max_bytes=1 << 20, ipc=field == "ipc_handles")
    with pytest.raises(ValueError, match="more than the model's"):  # (before a byte is allocated)
        planes.check_update_info(UpdateInfo(("w",), ("float32",), ((1 << 40,),)), max_bytes=1 << 20)
    with pytest.raises(ValueError, match="named: the tensors are not the plan's"):  # (the sender's side)
        planes.check_named(info, named[::-1])


def test_the_fingerprint_sees_a_changed_and_a_moved_word_and_not_how_it_is_sliced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    buffer = torch.randint(0, 256, ((1 << 20) + 7,), dtype=torch.uint8, generator=g)  # (with a 3-byte tail)
    base = planes.fingerprint(buffer)
    for where in (12345, len(buffer) - 1):  # a word, and the tail
        flipped = buffer.clone()
        flipped[where] ^= 1
        assert planes.fingerprint(flipped) != base
    swapped = buffer.clone()
    swapped[:4], swapped[4:8] = buffer[4:8].clone(), buffer[:4].clone()
    assert swapped.equal(buffer) or planes.fingerprint(swapped) != base
    assert planes.fingerprint(buffer.clone()) == base  # (plain integers: a copy anywhere gives the same)
    monkeypatch.setattr(planes, "_FINGERPRINT_WORDS", 1000)  # summed in many more slices: the same
    assert planes.fingerprint(buffer) == base
    shifted = torch.empty(len(buffer) + 1, dtype=torch.uint8)
    shifted[1:] = buffer
    assert planes.fingerprint(shifted[1:]) == base  # (a view whose words are not 4-byte aligned)


def test_an_empty_tensor_never_opens_a_bucket_of_its_own() -> None:
    named = [("a", torch.zeros(63, dtype=torch.uint8)), ("b", torch.zeros(0)), ("c", torch.zeros((0, 4)))]
    buckets = planes.plan_buckets(planes.update_info(named, bucket_bytes=256))
    assert len(buckets) == 1 and [s.nbytes for s in buckets[0]] == [63, 0, 0]


def test_an_ipc_handle_survives_the_control_plane_and_a_wrong_one_is_refused_by_its_field() -> None:
    """The fields ``ipc_handle`` makes (tuples, bytes) come back from JSON (lists, base64) as they were;
    a handle of another size, or a field of the wrong kind, is refused before anything is mapped."""
    handle = {
        "tensor_size": (4096,),
        "tensor_stride": (1,),
        "tensor_offset": 0,
        "storage_handle": bytes(range(64)),
        "storage_size_bytes": 1 << 20,
        "storage_offset_bytes": 512,
        "requires_grad": False,
        "ref_counter_handle": b"counter",
        "ref_counter_offset": 3,
        "event_handle": None,
        "event_sync_required": True,
    }
    info = replace(
        planes.update_info([("w", torch.zeros(4096, dtype=torch.uint8))]), ipc_handles=({"gpu": handle},)
    )
    crossed = planes.from_json_dict(json.loads(json.dumps(planes.to_json_dict(info))))
    assert planes.ipc_fields(crossed.ipc_handles[0]["gpu"], 4096) == handle
    with pytest.raises(ValueError, match="not a buffer of the plan's 8192 bytes"):
        planes.ipc_fields(handle, 8192)
    with pytest.raises(ValueError, match="storage_handle is not a bytes"):
        planes.ipc_fields({**handle, "storage_handle": 7}, 4096)
    with pytest.raises(ValueError, match="ref_counter_handle is not base64"):
        planes.ipc_fields({**handle, "ref_counter_handle": "not base64!"}, 4096)


RECEIVER = textwrap.dedent(
    """
    import json, sys, torch
    from fp8rl.codec import device_planes as planes
    init = planes.BroadcastInit(**json.loads(sys.argv[1]))
    receiver = planes.BroadcastReceiver(torch.device("cpu"), max_bytes=1 << 30)
    receiver.init_transfer_engine(init, local_rank=int(sys.argv[2]))
    for line in sys.stdin:
        info = planes.from_json_dict(json.loads(line))
        loaded = []
        try:
            receiver.receive_weights(info, lambda batch: loaded.extend(
                (n, planes.fingerprint(t.contiguous().view(-1).view(torch.uint8))) for n, t in batch))
            print(json.dumps({"loaded": [[n, str(f)] for n, f in loaded]}), flush=True)
        except ValueError as exc:
            print(json.dumps({"refused": str(exc), "loaded": len(loaded)}), flush=True)
    """
)


def forged(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``named`` with three consecutive int32 words of its first tensor moved by +1000, -2000, +1000:
    other bytes with the same fingerprint (both its sums are linear), which only the digest tells apart."""
    name, first = named[0]
    changed = first.clone()
    words = changed.view(-1).view(torch.uint8)[:12].view(torch.int32)
    words += torch.tensor([1000, -2000, 1000], dtype=torch.int32)
    return [(name, changed), *named[1:]]


def test_a_broadcast_over_gloo_reaches_every_worker_bit_for_bit_and_a_damaged_plan_loads_nothing() -> None:
    """Each worker loads exactly the plan's bytes; a plan whose fingerprint does not match, and bytes
    forged to match the fingerprint but not the digest the plan vouches for, load nothing (and every
    worker still takes the whole broadcast)."""
    sender = BroadcastSender.listen("127.0.0.1", world_size=3, backend="gloo", device="cpu", timeout_s=60)
    fields = ("master_address", "master_port", "rank_offset", "world_size", "backend", "timeout_s")
    init = json.dumps({k: getattr(sender.init, k) for k in fields})
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", RECEIVER, init, str(rank)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        sender.trainer_init()
        for seed, damage in ((torch.seed() % 2**31, ""), (7, "fingerprint"), (8, "forged")):
            named = weight_set(seed)
            info = sender.plan(named, bucket_bytes=64 << 10)  # (several buckets)
            assert len(planes.plan_buckets(info)) > 3
            told, sent = info, named
            if damage == "fingerprint":  # the plan a worker is told does not match the bytes broadcast
                told = replace(info, fingerprints=(info.fingerprints[0] ^ 1, *info.fingerprints[1:]))
            if damage == "forged":
                sent = forged(named)
                assert not torch.equal(sent[0][1].view(torch.uint8), named[0][1].view(torch.uint8))
                assert (
                    planes.plan_update(sent, torch.device("cpu"), 64 << 10).fingerprints == info.fingerprints
                )
            for worker in workers:
                assert worker.stdin is not None
                worker.stdin.write(json.dumps(planes.to_json_dict(told)) + "\n")
                worker.stdin.flush()
            sender.send_weights(sent, info)
            answers = [json.loads(worker.stdout.readline()) for worker in workers if worker.stdout]
            refusal = {
                "fingerprint": "fingerprints: bucket 0 did not arrive",
                "forged": "digests: bucket 0 is not",
            }
            if damage:
                assert all(refusal[damage] in a["refused"] and not a["loaded"] for a in answers), answers
            else:
                want = [
                    [n, str(planes.fingerprint(t.contiguous().view(-1).view(torch.uint8)))] for n, t in named
                ]
                assert all(a["loaded"] == want for a in answers)
    finally:
        for worker in workers:
            if worker.stdin is not None:
                worker.stdin.close()
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:  # (hung in a broadcast: never left behind)
                worker.kill()
                worker.wait()
        sender.shutdown()
    assert [w.returncode for w in workers] == [0, 0]


@pytest.mark.gpu
def test_cuda_ipc_moves_a_weight_set_into_another_process_bit_for_bit() -> None:
    """The receiver in a process of its own (scripts/gpu_proof.py's, as its check i runs it), every
    tensor's fingerprint there equal to the sender's."""
    from scripts.gpu_proof import receive_in_another_process

    device = torch.device("cuda", torch.cuda.current_device())
    named = [(n, t.to(device)) for n, t in weight_set(seed=3)]
    sender = planes.IpcSender(device)
    info = sender.send_weights(named, bucket_bytes=64 << 10)
    _, got = receive_in_another_process("ipc", str(device), info)
    sender.release()
    assert got == [(n, planes.fingerprint(t.contiguous().view(-1).view(torch.uint8))) for n, t in named]
