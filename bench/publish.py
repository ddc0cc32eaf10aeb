"""Weight sync end to end: the trainer's real Publisher sends a Qwen2-0.5B-shaped set from this process
to a replica process over loopback gRPC (or shared memory), and the replica verifies, decodes and
stores it (a stand-in engine, ``StoringReplica``, in place of vLLM). Printed, measured in this one run:

* seconds from the publish call to "applied" (the replica's reply), per update;
* seconds to stream the same bytes over the same RPC with no codec at either end (``raw``: pieces cut
  from a buffer, kept in one by the receiver, as any receiver of weights must);
* their ratio (raw / ours: 1.0 means the codec costs nothing beyond the bytes it sends), with and without
  the time the trainer spends building the rollout's set from its master weights (quantizing to FP8,
  measured on its own as ``build s``): ``raw set/send`` compares raw with the delivery's own time
  (``send s``: encode, stream, the replica's decode and reply).

For a delta, raw is given for the delta's own wire bytes and for the whole set's bytes (what sending the
new weights without a codec would cost). Each update is sent three ways: ``whole`` (one part: encoded
whole, then sent, then decoded), ``parts`` (streamed: each part sent and applied while the next one is
encoded), ``signed`` (streamed, with the trainer's Ed25519 signature on every part) and ``shared``
(signed, each part's bytes handed to the replica as sealed shared memory: the same-host data plane,
fp8rl/codec/segments.py), each twice; the ratios printed last compare each mode's best ``send s``, and
a keyframe's delivery over each plane with a plain copy of its bytes (``memcpy``) in this run.

With ``--split-cores`` the trainer runs on half the cores and the replica on the other half, as if on
two machines: only then can one side encode while the other decodes (on shared cores, streaming only
overlaps the codec with gRPC's own work).

    python bench/publish.py [--layers 24] [--format fp8-block128] [--split-cores]

``--serving`` measures time to serving instead: the same publisher into a real replica (the rollout
service, vLLM on CPU, a random Qwen2-0.5B-shaped model of ``--layers`` layers stored in bf16), a keyframe
and a delta over each plane, from the publish call to the replica's reply, which it sends once its
engine has been refit (``apply_s``, the refit alone, comes with it): the time until it serves the new
version, from a set already quantized (the trainer's ``build s`` is apart, as above). The replica also
offers its device plane (``weight_transfer: fp8rl-broadcast``, Gloo here), whose rows send every update
as a keyframe; its ``refit s`` includes receiving the broadcast.

    python bench/publish.py --serving [--layers 24]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import grpc
import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/codec.py: the model's shapes

from fp8rl.codec.encode import PART_BYTES
from fp8rl.codec.schema import build_weight_set
from fp8rl.codec.segments import SegmentInbox
from fp8rl.codec.stream import MESSAGE_BYTES, Reassembler, decode_parts, receive_parts
from fp8rl.codec.tcp_plane import TcpInbox, server_context
from fp8rl.codec.weight_set import WeightSet
from fp8rl.recipes import WEIGHT_FORMATS
from fp8rl.run_secrets import security_for
from fp8rl.security import SecurityConfig
from fp8rl.serving import read_ahead, start_server
from fp8rl.transport import channel
from fp8rl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, weights_pb2
from trainer_service.publisher import Publisher, Target


class StoringReplica(rollout_pb2_grpc.RolloutServicer):
    """A replica whose engine only stores the tensors: verification and decoding as the real one does
    them (rollout_service/service.py), then a reference swap. ``raw`` streams are received and dropped."""

    def __init__(self, host: str, security: SecurityConfig, in_clear: bool = False) -> None:
        self.held: WeightSet | None = None
        self.version = -1
        self.inbox = SegmentInbox()  # the data planes, as a replica keeps them
        self.tcp = TcpInbox(host, 0, None if in_clear else server_context(security))

    def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.RolloutStatus:
        return rollout_pb2.RolloutStatus(
            weight_version=self.version,
            segment_inbox=self.inbox.name,
            tcp_updates_port=self.tcp.port,
            tcp_updates_tls=self.tcp.tls is not None,
        )

    def UpdateWeights(
        self, request_iterator: Iterable[weights_pb2.WeightChunk], context: grpc.ServicerContext
    ) -> weights_pb2.UpdateWeightsResponse:
        stream = iter(request_iterator)
        first = next(stream)
        if first.header.encoding == "raw":  # kept, as any receiver must, but not decoded
            assembler = Reassembler(first.header.total_bytes, "", max_bytes=1 << 36)
            for chunk in stream:
                assembler.add(chunk.data)
            return weights_pb2.UpdateWeightsResponse(encoding="raw", bytes_received=first.header.total_bytes)
        # Signed updates are verified, as a replica with the trainer's public key does.
        verifier = BENCH_KEY.public_key() if first.header.signature else None
        parts = receive_parts(
            _prepend(first, stream), max_bytes=1 << 36, verifier=verifier, inbox=self.inbox, tcp=self.tcp
        )
        with contextlib.closing(read_ahead(parts)) as ahead:
            decoded, received = decode_parts(
                ahead, self.held, self.version if self.held is not None else None
            )
        self.held, self.version = decoded.weights, decoded.version  # the stand-in engine's "load"
        return weights_pb2.UpdateWeightsResponse(
            version=decoded.version, encoding=decoded.encoding, bytes_received=received
        )


PLANES = {"shared": "shared-memory", "tcp": "tcp"}  # the plane each mode's updates must take
NETNS_TRAINER, NETNS_REPLICA = "10.78.0.1", "10.78.0.2"


def veth_namespace(name: str) -> list[str]:
    """A network namespace ``name`` joined to this one by a veth pair (this end NETNS_TRAINER, that end
    NETNS_REPLICA); the command prefix that runs a process in it. Removed by ``ip netns del``."""
    for command in (
        f"ip netns add {name}",
        f"ip link add fp8b{os.getpid()} type veth peer name eth0 netns {name}",
        f"ip addr add {NETNS_TRAINER}/30 dev fp8b{os.getpid()}",
        f"ip link set fp8b{os.getpid()} up",
        f"ip -n {name} addr add {NETNS_REPLICA}/30 dev eth0",
        f"ip -n {name} link set eth0 up",
        f"ip -n {name} link set lo up",
    ):
        subprocess.run(command.split(), check=True)
    return ["ip", "netns", "exec", name]


# The signed rows' update-signing key (both processes derive it; a real replica holds the public key only).
BENCH_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))


def _prepend(first: weights_pb2.WeightChunk, rest: Iterator[weights_pb2.WeightChunk]) -> Iterator:
    yield first
    yield from rest


def serve_replica(host: str, security: SecurityConfig, in_clear: bool) -> None:
    replica = StoringReplica(host, security, in_clear)
    running = start_server(
        lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(replica, s),
        ["fp8rl.v1.Rollout"],
        host=host,
        port=0,
        security=security,
    )
    raw = socket.create_server((host, 0))
    threading.Thread(target=raw_receiver, args=(raw,), daemon=True).start()
    print(f"replica bound to {host}:{running.port} raw {raw.getsockname()[1]}", flush=True)
    sys.stdin.read()  # until the bench closes our stdin
    running.stop(0)


def raw_receiver(listener: socket.socket) -> None:
    """The raw TCP baseline's receiving end: each connection announces its byte count (8 bytes), then
    sends that many, read into one buffer (as any receiver of weights must keep them), then gets one
    byte back."""
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_receive_raw, args=(conn,), daemon=True).start()


def _receive_raw(conn: socket.socket) -> None:
    with conn:
        size = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
        view, done = memoryview(bytearray(size)), 0
        while done < size:
            n = conn.recv_into(view[done:], min(size - done, 4 << 20))
            if n <= 0:
                return
            done += n
        conn.sendall(b"+")


def raw_tcp_seconds(host: str, port: int, nbytes: int, streams: int) -> float:
    """The best of two sends of ``nbytes`` over ``streams`` plain TCP connections at once (each a
    contiguous share, from one buffer, into a fresh buffer at the replica): what the link gives Python."""
    payload = memoryview(np.full(nbytes, 7, dtype=np.uint8).data).cast("B")
    share = -(-nbytes // streams)

    def send(start: int) -> None:
        with socket.create_connection((host, port)) as conn:
            piece = payload[start : start + share]
            conn.sendall(len(piece).to_bytes(8, "little"))
            conn.sendall(piece)
            assert conn.recv(1) == b"+"

    best = math.inf
    for _ in range(2):
        start = time.perf_counter()
        threads = [threading.Thread(target=send, args=(i * share,)) for i in range(streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        best = min(best, time.perf_counter() - start)
    return best


def raw_seconds(address: str, nbytes: int, security: SecurityConfig) -> float:
    """Stream ``nbytes`` in the codec's chunk size over the same RPC, no codec at either end: the sender
    cuts pieces of a buffer, the receiver keeps them in one."""
    payload = np.full(nbytes, 7, dtype=np.uint8).data

    def chunks() -> Iterator[weights_pb2.WeightChunk]:
        yield weights_pb2.WeightChunk(header=weights_pb2.WeightHeader(encoding="raw", total_bytes=nbytes))
        for start in range(0, nbytes, MESSAGE_BYTES):
            yield weights_pb2.WeightChunk(data=bytes(payload[start : start + MESSAGE_BYTES]))

    with channel(address, security, "rollout", bulk=True) as link:
        stub = rollout_pb2_grpc.RolloutStub(link)
        stub.UpdateWeights(chunks(), timeout=600)  # connect and warm up
        start = time.perf_counter()
        reply = stub.UpdateWeights(chunks(), timeout=600)
        seconds = time.perf_counter() - start
    assert reply.bytes_received == nbytes
    return seconds


def memcpy_seconds(nbytes: int) -> float:
    """The best of three copies of ``nbytes`` between two warm buffers."""
    source, target = np.full(nbytes, 7, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    np.copyto(target, source)
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return best


def timed_build(weights: dict[str, torch.Tensor], weight_format: str) -> float:
    start = time.perf_counter()
    build_weight_set(weights, weight_format, torch.bfloat16)  # type: ignore[arg-type]
    return time.perf_counter() - start


def big_keyframes(
    args: argparse.Namespace, address: str, raw_port: int, security: SecurityConfig, key_file: Path, link: str
) -> None:
    """Signed keyframes of Llama-3.1-8B shapes (``args.llama_8b_layers`` of its layers: the whole set would
    not fit this VM twice over), over the TCP plane and over gRPC, twice each, against raw TCP on the same
    link; and what the rates mean for the whole 32-layer set."""
    from codec import llama_8b_shapes

    shapes = llama_8b_shapes(args.llama_8b_layers)
    signed = security.model_copy(update={"update_signing_key_file": key_file})
    publisher = Publisher(args.format, torch.bfloat16, args.format, signed, PART_BYTES, shared_memory=False)
    built = publisher.build({n: torch.randn(s, dtype=torch.bfloat16) * 0.02 for n, s in shapes.items()})
    assert built is not None
    nbytes = built.nbytes
    per_layer = sum(t.nbytes for n, t in built.tensors.items() if n.startswith("model.layers.0."))
    whole = nbytes + (32 - args.llama_8b_layers) * per_layer  # (the set's bytes with every layer)
    layers = f"{args.llama_8b_layers} of 32 layers"
    print(f"model: Llama-3.1-8B shapes, {layers}, {args.format}, {nbytes / 1e9:.2f} GB")
    print(f"replica at {address} ({link})")
    best: dict[str, float] = {}
    for version, mode in enumerate(("tcp", "grpc", "tcp", "grpc")):
        publisher.tcp_streams = 4 if mode == "tcp" else 0
        [delivery] = publisher.publish(version, dict, [Target(address, -1)], built=built)
        assert delivery.ok and delivery.encoding == "keyframe" and delivery.plane == mode, delivery
        best[mode] = min(best.get(mode, math.inf), delivery.seconds)
        print(f"keyframe {mode:5} {delivery.seconds:7.2f} s  {nbytes / delivery.seconds / 1e9:.2f} GB/s")
    publisher.close()
    sample = min(nbytes, 2 << 30)  # (the replica holds two sets already)
    raw = raw_tcp_seconds(address.rsplit(":", 1)[0], raw_port, sample, 4)
    print(f"raw TCP, 4 connections: {sample / raw / 1e9:.2f} GB/s")
    tcp_rate, raw_rate = nbytes / best["tcp"], sample / raw
    print(
        f"keyframe tcp: {tcp_rate / raw_rate:.2f} of raw TCP; "
        f"gRPC / TCP time {best['grpc'] / best['tcp']:.2f}x"
    )
    scale = whole / nbytes
    print(
        f"the whole 8B set (~{whole / 1e9:.1f} GB) at these rates: TCP plane "
        f"{best['tcp'] * scale:.0f} s, gRPC {best['grpc'] * scale:.0f} s "
        "(scaled by bytes, not measured)"
    )


def qwen2_checkpoint(layers: int, out: Path) -> Path:
    """A random Qwen2-0.5B-shaped checkpoint (``layers`` of its 24 layers, tied, bf16 on disk as real ones
    are) with the tiny model's tokenizer (the ids it uses are the first of the 151,936)."""
    from codec import HIDDEN, MLP, VOCAB
    from transformers import AutoConfig, AutoModelForCausalLM

    from fp8rl.models import TINY_ARITH

    config = AutoConfig.for_model(
        "qwen2",
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_attention_heads=14,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    for tokenizer_file in TINY_ARITH.glob("tokenizer*"):
        (out / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
    return out


def serving_table(args: argparse.Namespace, work: Path) -> None:
    """Time to serving over each plane (see the module's docstring): a real replica, refit each time."""
    from safetensors.torch import load_file

    model = qwen2_checkpoint(args.layers, work / "qwen2")
    command = [sys.executable, "-m", "rollout_service.cli", "serve", "--model", str(model), "--port", "0"]
    command += ["--recipe", "fp8", "--device", "cpu", "--max-model-len", "256"]
    command += ["--weight-transfer", "fp8rl-broadcast"]  # (its device plane: Gloo on a CPU)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = (work / "rollout.log").open("w+")
    replica = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        address = ""
        while not address:
            time.sleep(1)
            if replica.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the replica exited {replica.returncode}:\n{log.read()[-3000:]}")
            log.seek(0)
            address = next((ln.split("serving on ")[1].split()[0] for ln in log if "serving on " in ln), "")
        master = {n: t.float() for n, t in load_file(model / "model.safetensors").items()}
        print(f"model: Qwen2-0.5B shapes, {args.layers} layers, fp8-block128, a real replica at {address}")
        print(f"{'update':9} {'plane':14} {'wire MB':>8} {'serving s':>9} {'refit s':>8} {'delivery s':>10}")
        version = 0
        best: dict[tuple[str, str], tuple[float, float]] = {}
        modes = ("grpc", "shared-memory", "tcp", "device")
        for mode in modes + modes:
            publisher = Publisher(
                "fp8-block128",
                torch.bfloat16,
                "fp8",
                SecurityConfig(),
                shared_memory=mode == "shared-memory",
                tcp_streams=4 if mode == "tcp" else 0,
                weight_transfer=mode == "device",
            )
            held = -1
            for kind in ("keyframe", "delta"):
                version += 1
                master = {n: w + 1e-4 * w.abs() * torch.randn(w.shape) for n, w in master.items()}
                built = publisher.build(master)  # (the trainer's quantization: not part of the sync)
                start = time.perf_counter()
                [d] = publisher.publish(version, dict, [Target(address, held)], built=built)
                serving = time.perf_counter() - start
                # (the device plane sends every update whole)
                assert (
                    d.ok and d.plane == mode and d.encoding == ("keyframe" if mode == "device" else kind)
                ), d
                held = version
                best[kind, mode] = min(best.get((kind, mode), (math.inf, math.inf)), (serving, d.apply_s))
                print(
                    f"{d.encoding:9} {mode:14} {d.wire_bytes / 1e6:8.1f} {serving:9.2f} {d.apply_s:8.2f} "
                    f"{serving - d.apply_s:10.2f}"
                )
            publisher.close()
        for kind in ("keyframe", "delta"):
            grpc_s = best[kind, "grpc"][0]
            print(
                f"{kind} time to serving, best of two: "
                + ", ".join(
                    f"{m} {best[kind, m][0]:.2f} s ({best[kind, m][0] / grpc_s:.2f}x gRPC)" for m in modes
                )
                + f"; the refit alone {min(best[kind, m][1] for m in modes[:3]):.2f} s"
            )
    finally:
        replica.terminate()
        replica.wait(timeout=120)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--format", choices=WEIGHT_FORMATS, default="fp8-block128")
    parser.add_argument(
        "--split-cores",
        action="store_true",
        help="trainer on the first half of the cores, replica on the rest, as on two machines",
    )
    parser.add_argument(
        "--netns",
        action="store_true",
        help="the replica in a network namespace of its own, across a veth pair (root; as on another host)",
    )
    parser.add_argument(
        "--tls", action="store_true", help="with --netns: mutual TLS (else tokens, plaintext)"
    )
    parser.add_argument(
        "--in-clear",
        action="store_true",
        help="with --tls: the TCP plane's bytes in clear (tcp_updates_in_clear)",
    )
    parser.add_argument(
        "--llama-8b-layers",
        type=int,
        default=0,
        help="instead: keyframes of Llama-3.1-8B shapes with this many of its 32 layers, TCP plane and gRPC",
    )
    parser.add_argument(
        "--serving",
        action="store_true",
        help="instead: time to serving, into a real replica (vLLM on CPU) refit by each update",
    )
    parser.add_argument("--replica", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--secrets", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.split_cores:
        cores = list(range(os.cpu_count() or 2))  # (the replica inherits the trainer's half: not those)
        half = max(1, len(cores) // 2)
        os.sched_setaffinity(0, cores[half:] if args.replica else cores[:half])
    if args.replica:
        security = SecurityConfig()
        if args.secrets is not None:
            security = security_for(args.secrets, "replica", args.tls).model_copy(
                update={"allow_plaintext": not args.tls}
            )
        serve_replica(args.host, security, args.in_clear)
        return
    work = Path(tempfile.mkdtemp())
    if args.serving:
        try:
            serving_table(args, work)
        finally:
            subprocess.run(["rm", "-rf", str(work)], check=False)
        return
    trainer_security, prefix, host = SecurityConfig(), [], "127.0.0.1"
    replica_args = ["--split-cores"] if args.split_cores else []
    if args.netns:
        secrets_dir = work / "secrets"
        trainer_security = security_for(secrets_dir, "trainer", args.tls).model_copy(
            update={"allow_plaintext": not args.tls}
        )
        prefix, host = veth_namespace(f"fp8rl-bench-{os.getpid()}"), NETNS_REPLICA
        replica_args += ["--host", host, "--secrets", str(secrets_dir), *(["--tls"] if args.tls else [])]
        replica_args += ["--in-clear"] if args.in_clear else []
    replica = subprocess.Popen(
        [*prefix, sys.executable, __file__, "--replica", *replica_args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = replica.stdout.readline() if replica.stdout else ""
        address, raw_port = line.split()[-3], int(line.split()[-1])
        link = (
            ("across a veth pair, " + ("mutual TLS" if args.tls else "tokens, plaintext"))
            + (", TCP plane in clear" if args.in_clear else "")
            if args.netns
            else "loopback"
        )
        key_file = work / "update-signing.key"
        key_file.write_bytes(BENCH_KEY.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
        if args.llama_8b_layers:
            big_keyframes(args, address, raw_port, trainer_security, key_file, link)
            return
        from codec import qwen2_05b_shapes

        torch.manual_seed(0)
        master = {
            n: torch.randn(s) * (0.02 if len(s) == 2 else 1.0)
            for n, s in qwen2_05b_shapes(args.layers).items()
        }
        shapes = f"Qwen2-0.5B shapes, {args.layers} layers, format {args.format}"
        print(f"model: {shapes}, replica at {address} ({link})")
        print(
            f"{'update':17} {'wire MB':>9} {'set MB':>8} {'build s':>8} {'send s':>7} {'ours s':>8} "
            f"{'raw wire s':>10} "
            f"{'raw set s':>9} {'raw/ours wire':>13} {'raw set/ours':>12} {'raw set/send':>12}"
        )
        steps: list[tuple[float | None, dict[str, torch.Tensor]]] = [(None, master)]
        for step_size in (1e-4, 1e-5, 1e-6):
            master = {n: w + step_size * w.abs() * torch.randn(w.shape) for n, w in master.items()}
            steps.append((step_size, master))
        send_s: dict[tuple[str, str], float] = {}  # (update, mode)
        warm_up = Publisher(
            args.format, torch.bfloat16, args.format, trainer_security
        )  # first-touch of both processes' memory
        warm_up.publish(0, lambda: master, [Target(address, -1)])
        warm_up.close()
        # The same updates sent as one part (encoded whole, then sent, then decoded whole), streamed in
        # parts (each part encoded, sent and applied while the next is encoded), and streamed and signed
        # (BLAKE3 over every byte, signed with Ed25519 by the trainer as each part is encoded, checked by
        # the replica as the chunks arrive): the differences are streaming's gain and the signature's
        # cost. Each mode runs twice, in mirrored order, and the ratios take each one's best (this VM
        # drifts).
        # ``shared``: signed and streamed as ``signed``, the parts' bytes handed over as shared memory
        # (fp8rl/codec/segments.py) instead of gRPC's data chunks.
        # ``tcp``: the same, the parts' bytes over the replica's TCP plane (fp8rl/codec/tcp_plane.py) on
        # four connections.
        planes = ("tcp",) if args.netns else ("shared", "tcp")
        order = ("whole", "parts", "signed", *planes)
        for mode in order + order[::-1]:
            signed = mode in ("signed", "shared", "tcp")
            security = trainer_security.model_copy(
                update={"update_signing_key_file": key_file if signed else None}
            )
            part_bytes = sys.maxsize if mode == "whole" else PART_BYTES
            publisher = Publisher(
                args.format,
                torch.bfloat16,
                args.format,
                security,
                part_bytes,
                shared_memory=mode == "shared",
                tcp_streams=4 if mode == "tcp" else 0,
            )
            held = -1
            for version, (relative, step_master) in enumerate(steps):
                weights = {n: w.clone() for n, w in step_master.items()}
                build = min(timed_build(weights, args.format) for _ in range(2))
                start = time.perf_counter()
                [delivery] = publisher.publish(version, lambda: weights, [Target(address, held)])  # noqa: B023
                ours = time.perf_counter() - start
                assert delivery.ok, delivery.error
                assert delivery.plane == PLANES.get(mode, "grpc"), delivery.plane
                held = version
                set_bytes = publisher.last[1].nbytes if publisher.last else 0
                wire = raw_seconds(address, delivery.wire_bytes, trainer_security)
                whole = raw_seconds(address, set_bytes, trainer_security)
                label = ("keyframe" if relative is None else f"delta {relative:.0e}") + f" {mode}"
                kind = label.rsplit(" ", 1)[0]
                send_s[kind, mode] = min(send_s.get((kind, mode), math.inf), delivery.seconds)
                sizes = f"{label:17} {delivery.wire_bytes / 1e6:9.2f} {set_bytes / 1e6:8.1f}"
                times = f"{build:8.3f} {delivery.seconds:7.3f} {ours:8.3f} {wire:10.3f} {whole:9.3f}"
                ratios = f"{wire / ours:13.3f} {whole / ours:12.3f} {whole / delivery.seconds:12.3f}"
                print(f"{sizes} {times} {ratios}")
            publisher.close()
        for name, mode, against in (
            ("streamed / whole", "parts", "whole"),
            ("signed / unsigned", "signed", "parts"),
            ("shared memory / gRPC", "shared", "signed"),
            ("TCP plane / gRPC", "tcp", "signed"),
        ):
            if mode not in order:
                continue
            compared = [
                f"{kind} {send_s[kind, mode] / send_s[kind, against]:.2f}x" for kind, m in send_s if m == mode
            ]
            print(f"send s, {name}: " + ", ".join(compared))
        # The same-host goal: a keyframe delivered (encoded, handed over, verified, decoded: the
        # replica's set) at >= 0.5 of a plain copy of its bytes, measured now.
        keyframe_bytes = publisher.last[1].nbytes if publisher.last else 0
        copy = memcpy_seconds(keyframe_bytes)
        for mode in (*planes, "signed"):
            best = send_s["keyframe", mode]
            print(
                f"keyframe {mode}: {keyframe_bytes / best / 1e9:.2f} GB/s delivered, memcpy "
                f"{keyframe_bytes / copy / 1e9:.2f} GB/s: {copy / best:.2f} of memcpy"
            )
        # The across-hosts goal: a keyframe over the TCP plane at >= 0.7 of plain TCP on the same link (the
        # same bytes from one buffer into a fresh one at the replica, on 1 and on 4 connections).
        raw = {
            streams: raw_tcp_seconds(address.rsplit(":", 1)[0], raw_port, keyframe_bytes, streams)
            for streams in (1, 4)
        }
        for streams, seconds in raw.items():
            print(f"raw TCP, {streams} connection(s): {keyframe_bytes / seconds / 1e9:.2f} GB/s")
        best = send_s["keyframe", "tcp"]
        print(f"keyframe tcp: {min(raw.values()) / best:.2f} of raw TCP's best (plaintext, no codec)")
    finally:
        if replica.stdin:
            replica.stdin.close()
        replica.wait(timeout=60)
        if args.netns:
            subprocess.run(["ip", "netns", "del", f"fp8rl-bench-{os.getpid()}"], check=False)


if __name__ == "__main__":
    main()
