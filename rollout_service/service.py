"""Rollout handlers: generation under a required weight version, all-or-nothing weight updates, status.

Plain Python over the engine loop; the gRPC servicer only converts messages and maps errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fp8rl import routing
from fp8rl.architectures import moe_layers, num_experts, read_config
from fp8rl.codec import device_planes
from fp8rl.codec.decode import DecodedUpdate
from fp8rl.codec.device_planes import BROADCAST_BACKEND, DEVICE_KEYFRAME, BroadcastInit
from fp8rl.codec.schema import (
    SCALE_SUFFIX,
    attention_scale_names,
    is_attention_scale,
    is_fp8_linear,
    scale_name,
)
from fp8rl.codec.segments import SegmentInbox
from fp8rl.codec.stream import decode_parts
from fp8rl.codec.tcp_plane import TcpInbox, server_context
from fp8rl.codec.weight_set import WeightSet
from fp8rl.errors import CorruptUpdateError, InvalidRequest, Overloaded, PreconditionFailed
from fp8rl.prometheus import Sample
from fp8rl.recipes import WeightFormat, get_recipe, is_fp8, weight_scale_format
from fp8rl.security import PartHash, registration_proof, signer_id, verify_update
from fp8rl.v1 import common_pb2, rollout_pb2, weights_pb2
from rollout_service.config import RolloutConfig
from rollout_service.engine import Alternatives, DeviceUpdateRefused, FinishedSample, VllmEngine
from rollout_service.generation import GenerationLoop, Ticket
from rollout_service.high_water import HighWater
from rollout_service.validation import Limits, Slot, Tokenizer, parse_generate, required_version

log = logging.getLogger(__name__)
UPDATE_WAIT_S = 120.0  # how long an update waits for the one being applied before it is refused
MAX_TRANSFER_WAIT_S = 600.0  # the longest a device plane's collective may wait for the other side


Schema = dict[str, tuple[tuple[int, ...], bool]]  # name -> (shape, is FP8)


def expected_schema(
    model_dir: Path,
    weight_format: WeightFormat,
    kv_cache_scales: bool = False,
    high_precision: Collection[str] = frozenset(),
) -> Schema:
    """Names and shapes a WeightSet for this checkpoint must have (read from the safetensors headers);
    ``kv_cache_scales``: and each attention layer's scales of FP8 attention over an FP8 KV cache (query,
    key, value; float32 scalars); ``high_precision``: the block linears (module names) that stay out of
    FP8."""
    from safetensors import safe_open

    schema: Schema = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shape = tuple(f.get_slice(name).get_shape())
                fp8 = is_fp8(weight_format) and is_fp8_linear(name, len(shape), high_precision)
                schema[name] = (shape, fp8)
                if fp8:
                    schema[scale_name(name)] = (tuple(-(-d // 128) for d in shape), False)
                if kv_cache_scales and name.endswith(".self_attn.k_proj.weight"):
                    attention = name.removesuffix(".k_proj.weight")
                    schema |= dict.fromkeys(attention_scale_names(attention), ((), False))
    if kv_cache_scales and not any(name.endswith(".self_attn.k_scale") for name in schema):
        raise ValueError(f"{model_dir}: no attention layer with a k_proj to give FP8 KV-cache scales")
    return schema


def check_schema(weights: WeightSet, schema: Schema, checked: WeightSet | None = None) -> None:
    """Refuse, before the engine sees it, a set the model cannot take: an engine that fails midway
    through a refit may not recover without a restart. Every value must be finite (a NaN weight makes
    every logprob NaN; E4M3 codes have a NaN pattern too), and FP8 scales positive, and powers of two
    under a ``-pow2`` format (the engines' contract). Values of tensors a delta took over unchanged from
    ``checked`` (the held set, which passed) are not read again."""
    admit_names(schema, weights.tensors, "weights")
    pow2 = weight_scale_format(weights.format) == "pow2"
    unchanged = checked.tensors if checked is not None else {}
    for name, t in weights.tensors.items():
        admit_tensor(schema, name, t.dtype, tuple(t.shape))
        if unchanged.get(name) is t:
            continue
        if not finite(t):
            raise InvalidRequest("weights", f"{name} holds NaN or inf")
        if name.endswith(SCALE_SUFFIX) or is_attention_scale(name):
            if not bool((t > 0).all()):  # (finite already)
                raise InvalidRequest("weights", f"{name} holds a scale that is not positive and finite")
            if pow2 and not bool((torch.frexp(t).mantissa == 0.5).all()):
                raise InvalidRequest("weights", f"{name} holds a scale that is not a power of two")


def finite(t: torch.Tensor) -> bool:
    """No NaN or inf in ``t``: for E4M3 codes, no NaN pattern (exponent and mantissa bits all set)."""
    if t.dtype == torch.float8_e4m3fn:
        return not bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    return bool(torch.isfinite(t).all())


def admit_names(schema: Schema, names: Collection[str], field: str) -> None:
    """An update names exactly the model's tensors (InvalidRequest naming ``field`` where it does not)."""
    if set(names) != set(schema):
        missing, extra = sorted(set(schema) - set(names)), sorted(set(names) - set(schema))
        raise InvalidRequest(
            field, f"tensor names differ from the model's: missing {missing[:3]}, extra {extra[:3]}"
        )


def admit_tensor(schema: Schema, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """One tensor of an update, checked against the model before anything is allocated for it."""
    if name not in schema:
        raise InvalidRequest("weights", f"{name} is not a tensor of this model")
    wanted_shape, fp8 = schema[name]
    if shape != wanted_shape:
        raise InvalidRequest("weights", f"{name} has shape {shape}, the model needs {wanted_shape}")
    scale = name.endswith(SCALE_SUFFIX) or is_attention_scale(name)
    wants = torch.float8_e4m3fn if fp8 else (torch.float32 if scale else None)
    if (wants is not None and dtype != wants) or (wants is None and not dtype.is_floating_point):
        raise InvalidRequest("weights", f"{name} has dtype {dtype}")


def max_update_bytes(schema: Schema) -> int:
    """The largest update this model can take, checked at the stream's header before anything is
    allocated: a keyframe of float32 high-precision tensors, plus room for zstd's worst-case expansion of
    a dense delta and for the header."""
    tensor_bytes = sum(
        int(np.prod(shape, dtype=np.int64)) * (1 if fp8 else 4) for shape, fp8 in schema.values()
    )
    return int(tensor_bytes * 1.01) + (1 << 20) + 1024 * len(schema)


@dataclass
class Generation:
    """Completions of one admitted request, in the order they finish."""

    loop: GenerationLoop
    ticket: Ticket
    slots: dict[str, Slot]
    num_experts: int = 0  # > 0: each completion carries its routed experts, packed for this many experts

    def __iter__(self) -> Iterator[rollout_pb2.Completion]:
        return (self._completion(sample) for sample in self.ticket)

    def events(self) -> Iterator[tuple[rollout_pb2.Completion, bool]]:
        """A streamed generation as it happens: (a piece of a completion: its new tokens, logprobs and
        text, False) as the engine produces them, and (the whole completion, True) when it finishes."""
        for event in self.ticket.events():
            if isinstance(event, FinishedSample):
                yield self._completion(event), True
                continue
            slot = self.slots[event.request_id]
            yield (
                rollout_pb2.Completion(
                    prompt_id=slot.prompt_id,
                    sample_index=slot.sample_index,
                    token_ids=event.token_ids,
                    logprobs=event.logprobs,
                    text=event.text,
                    weight_version=self.ticket.version,
                    top_logprobs=alternatives(event.top_logprobs),
                ),
                False,
            )

    def _completion(self, sample: FinishedSample) -> rollout_pb2.Completion:
        slot = self.slots[sample.request_id]
        return rollout_pb2.Completion(
            prompt_id=slot.prompt_id,
            sample_index=slot.sample_index,
            prompt_token_ids=slot.prompt_token_ids,
            token_ids=sample.token_ids,
            logprobs=sample.logprobs,
            text=sample.text,
            finish_reason=sample.finish_reason,
            weight_version=self.ticket.version,
            routed_experts=self._routed_experts(sample),
            top_logprobs=alternatives(sample.top_logprobs),
            prompt_logprobs=sample.prompt_logprobs,
            prompt_top_logprobs=alternatives(sample.prompt_top_logprobs),
            cached_prompt_tokens=sample.cached_prompt_tokens,
        )

    def _routed_experts(self, sample: FinishedSample) -> common_pb2.RoutedExperts | None:
        if not self.num_experts or sample.routed_experts is None:
            return None
        _, layers, top_k = sample.routed_experts.shape
        return common_pb2.RoutedExperts(
            moe_layers=layers,
            top_k=top_k,
            id_bytes=routing.id_bytes(self.num_experts),
            expert_ids=routing.pack(sample.routed_experts, self.num_experts),
        )

    def cancel(self) -> None:
        self.loop.cancel(self.ticket)


def alternatives(positions: list[Alternatives] | None) -> list[rollout_pb2.TokenAlternatives]:
    return [
        rollout_pb2.TokenAlternatives(token_ids=[t for t, _ in p], logprobs=[lp for _, lp in p])
        for p in positions or []
    ]


@dataclass
class UpdateResult:
    version: int
    encoding: str
    tensors_updated: int
    apply_s: float
    bytes_received: int


class RolloutService:
    def __init__(self, config: RolloutConfig, engine: VllmEngine, address: str | None = None) -> None:
        """``address``: where the run reaches this replica (its registration proof names it)."""
        self.http_address = ""  # where its OpenAI-compatible face is served, once it is
        self.config = config
        self.engine = engine
        self.recipe = get_recipe(config.recipe)
        self.loop = GenerationLoop(
            engine, max_queued=config.max_queued_samples, outside_during_run=config.outside_samples_during_run
        )
        self.limits = Limits(
            engine.max_model_len,
            engine.vocab_size,
            config.max_n,
            config.max_request_bytes,
            config.default_max_tokens,
            max_samples=config.max_samples_per_request,
            # A token is at most the longest vocabulary entry: a longer text has more tokens than fit.
            max_prompt_bytes=engine.max_model_len * engine.longest_token_bytes,
            max_top_logprobs=config.max_top_logprobs,
        )
        self.tokenizer = Tokenizer(
            engine.tokenize, engine.tokenize_chat if engine.has_chat_template else None
        )
        self.held: WeightSet | None = None  # host copy of the applied set: deltas are XORed against it
        self.held_epoch = -1  # epoch of the update that brought the held version
        # With the trainer's public key, only updates it signed apply, and only forward, across restarts
        # too where a high-water file is configured (fp8rl.security, rollout_service.high_water).
        security = config.security
        self.update_public_key = security.update_public_key()
        self.high_water = (
            HighWater(security.update_high_water_file, signer_id(self.update_public_key))
            if self.update_public_key is not None
            else None
        )
        self.registration_key, self.address = security.registration_key(), address
        self.schema = expected_schema(
            config.model,
            self.recipe.rollout_weights,
            kv_cache_scales=self.recipe.kv_cache_dtype == "fp8",
            high_precision=config.fp8_plan.high_precision,
        )
        self.max_update_bytes = max_update_bytes(self.schema)
        # Where a trainer on this host hands over updates' parts as shared memory (its name is in status).
        self.segments = SegmentInbox() if config.shared_memory_updates else None
        # Where a trainer elsewhere sends them over TCP (its port is in status).
        self.tcp_inbox = (
            TcpInbox(
                config.host,
                config.tcp_updates_port,
                None if config.tcp_updates_in_clear else server_context(security),
                config.stream_idle_s,
            )
            if config.tcp_updates_port is not None
            else None
        )
        model_config = read_config(config.model)
        self.num_experts = num_experts(model_config) if moe_layers(model_config) else 0
        self._update_lock = threading.Lock()
        self.started = time.time()
        self.requests_admitted = 0
        self.updates_applied, self.update_seconds = 0, 0.0  # first part to engine loaded, for /metrics

    @property
    def version(self) -> int:
        return self.loop.version

    def close(self) -> None:
        """Stop generating and close the data planes' inboxes."""
        self.loop.stop()
        for inbox in (self.segments, self.tcp_inbox):
            if inbox is not None:
                inbox.close()

    def generate(
        self, request: rollout_pb2.GenerateRequest, stream: bool = False, run: bool = False
    ) -> Generation:
        """Validate and admit a request; raises before anything runs if it is malformed or asks for a
        version this replica does not hold. ``stream``: its tokens as they come (Generation.events);
        ``run``: the run's own call, served before outside readers' (GenerationLoop)."""
        version = required_version(request)
        engine_requests, slots = parse_generate(request, self.limits, self.tokenizer, stream)
        if run:
            engine_requests = [dataclasses.replace(r, run=True) for r in engine_requests]
        if request.return_routed_experts and not self.num_experts:
            raise InvalidRequest(
                "return_routed_experts", "the model has no mixture-of-experts layers: nothing is routed"
            )
        ticket = self.loop.submit(engine_requests, version, run)
        self.requests_admitted += 1
        return Generation(
            self.loop,
            ticket,
            {r.request_id: s for r, s in zip(engine_requests, slots, strict=True)},
            self.num_experts if request.return_routed_experts else 0,
        )

    def update_weights(self, parts: Iterable[tuple[weights_pb2.WeightHeader, bytearray]]) -> UpdateResult:
        """Verify, decode and apply one update, each part as it arrives (``fp8rl.codec.stream.receive_parts``
        checked that the parts belong together); concurrent updates are serialized.

        Nothing touches the engine before every digest of every part checked out; until then a failure
        (the stream's too) puts the held set back as it was. Generation pauses while the engine changes;
        if the engine fails midway it is restarted, and the replica refuses to generate until a keyframe
        lands.
        """
        stream = iter(parts)
        header, blob = next(stream)  # (receive_parts raises on an empty stream)
        # The lock is held while the later parts arrive (each is applied as it comes): another update
        # waits at most UPDATE_WAIT_S for it (a silent stream is cut after stream_idle_s).
        with self._updating():
            return self._apply_update(header, blob, stream)

    @contextlib.contextmanager
    def _updating(self) -> Iterator[None]:
        """Hold the one update lock (updates and joins are serialized); another update waits for it at
        most UPDATE_WAIT_S, then is refused as Overloaded."""
        if not self._update_lock.acquire(timeout=UPDATE_WAIT_S):
            raise Overloaded(f"another weight update held this replica for {UPDATE_WAIT_S:g} s; retry later")
        try:
            yield
        finally:
            self._update_lock.release()

    def _apply_update(
        self,
        header: weights_pb2.WeightHeader,
        blob: bytearray,
        stream: Iterator[tuple[weights_pb2.WeightHeader, bytearray]],
    ) -> UpdateResult:
        self._admit_header(header)
        self._check_forward(header)
        if header.encoding == "delta" and (self.held is None or header.base_version != self.version):
            holds = "no weight set (needs keyframe)" if self.held is None else f"version {self.version}"
            raise PreconditionFailed(
                f"delta against version {header.base_version}, but replica holds {holds}"
            )
        started = time.perf_counter()
        held = self.held

        def acceptable(decoded: DecodedUpdate) -> None:
            if decoded.version != header.version:
                raise PreconditionFailed(f"header says version {header.version}, payload {decoded.version}")
            check_schema(decoded.weights, self.schema, held)
            if self.high_water is not None:  # before the engine: a crash past here cannot lower the mark
                self.high_water.raise_to(header.epoch, header.version)

        # A delta rewrites the held set's tensors in place, and puts them back if anything refuses it.
        decoded, received = decode_parts(
            itertools.chain([(header, blob)], stream),
            held,
            self.version if held is not None else None,
            functools.partial(admit_tensor, self.schema),
            acceptable,
        )
        self.held = None  # rewritten: the decoded set (or, if the engine fails, none) replaces it
        start = time.perf_counter()
        self.loop.run_exclusive(lambda: self._apply(decoded.weights, decoded.version))
        self.held, self.held_epoch = decoded.weights, header.epoch
        self.updates_applied += 1
        self.update_seconds += time.perf_counter() - started
        return UpdateResult(
            decoded.version,
            decoded.encoding,
            decoded.tensors_updated,
            time.perf_counter() - start,
            received,
        )

    def join_weight_transfer(self, request: weights_pb2.WeightTransferJoin, caller_host: str) -> int:
        """Every engine worker joins the trainer's broadcast group (``weight_transfer``); returns how many.
        The group's store must be on the caller's own host (a replica dials no one else), and a
        collective may wait at most MAX_TRANSFER_WAIT_S. Blocks until the group forms (the trainer forms
        it at the same time)."""
        if self.config.weight_transfer != BROADCAST_BACKEND:
            raise PreconditionFailed("weight_transfer: this replica takes no broadcast updates")
        ranks = self.config.tensor_parallel_size
        init = {f.name: getattr(request, f.name) for f in dataclasses.fields(BroadcastInit)}
        try:
            BroadcastInit(**init)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest("weight_transfer", str(exc)) from exc
        if request.master_address != caller_host:
            raise InvalidRequest("master_address", f"{request.master_address} is not the caller's host")
        if (request.rank_offset, request.world_size) != (1, 1 + ranks):
            raise InvalidRequest("world_size", f"the trainer and this replica's {ranks} ranks: 1 + {ranks}")
        if not 1 <= request.timeout_s <= MAX_TRANSFER_WAIT_S:  # (NaN fails too)
            raise InvalidRequest("timeout_s", f"{request.timeout_s} outside [1, {MAX_TRANSFER_WAIT_S:g}]")
        expected = "nccl" if self.engine.device == "cuda" else "gloo"
        if request.backend != expected:
            raise InvalidRequest("backend", f"{request.backend}: this replica's workers take {expected}")
        with self._updating():
            self.loop.run_exclusive(lambda: self.engine.join_device_plane(init))
        return ranks

    def update_on_device(
        self, request: weights_pb2.DeviceUpdate, receiving: Callable[[], None] = lambda: None
    ) -> UpdateResult:
        """A keyframe over the device plane: its plan checked (signature, version, the model's tensors)
        before the engine receives the broadcast, staged and checked by every worker (each bucket's
        digest, which the signature vouches for), then loaded (all or nothing: a refused update leaves
        the weights as they were). ``receiving`` is called once every check passed and the engine is
        about to receive: only then may the trainer broadcast."""
        header, plan_bytes = request.header, request.plan
        if self.config.weight_transfer != BROADCAST_BACKEND:
            raise PreconditionFailed("weight_transfer: this replica takes no broadcast updates")
        if header.encoding != DEVICE_KEYFRAME or header.parts != 1 or header.part != 0:
            raise InvalidRequest("header", f"a device-plane update is one {DEVICE_KEYFRAME} part")
        if header.total_bytes != len(plan_bytes):
            raise InvalidRequest("header.total_bytes", f"not the plan's {len(plan_bytes)} bytes")
        if self.update_public_key is not None:
            signed = PartHash(header)
            signed.update(plan_bytes)
            verify_update(self.update_public_key, signed, header.signature)
        self._admit_header(header)
        try:
            raw = json.loads(plan_bytes)
            plan = device_planes.from_json_dict(raw)
            device_planes.check_update_info(plan, self.max_update_bytes)
        except (ValueError, RecursionError) as exc:  # (json's errors among them)
            raise InvalidRequest("plan", str(exc)[:200]) from exc
        admit_names(self.schema, plan.names, "plan.names")
        for name, dtype, shape in zip(plan.names, plan.dtype_names, plan.shapes, strict=True):
            admit_tensor(self.schema, name, device_planes.DTYPES[dtype], shape)
        with self._updating():
            self._check_forward(header)
            if self.high_water is not None:  # before the engine: a crash past here cannot lower the mark
                self.high_water.raise_to(header.epoch, header.version)
            start = time.perf_counter()
            self.loop.run_exclusive(lambda: self._apply_on_device(raw, header.version, receiving))
            self.held, self.held_epoch = None, header.epoch  # (no host copy: the next delta is refused)
            seconds = time.perf_counter() - start
            self.updates_applied += 1
            self.update_seconds += seconds
            return UpdateResult(header.version, "keyframe", len(plan.names), seconds, 0)

    def _apply_on_device(
        self, update_info: dict[str, object], version: int, receiving: Callable[[], None]
    ) -> None:
        """Runs on the engine thread with no request in flight. A refused update left every worker's
        weights as they were; one that failed while loading leaves the engine to be restarted."""
        receiving()
        try:
            self._refit(lambda: self.engine.load_from_device_plane(update_info), version, DeviceUpdateRefused)
        except DeviceUpdateRefused as exc:
            raise CorruptUpdateError(f"plan: the broadcast did not arrive as planned ({exc})") from exc

    def _admit_header(self, header: weights_pb2.WeightHeader) -> None:
        """The update is of this replica's format, at a version and epoch that can be."""
        if header.format != self.recipe.rollout_weights:
            raise PreconditionFailed(
                f"replica serves {self.recipe.rollout_weights} weights, got {header.format}"
            )
        if header.version < 0 or header.epoch < 0:
            raise InvalidRequest(
                "header.version", f"version {header.version} and epoch {header.epoch} must be >= 0"
            )

    def _check_forward(self, header: weights_pb2.WeightHeader) -> None:
        """With the trainer's key, (epoch, version) never goes back. The healing cases, signed like any
        update: an equal one (the publisher's same-version delta, or a keyframe of the version a replica
        claims, for one whose bytes diverged or after a trainer restart), and an older version under a
        newer epoch (a coordinator that took the run over, and rewound it to a trainer checkpoint)."""
        if self.high_water is not None:
            self.high_water.check(header.epoch, header.version, header.encoding)

    def _apply(self, weights: WeightSet, version: int) -> None:
        """Runs on the engine thread with no request in flight."""
        self._refit(lambda: self.engine.load_weights(weights.tensors), version)

    def _refit(
        self, load: Callable[[], None], version: int, refused: type[BaseException] | tuple[()] = ()
    ) -> None:
        """``load`` the engine's new weights, then serve ``version``. Where it fails midway (anything but
        ``refused``: nothing was loaded), the engine is restarted and the replica needs a keyframe."""
        try:
            load()
        except refused:
            raise
        except BaseException:
            self.loop.needs_keyframe = True
            self.held = None
            log.exception("weight update to version %d failed midway; restarting the engine", version)
            try:
                self.engine.restart()
            except Exception:
                log.exception("engine restart failed: this replica cannot recover; restart the process")
            raise
        self.loop.version = version
        self.loop.needs_keyframe = False

    def prometheus(self) -> list[Sample]:
        """The replica's figures for /metrics (fp8rl/prometheus.py), read at scrape time."""
        return [
            Sample("rollout_requests", "counter", "Generate requests admitted", self.requests_admitted),
            Sample(
                "rollout_tokens_generated",
                "counter",
                "completion tokens generated",
                self.loop.tokens_generated,
            ),
            Sample(
                "rollout_requests_in_flight", "gauge", "sequences queued or generating", self.loop.in_flight
            ),
            Sample("rollout_queue_depth", "gauge", "sequences waiting for the engine", self.loop.queued),
            Sample("rollout_weight_version", "gauge", "weight version held (-1: base)", self.version),
            Sample(
                "rollout_update_apply_seconds",
                "summary",
                "weight update time from its first part received to the engine serving it",
                self.updates_applied,
                self.update_seconds,
            ),
        ]

    def status(self) -> rollout_pb2.RolloutStatus:
        return rollout_pb2.RolloutStatus(
            model=str(self.config.model),
            recipe=self.recipe.name,
            engine=f"vllm {self.engine.version}",
            device=self.engine.device,
            weight_version=self.version,
            requests_in_flight=self.loop.in_flight,
            tokens_generated=self.loop.tokens_generated,
            uptime_s=time.time() - self.started,
            weight_format=self.recipe.rollout_weights,
            needs_keyframe=self.loop.needs_keyframe,
            registration_proof=self.registration_proof(),
            weight_epoch=self.held_epoch,
            http_address=self.http_address,
            segment_inbox=self.segments.name if self.segments is not None else "",
            tcp_updates_port=self.tcp_inbox.port if self.tcp_inbox is not None else 0,
            tcp_updates_tls=self.tcp_inbox is not None and self.tcp_inbox.tls is not None,
            weight_transfer=self.config.weight_transfer,
            weight_transfer_ranks=self.config.tensor_parallel_size if self.config.weight_transfer else 0,
        )

    def registration_proof(self) -> str:
        """A fresh proof that the run's replica is at this address (valid for minutes; fp8rl.security)."""
        if self.registration_key is None or not self.address:
            return ""
        return registration_proof(self.registration_key, self.address)

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """What the engine computes with (for checks): runs between batches."""
        return self.loop.run_exclusive(self.engine.named_parameters)
