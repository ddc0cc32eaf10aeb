"""The fuzz targets: each reads one input (bytes) and returns, or raises only what its module documents for
bad input. Anything else it raises is a crash, and so is a broken invariant (each target checks the ones
its module promises: an update applied whole or not at all, a validated request within its limits).

An input is a mode byte and then the bytes the target reads. Digests and MACs would stop nearly every
mutation at the first check, so some modes have the harness recompute them first ("reseal"), so that the
fuzzer reaches the checks behind them; the others feed the bytes as they are.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fp8rl.codec.decode import UpdateDecoder
from fp8rl.codec.layout import sealed
from fp8rl.codec.stream import decode_parts, receive_parts
from fp8rl.codec.weight_set import DTYPES, WeightSet, bytes_digest, digest_tensors, raw_bytes
from fp8rl.errors import InvalidRequest, Overloaded, Unauthenticated, WeightCodecError
from fp8rl.models import TINY_ARITH
from fp8rl.security import sign_update
from fp8rl.v1 import rollout_pb2, trainer_pb2, weights_pb2

PART_SEPARATOR = b"\x00--part--\x00"  # between the parts of a codec_decode input
# The trainer's signing key, fixed so the corpus replays (the replica holds its public half).
SIGNER = Ed25519PrivateKey.from_private_bytes(b"fuzz-update-key-of-32-bytes-long")
VERIFIER = SIGNER.public_key()
MAX_TENSOR_BYTES = 1 << 20  # what the harness's admit lets through (the rollout's is the model's schema)


@dataclass(frozen=True)
class Target:
    name: str
    one_input: Callable[[bytes], None]
    accepted: tuple[type[BaseException], ...]  # what bad input may raise (the module's documented errors)
    modules: tuple[str, ...] = ()  # imported (so instrumented for coverage) before the fuzzing starts
    dictionary: str | None = None  # a libFuzzer dictionary in tests/fuzz/dicts: words of its format


# -- the weight codec ----------------------------------------------------------------------------------


def held_tensors() -> dict[str, torch.Tensor]:
    """The receiver's set for deltas (fixed: the seeds' deltas are computed against it)."""
    g = torch.Generator().manual_seed(7)
    return {
        "layers.0.mlp.weight": torch.randn(4, 40, generator=g).to(torch.float8_e4m3fn),
        "layers.0.mlp.weight_scale_inv": torch.rand(1, 1, generator=g) + 0.5,
        "layers.0.norm.weight": torch.randn(40, generator=g).to(torch.bfloat16),
        "layers.1.mlp.weight": torch.randn(8, 16, generator=g),
        "embed.weight": torch.randint(0, 255, (33,), generator=g, dtype=torch.uint8),
        "positions": torch.arange(5),
    }


HELD_FORMAT = "fp8-block128"
HELD_VERSION = 3


def fresh_held() -> WeightSet:
    return WeightSet(HELD_FORMAT, {k: v.clone() for k, v in held_tensors().items()}, owned=True)


def capped_admit(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """The harness's admit: any name, but bounded (the decoder's callers bound every tensor: the rollout by
    its model's schema)."""
    if any(d < 0 for d in shape) or math.prod(shape) * dtype.itemsize > MAX_TENSOR_BYTES:
        raise InvalidRequest("weights", f"{name}: {list(shape)} is too large")


