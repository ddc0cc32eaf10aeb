"""The same-host data plane (fp8rl/codec/segments.py) over real sockets and memfds: a signed update's
parts handed over as sealed shared memory decode to the set; an altered, unsealed or unknown segment is
refused; a trainer killed after the hand-over leaves nothing once the inbox lets go."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fp8rl.codec.encode import EncodedUpdate, keyframe_parts
from fp8rl.codec.schema import build_weight_set
from fp8rl.codec.segments import SegmentInbox, hand_over, sealed_segment
from fp8rl.codec.stream import decode_parts, header_of, receive_parts
from fp8rl.errors import CorruptUpdateError, Unauthenticated
from fp8rl.v1 import weights_pb2
from tests.unit.test_weight_codec import model_like_state_dict


def memfds() -> int:
    """This process's open memfds (a segment left open would show here)."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own descriptor is gone)
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sum(target.startswith("/memfd:fp8rl-update-part") for target in fds)


@pytest.fixture
def inbox() -> Iterator[SegmentInbox]:
    box = SegmentInbox(capacity=4)
    yield box
    box.close()


def signed_parts(
    gen: torch.Generator, key: Ed25519PrivateKey
) -> list[tuple[EncodedUpdate, weights_pb2.WeightHeader]]:
    weights = build_weight_set(model_like_state_dict(gen), "fp8-block128", torch.float32)
    parts = list(keyframe_parts(weights, 3, "fp8", part_bytes=200_000))
    assert len(parts) > 2
    return [(p, header_of(p, epoch=1, signer=key)) for p in parts]


def shared_stream(
    inbox: SegmentInbox, parts: list[tuple[EncodedUpdate, weights_pb2.WeightHeader]], alter: int = -1
) -> Iterator[weights_pb2.WeightChunk]:
    """The parts as headers and shared segments; ``alter``: that part's segment has one byte changed."""
    for part, header in parts:
        blob = bytearray(b"".join(bytes(s) for s in part.segments))
        if header.part == alter:
            blob[-1] ^= 1
        fd = sealed_segment([blob], len(blob))
        token = hand_over(inbox.name, fd)
        os.close(fd)  # (the inbox holds its own descriptor)
        assert token is not None
        yield weights_pb2.WeightChunk(header=header)
        yield weights_pb2.WeightChunk(shared=weights_pb2.SharedSegment(token=token))


def test_signed_parts_in_shared_memory_decode_to_the_set(inbox: SegmentInbox, gen: torch.Generator) -> None:
    key = Ed25519PrivateKey.generate()
    parts = signed_parts(gen, key)
    over_grpc, _ = decode_parts(receive_parts(p for part, h in parts for p in _data_chunks(part, h)))
    shared = receive_parts(shared_stream(inbox, parts), verifier=key.public_key(), inbox=inbox)
    decoded, received = decode_parts(shared)
    assert received == sum(p.wire_bytes for p, _ in parts)
    assert decoded.weights.tensors.keys() == over_grpc.weights.tensors.keys()
    for name, tensor in decoded.weights.tensors.items():
        assert torch.equal(tensor.view(torch.uint8), over_grpc.weights.tensors[name].view(torch.uint8)), name
    assert inbox.held() == 0 and memfds() == 0  # every segment taken, read, and let go


def _data_chunks(part: EncodedUpdate, header: weights_pb2.WeightHeader) -> Iterator[weights_pb2.WeightChunk]:
    yield weights_pb2.WeightChunk(header=header)
    yield from (weights_pb2.WeightChunk(data=piece) for piece in part.pieces(1 << 20))


