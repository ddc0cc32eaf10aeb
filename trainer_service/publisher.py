"""PublishWeights: quantize the master weights into the rollout's format once per version, then send
each target a delta against the version it holds (or a keyframe), concurrently. A target that refuses a
delta (FAILED_PRECONDITION: it holds something else) gets a keyframe at once."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from fp8rl.recipes import WeightFormat
from fp8rl.security import SecurityConfig, channel
from fp8rl.v1 import rollout_pb2_grpc, weights_pb2
from fp8rl.weight_stream import header_of, update_to_chunks
from fp8rl.weights import (
    EncodedUpdate,
    WeightSet,
    build_weight_set,
    encode_delta,
    encode_keyframe,
)

log = logging.getLogger(__name__)
UPDATE_DEADLINE_S = 600.0


@dataclass(frozen=True)
class Target:
    address: str
    held_version: int  # -1: unknown


@dataclass(frozen=True)
class Delivery:
    address: str
    ok: bool
    encoding: str
    wire_bytes: int
    density: float
    seconds: float
    error: str = ""


class Publisher:
    def __init__(
        self,
        weight_format: WeightFormat,
        hp_dtype: torch.dtype,
        recipe: str,
        security: SecurityConfig | None = None,
    ) -> None:
        self.weight_format, self.hp_dtype, self.recipe = weight_format, hp_dtype, recipe
        self.security = security or SecurityConfig()
        self.update_key = self.security.update_key()  # every update is signed with it (fp8rl.security)
        self.last: tuple[int, WeightSet] | None = None  # the one base any delta is computed against
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()
        self._publish_lock = threading.Lock()

    def publish(
        self,
        version: int,
        master: Callable[[], Mapping[str, torch.Tensor]],
        targets: Sequence[Target],
        epoch: int = 0,
        built: WeightSet | None = None,
    ) -> list[Delivery]:
        """Bring every target to ``version``; ``master`` gives the weights (called once, if at all), unless
        ``built`` is their set already. ``epoch``: the fencing token of the coordinator asking (signed
        into each update)."""
        with self._publish_lock:
            base = self.last
            same = base is not None and base[0] == version
            if same:
                weights = base[1]  # type: ignore[index]
            else:
                weights = built or build_weight_set(master(), self.weight_format, self.hp_dtype)
            updates = _Updates(weights, version, base, self.recipe, epoch, self.update_key)
            with ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
                deliveries = list(pool.map(lambda t: self._deliver(t, updates), targets))
            self.last = (version, weights)
            return deliveries

    def build(self, master: Mapping[str, torch.Tensor], keep: bool = True) -> WeightSet | None:
        """The rollout's set of ``master`` (read one tensor at a time: a sharded learner gathers each
        whole as it is read); ``keep=False`` reads them and keeps nothing (the ranks that only help to
        gather)."""
        if not keep:
            for _ in master.values():
                pass
            return None
        return build_weight_set(master, self.weight_format, self.hp_dtype)

    def _deliver(self, target: Target, updates: _Updates) -> Delivery:
        start = time.perf_counter()
        update = updates.for_held(target.held_version)
        try:
            try:
                self._send(target.address, update)
            except grpc.RpcError as exc:
                if update.encoding == "keyframe":
                    raise
                # FAILED_PRECONDITION: the target holds another version. Anything else: the delta did not
                # apply. Either way nothing changed there, and a keyframe heals it.
                log.warning(
                    "delta to %s refused (%s: %s); sending a keyframe",
                    target.address,
                    exc.code().name,
                    exc.details(),
                )
                update = updates.keyframe()
                self._send(target.address, update)
        except grpc.RpcError as exc:
            return Delivery(
                target.address,
                False,
                update.encoding,
                0,
                0.0,
                time.perf_counter() - start,
                f"{exc.code().name}: {exc.details()}",
            )
        return Delivery(
            target.address,
            True,
            update.encoding,
            update.wire_bytes,
            update.density,
            time.perf_counter() - start,
        )

    def _send(self, address: str, update: _Signed) -> None:
        with self._channels_lock:
            if address not in self._channels:
                self._channels[address] = channel(address, self.security, "rollout")
            chan = self._channels[address]
        rollout_pb2_grpc.RolloutStub(chan).UpdateWeights(
            update_to_chunks(update.update, header=update.header), timeout=UPDATE_DEADLINE_S
        )

    def close(self) -> None:
        with self._channels_lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


@dataclass(frozen=True)
class _Signed:
    update: EncodedUpdate
    header: weights_pb2.WeightHeader

    @property
    def encoding(self) -> str:
        return self.update.encoding

    @property
    def wire_bytes(self) -> int:
        return self.update.wire_bytes

    @property
    def density(self) -> float:
        return self.update.density


class _Updates:
    """Encodes (and signs) each distinct update once, however many targets need it."""

    def __init__(
        self,
        weights: WeightSet,
        version: int,
        base: tuple[int, WeightSet] | None,
        recipe: str,
        epoch: int,
        key: bytes | None,
    ) -> None:
        self.weights, self.version, self.base, self.recipe = weights, version, base, recipe
        self.epoch, self.key = epoch, key
        self._cache: dict[str, _Signed] = {}
        self._lock = threading.Lock()

    def for_held(self, held_version: int) -> _Signed:
        """A delta for a target holding the last published version (a tiny one if that is ``version``
        itself, which still proves it holds those exact bytes); a keyframe otherwise."""
        base = self.base
        if base is None or held_version != base[0]:
            return self.keyframe()
        return self._get(
            "delta", lambda: encode_delta(self.weights, base[1], self.version, base[0], self.recipe)
        )

    def keyframe(self) -> _Signed:
        return self._get("keyframe", lambda: encode_keyframe(self.weights, self.version, self.recipe))

    def _get(self, kind: str, encode: Callable[[], EncodedUpdate]) -> _Signed:
        with self._lock:
            if kind not in self._cache:
                update = encode()
                self._cache[kind] = _Signed(update, header_of(update, self.epoch, self.key))
            return self._cache[kind]