def schema_admit(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """The rollout's kind of admit: only the held set's names, shapes and dtypes."""
    held = held_tensors().get(name)
    if held is None or tuple(held.shape) != shape or held.dtype != dtype:
        raise InvalidRequest("weights", f"{name} is not a tensor of this model")


def _snapshot(weights: WeightSet) -> dict[str, bytes]:
    return {k: raw_bytes(v).tobytes() for k, v in weights.tensors.items()}


def check_decoded(decoded: Any) -> None:
    """A decoded set's digests are true of its bytes, and its set digest of its digests."""
    weights = decoded.weights
    assert digest_tensors(weights.tensors) == weights.tensor_digests, "a decoded digest is not its tensor's"
    assert WeightSet(weights.format, weights.tensors).digest == weights.digest


def check_all_or_nothing(held: WeightSet | None, before: dict[str, bytes] | None) -> None:
    """After a refused update the held set is as it was, bit for bit (or consumed, refusing to pass for
    its version, when a chunk could not be put back)."""
    if held is not None and before is not None and not held.consumed:
        assert _snapshot(held) == before, "a refused update changed the held set"


def reseal(blob: bytes, level: int) -> bytes:
    """``blob`` with its header spelled canonically and its metadata digest recomputed (level >= 1), and
    at level 2 the digests behind it too: a keyframe's tensor digests and set digest, a delta's packed
    chunk digests. Blobs whose header does not parse are returned as they are."""
    if level == 0 or len(blob) < 8:
        return blob
    (size,) = struct.unpack("<Q", blob[:8])
    try:
        header = json.loads(blob[8 : 8 + size])
        metadata = dict(header["__metadata__"])
        metadata.pop("metadata_digest", None)
        if level >= 2:
            _reseal_digests(blob[8 + size :], header, metadata)
        header["__metadata__"] = sealed({str(k): str(v) for k, v in metadata.items()})
        text = json.dumps(header, separators=(",", ":")).encode()
    except Exception:
        return blob
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob[8 + size :]


def _reseal_digests(data: bytes, header: dict[str, Any], metadata: dict[str, Any]) -> None:
    spans = {n: s["data_offsets"] for n, s in header.items() if n != "__metadata__"}
    if metadata.get("kind") == "full":
        tensors = {
            n: torch.frombuffer(bytearray(data[b:e]) or bytearray(1), dtype=torch.uint8)[: e - b]
            .view(DTYPES[header[n]["dtype"]])
            .reshape(header[n]["shape"])
            for n, (b, e) in spans.items()
        }
        digests = digest_tensors(tensors)
        metadata["digests"] = json.dumps(digests)
        if "set_digest" in metadata and metadata.get("parts") == "1":  # (of its tensors alone)
            metadata["set_digest"] = WeightSet(metadata.get("format", HELD_FORMAT), tensors).digest
    elif metadata.get("kind") == "delta":
        entries = json.loads(metadata["tensors"])
        for name, entry in entries.items():
            begin, _ = spans[name]
            offset = begin
            for chunk in entry["chunks"]:
                chunk[3] = bytes_digest(data[offset : offset + chunk[1]])
                offset += chunk[1]
        metadata["tensors"] = json.dumps(entries)


def codec_decode(data: bytes) -> None:
    """UpdateDecoder over the parts of an update. Mode: bits 0-1 the reseal level, bit 2 a held set
    (deltas apply to it), bit 3 the rollout's kind of admit (the held names only) or any bounded tensor,
    bit 4 read-only parts (decoded into copies, not in place)."""
    if not data:
        return
    mode, parts = data[0], data[1:].split(PART_SEPARATOR)
    held = fresh_held() if mode & 4 else None
    before = _snapshot(held) if held is not None else None
    admit = schema_admit if mode & 8 else capped_admit
    try:
        with UpdateDecoder(held, HELD_VERSION if held is not None else None, admit) as decoder:
            for part in parts:
                blob = reseal(part, mode & 3)
                decoder.add(blob if mode & 16 else bytearray(blob))
            decoded = decoder.finish()
    except (WeightCodecError, InvalidRequest):
        check_all_or_nothing(held, before)
        raise
    check_decoded(decoded)


def chunks_of(data: bytes) -> Iterator[weights_pb2.WeightChunk]:
    """Messages, each a 2-byte little-endian length and a serialized WeightChunk; stops at the first
    that does not parse (bytes no gRPC server would hand its handler)."""
    from google.protobuf.message import DecodeError

    while len(data) >= 2:
        size = int.from_bytes(data[:2], "little")
        try:
            yield weights_pb2.WeightChunk.FromString(data[2 : 2 + size])
        except DecodeError:
            return
        data = data[2 + size :]


def fix_stream(chunks: list[weights_pb2.WeightChunk], sign: bool) -> None:
    """Each part's header made to match its data (total_bytes, the digest of the part's own header) and,
    with ``sign``, signed with :data:`SIGNER`: the stream's checks then pass and the decoder's are reached."""
    starts = [i for i, c in enumerate(chunks) if c.WhichOneof("part") == "header"]
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(chunks)
        data = [c.data for c in chunks[start + 1 : end] if c.WhichOneof("part") == "data"]
        blob = b"".join(data)
        header = chunks[start].header
        header.total_bytes = len(blob)
        if len(blob) >= 8:
            header.digest = bytes_digest(blob[: 8 + int.from_bytes(blob[:8], "little")])
        if sign:
            header.signature = ""
            header.signature = sign_update(SIGNER, header, data)


def codec_stream(data: bytes) -> None:
    """receive_parts and decode_parts over a message stream. Mode: bit 0 the trainer's public key
    (updates must be signed), bit 1 the harness fixes sizes and digests (and signs, with the private
    key), bit 2 a held set, bit 3 a small max_bytes."""
    if not data:
        return
    mode = data[0]
    chunks = list(chunks_of(data[1:]))
    if mode & 2:
        fix_stream(chunks, sign=bool(mode & 1))
    held = fresh_held() if mode & 4 else None
    before = _snapshot(held) if held is not None else None
    max_bytes = 4096 if mode & 8 else 1 << 24
    try:
        decoded, _ = decode_parts(
            receive_parts(chunks, max_bytes, VERIFIER if mode & 1 else None),
            held,
            HELD_VERSION if held is not None else None,
            capped_admit,
        )
    except (WeightCodecError, InvalidRequest, Unauthenticated):
        check_all_or_nothing(held, before)
        raise
    check_decoded(decoded)


# -- the Generate and TrainStep validators -------------------------------------------------------------


@functools.cache
def tiny_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_ARITH))