def test_an_altered_unsealed_or_unknown_segment_is_refused(inbox: SegmentInbox, gen: torch.Generator) -> None:
    key = Ed25519PrivateKey.generate()
    parts = signed_parts(gen, key)
    # One byte changed in the second part's segment: its signature no longer verifies.
    with pytest.raises(Unauthenticated):
        list(receive_parts(shared_stream(inbox, parts, alter=1), verifier=key.public_key(), inbox=inbox))
    # A memfd the sender could still write to after the replica checked it.
    part, header = parts[0]
    fd = os.memfd_create("fp8rl-update-part", os.MFD_CLOEXEC)
    os.write(fd, b"".join(bytes(s) for s in part.segments))
    token = hand_over(inbox.name, fd)
    os.close(fd)
    assert token is not None
    unsealed = [
        weights_pb2.WeightChunk(header=header),
        weights_pb2.WeightChunk(shared=weights_pb2.SharedSegment(token=token)),
    ]
    with pytest.raises(CorruptUpdateError, match=r"shared\.token: the segment is not sealed"):
        next(receive_parts(iter(unsealed), verifier=key.public_key(), inbox=inbox))
    # A token nobody handed over, and a replica without an inbox.
    unknown = [
        weights_pb2.WeightChunk(header=header),
        weights_pb2.WeightChunk(shared=weights_pb2.SharedSegment(token=b"x" * 16)),
    ]
    with pytest.raises(CorruptUpdateError, match=r"shared\.token: no segment"):
        next(receive_parts(iter(unknown), inbox=inbox))
    with pytest.raises(CorruptUpdateError, match="shared: this replica takes no shared-memory segments"):
        next(receive_parts(iter(unknown)))
    # Left: the part after the refused one, handed over as the replica read one part ahead, until its
    # time to live.
    assert memfds() == inbox.held() == 1


def test_a_full_inbox_refuses_and_one_in_another_namespace_is_not_reached(inbox: SegmentInbox) -> None:
    fd = sealed_segment([b"12345678"], 8)
    try:
        assert all(hand_over(inbox.name, fd) is not None for _ in range(inbox.capacity))
        assert hand_over(inbox.name, fd) is None  # full: the sender goes over gRPC
        assert hand_over("fp8rl-segments-nobody", fd) is None  # (no such inbox here)
    finally:
        os.close(fd)
    assert inbox.held() == inbox.capacity


NOBODY = 65534


def as_nobody(code: str) -> subprocess.Popen:
    """``code`` in a child that becomes user nobody once its imports are done (its output piped)."""
    preamble = "import os, socket, time\nfrom fp8rl.codec.segments import hand_over, sealed_segment\n"
    preamble += f"os.setgid({NOBODY}); os.setuid({NOBODY})\n"
    return subprocess.Popen([sys.executable, "-c", preamble + code], stdout=subprocess.PIPE, text=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a process as another user")
def test_another_user_can_neither_hand_over_nor_pose_as_an_inbox(inbox: SegmentInbox) -> None:
    """The inbox drops another user's connection before reading from it; and a trainer does not hand
    its segment to a socket another user bound under a replica's name (abstract names are public)."""
    offer = f"print(hand_over({inbox.name!r}, sealed_segment([b'12345678'], 8)))\n"
    intruder = as_nobody(offer)
    out, _ = intruder.communicate(timeout=60)
    assert out.strip() == "None" and inbox.held() == 0
    squat = (  # (it would take the segment, and say so)
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        "s.bind('\\0fp8rl-segments-squatted'); s.listen(1); print('bound', flush=True)\n"
        "c, _ = s.accept(); c.settimeout(10)\n"
        "c.recvmsg(64, 64); c.send(b'+'); time.sleep(1)\n"
    )
    squatter = as_nobody(squat)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "bound"
        fd = sealed_segment([b"12345678"], 8)
        try:
            assert hand_over("fp8rl-segments-squatted", fd) is None
        finally:
            os.close(fd)
    finally:
        squatter.kill()
        squatter.wait()


def test_a_trainer_killed_after_the_hand_over_leaves_no_segment() -> None:
    """A sender killed with -9 once its segment is in the inbox: the inbox lets the segment go after its
    time to live, and then no descriptor of it is open anywhere (a memfd's memory goes with the last)."""
    inbox = SegmentInbox(ttl_s=1.0)
    try:
        code = (
            "import os, sys, time\n"
            "from fp8rl.codec.segments import hand_over, sealed_segment\n"
            "fd = sealed_segment([os.urandom(1 << 20)], 1 << 20)\n"
            f"assert hand_over({inbox.name!r}, fd) is not None\n"
            "print('handed', flush=True)\n"
            "time.sleep(600)\n"
        )
        sender = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert sender.stdout is not None and sender.stdout.readline().strip() == "handed"
        finally:
            os.kill(sender.pid, signal.SIGKILL)
            sender.wait()
        assert inbox.held() == 1 and memfds() == 1  # the inbox's own descriptor keeps it alive
        time.sleep(1.2)
        fd = sealed_segment([b"12345678"], 8)
        assert hand_over(inbox.name, fd) is not None  # (each hand-over first lets the stale ones go)
        os.close(fd)
        assert inbox.held() == 1 and memfds() == 1  # the new one only
    finally:
        inbox.close()
    assert memfds() == 0