def tokenize(text: str) -> list[int]:  # as rollout_service.engine.VllmEngine.tokenize
    return list(tiny_tokenizer()(text, add_special_tokens=False)["input_ids"])


def tokenize_chat(messages: list[dict[str, str]]) -> list[int]:  # as VllmEngine.tokenize_chat
    ids = tiny_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


MAX_MODEL_LEN, VOCAB = 512, 320  # the tiny model's


def generate(data: bytes) -> None:
    """parse_generate over a GenerateRequest; every engine request it makes must fit the limits."""
    from google.protobuf.message import DecodeError

    from rollout_service.validation import Limits, Tokenizer, parse_generate, required_version

    try:
        request = rollout_pb2.GenerateRequest.FromString(data)
    except DecodeError:
        return
    limits = Limits(MAX_MODEL_LEN, VOCAB, 8, 1 << 16, 16, max_samples=32, max_prompt_bytes=MAX_MODEL_LEN * 4)
    version = required_version(request)
    assert version >= -1
    requests, slots = parse_generate(request, limits, Tokenizer(tokenize, tokenize_chat))
    assert 0 < len(requests) == len(slots) <= limits.max_samples
    assert len({r.request_id for r in requests}) == len(requests)
    for r in requests:
        ids, s = r.prompt_token_ids, r.sampling
        assert ids and all(0 <= t < VOCAB for t in ids) and len(ids) < MAX_MODEL_LEN
        assert 1 <= s.max_tokens <= MAX_MODEL_LEN - len(ids)
        assert (s.temperature == 0 or 0.0099 <= s.temperature <= 2) and 0 < s.top_p <= 1 and s.top_k >= 0


@dataclass(frozen=True)
class Router:
    """What parse_routed_experts reads of a model's MoE router."""

    top_k: int
    num_experts: int


def train_samples(data: bytes) -> None:
    """parse_samples (and parse_routed_experts) over a TrainStepRequest's samples, and its sampling. Mode:
    bit 0 rewards must be >= 0 (advantage_norm mean), bit 1 a dense model (no routers), bit 2 300 experts
    (2-byte ids)."""
    from google.protobuf.message import DecodeError

    from fp8rl.sampling import sampling_settings
    from trainer_service.service import parse_samples

    if not data:
        return
    mode = data[0]
    try:
        request = trainer_pb2.TrainStepRequest.FromString(data[1:])
    except DecodeError:
        return
    routers = () if mode & 2 else (Router(2, 300 if mode & 4 else 8),) * 3
    sampling_settings(request.sampling)
    parsed = parse_samples(request.samples, VOCAB, 64, bool(mode & 1), routers)
    assert len(parsed) == len(request.samples) > 0
    for s in parsed:
        positions = len(s.prompt) + len(s.completion) - 1
        assert len(s.gen_logprobs) == len(s.completion) and positions < 64
        if s.routed_experts is not None:
            assert tuple(s.routed_experts.shape) == (positions, 3, 2)
            assert not s.routed_experts.numel() or int(s.routed_experts.max()) < routers[0].num_experts


# -- the OpenAI HTTP face -------------------------------------------------------------------------------


class EchoEngine:
    """An engine as the rollout's loop drives it (rollout_service.generation.Engine), without vLLM: each
    request finishes at its first step with the start of its prompt as its completion. The model's own
    tokenizer (and chat template), so validation sees what it sees with vLLM."""

    version, device, max_model_len, vocab_size = "echo", "cpu", MAX_MODEL_LEN, VOCAB
    longest_token_bytes = 4
    has_chat_template = True

    def __init__(self) -> None:
        self.tokenizer = tiny_tokenizer()
        self.running: list[Any] = []

    tokenize = staticmethod(tokenize)
    tokenize_chat = staticmethod(tokenize_chat)

    def add(self, request: Any) -> None:
        self.running.append(request)

    def step(self) -> list[Any]:
        from rollout_service.engine import FinishedSample

        done, self.running = self.running, []
        out = []
        for r in done:
            ids = r.prompt_token_ids[: min(3, r.sampling.max_tokens)]
            out.append(
                FinishedSample(r.request_id, ids, [-0.5] * len(ids), self.tokenizer.decode(ids), "length")
            )
        return out

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def abort(self, request_ids: list[str]) -> None:
        self.running = [r for r in self.running if r.request_id not in request_ids]


@functools.cache
def openai_client() -> Any:
    """The real app (rollout_service.openai_face.build_app) over a real RolloutService and its engine loop,
    in process (no socket)."""
    from fastapi.testclient import TestClient

    from rollout_service.config import RolloutConfig
    from rollout_service.openai_face import build_app
    from rollout_service.service import RolloutService

    service = RolloutService(
        RolloutConfig(model=TINY_ARITH, recipe="bf16", max_n=4, max_samples_per_request=16), EchoEngine()
    )  # type: ignore[arg-type]
    return TestClient(build_app(service, "tiny"), raise_server_exceptions=True)


SERVER_ERRORS = range(500, 600)


def openai(data: bytes) -> None:
    """A POST to /v1/completions or /v1/chat/completions (mode bit 0), with an X-Weight-Version header
    (bit 1: the bytes up to the first newline). Any status but a 5xx is an answer; an exception the app
    does not map (TestClient raises it) or a 5xx is a crash."""
    if not data:
        return
    mode, body = data[0], data[1:]
    headers = {"content-type": "application/json"}
    if mode & 2:
        value, _, body = body.partition(b"\n")
        headers["x-weight-version"] = "".join(chr(b) for b in value if 32 <= b < 127)
    path = "/v1/chat/completions" if mode & 1 else "/v1/completions"
    response = openai_client().post(path, content=body, headers=headers)
    assert response.status_code not in SERVER_ERRORS, (response.status_code, response.text[:500])
    if response.status_code != 200:
        error = response.json()["error"]
        assert error["message"] and error["type"], error
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in response.text.split("\n\n") if e]
        assert events and (events[-1] == "data: [DONE]" or '"error"' in events[-1]), events[-3:]
    else:
        assert response.json()["choices"] is not None


TARGETS = {
    t.name: t
    for t in (
        Target("codec_decode", codec_decode, (WeightCodecError, InvalidRequest), (), "codec.dict"),
        Target(
            "codec_stream",
            codec_stream,
            (WeightCodecError, InvalidRequest, Unauthenticated),
            (),
            "codec.dict",
        ),
        Target("generate", generate, (InvalidRequest, Overloaded), ("rollout_service.validation",)),
        Target("train_samples", train_samples, (InvalidRequest,), ("trainer_service.service",)),
        Target(
            "openai",
            openai,
            (),
            ("rollout_service.openai_face", "rollout_service.service", "rollout_service.validation"),
            "openai.dict",
        ),
    )
}
CORPUS = Path(__file__).parent / "corpus"
DICTS = Path(__file__).parent / "dicts"


def run_one(target: Target, data: bytes) -> None:
    """One input: return, or raise what is a crash (the accepted errors are swallowed)."""
    with contextlib.suppress(target.accepted):
        target.one_input(data)
