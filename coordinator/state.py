"""Run state in Redis, namespaced by run id. Every transition is a Lua compare-and-set guarded by the
leader lease and its fencing token, so two coordinators on one run cannot both drive it, and a stale
leader (its lease expired, someone else took over) cannot commit anything.

Keys under ``fp8rl:run:<id>:``
  config, config_hash     the run's config (immutable once written)
  lease                   holder id, expiring; fence: a counter bumped on every acquisition
  state                   hash: step (next step to commit), phase, trainer_version, updated
  batch:<k>               hash: request (TrainStepRequest bytes), version, info (JSON)
  replicas                hash: address -> version it holds
  metrics, events         streams: one record per committed step; phase changes, errors, recoveries
  stop                    set by `coordinator stop`: finish at the next step boundary
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from fp8rl.config import config_diff

PHASES = ("generate", "train", "publish", "commit", "done")

_GUARD = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] or redis.call('GET', KEYS[2]) ~= ARGV[2] then
  return -1
end
"""

# KEYS: lease, fence, state, events
# ARGV: owner, fence, expect_step, expect_phase, new_step, new_phase, event, now
_TRANSITION = (
    _GUARD
    + """
local step = redis.call('HGET', KEYS[3], 'step')
local phase = redis.call('HGET', KEYS[3], 'phase')
-- Already there, under this lease: this very call, sent again after its reply was lost (connect()).
if step == ARGV[5] and phase == ARGV[6] then return 1 end
if step ~= ARGV[3] or phase ~= ARGV[4] then return 0 end
redis.call('HSET', KEYS[3], 'step', ARGV[5], 'phase', ARGV[6], 'updated', ARGV[8])
redis.call('XADD', KEYS[4], '*', 'kind', 'phase', 'step', ARGV[5], 'phase', ARGV[6], 'detail', ARGV[7])
return 1
"""
)


def _at(phase: str) -> str:
    """Lua: go on only while the state (KEYS[3]) is at step ARGV[3] in ``phase``."""
    return f"""
if redis.call('HGET', KEYS[3], 'step') ~= ARGV[3] or redis.call('HGET', KEYS[3], 'phase') ~= '{phase}' then
  return 0
end
"""


# KEYS: lease, fence, state, events, metrics, batch | ARGV: owner, fence, step, record, next_phase, now
_COMMIT = (
    _GUARD
    + """
-- Committed already, under this lease: this very call, sent again after its reply was lost (connect()).
if redis.call('HGET', KEYS[3], 'step') == tostring(tonumber(ARGV[3]) + 1)
    and redis.call('HGET', KEYS[3], 'phase') == ARGV[5] and redis.call('EXISTS', KEYS[6]) == 0 then
  return 1
end
"""
    + _at("commit")
    + """
local next_step = tostring(tonumber(ARGV[3]) + 1)
redis.call('XADD', KEYS[5], '*', 'step', ARGV[3], 'record', ARGV[4])
redis.call('HSET', KEYS[3], 'step', next_step, 'phase', ARGV[5], 'updated', ARGV[6])
redis.call('DEL', KEYS[6])
redis.call('XADD', KEYS[4], '*', 'kind', 'commit', 'step', ARGV[3], 'phase', ARGV[5], 'detail', '')
return 1
"""
)

# KEYS: lease, fence, state, metrics | ARGV: owner, fence, record
_BASE_RECORD = (
    _GUARD
    + """
if redis.call('HSETNX', KEYS[3], 'base_recorded', 1) == 1 then
  redis.call('XADD', KEYS[4], '*', 'step', 0, 'record', ARGV[3])
  return 1
end
return 2
"""
)

# KEYS: lease, fence | ARGV: owner, ttl_ms -> fence or nil
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return false
"""

# KEYS: lease, fence | ARGV: dead holder, owner, ttl_ms -> fence or nil (the holder changed meanwhile)
_TAKE_OVER = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return redis.call('INCR', KEYS[2])
"""

# KEYS: lease, fence | ARGV: owner, fence, ttl_ms
_RENEW = (
    _GUARD
    + """
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
)

# KEYS: lease, fence, target | ARGV: owner, fence, then field/value pairs
_GUARDED_HSET = (
    _GUARD
    + """
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[3], unpack(ARGV, 3))
return 1
"""
)

# KEYS: lease, fence, stream | ARGV: owner, fence, then the entry's field/value pairs
_GUARDED_XADD = (
    _GUARD
    + """
redis.call('XADD', KEYS[3], '*', unpack(ARGV, 3))
return 1
"""
)

# KEYS: lease, fence, hash | ARGV: owner, fence, field, value
_GUARDED_HSET_FIELD = (
    _GUARD
    + """
redis.call('HSET', KEYS[3], ARGV[3], ARGV[4])
return 1
"""
)

# KEYS: lease, fence, state, events, batch | ARGV: owner, fence, step, detail, now
_REDO_BATCH = (
    _GUARD
    + _at("train")
    + """
redis.call('DEL', KEYS[5])
redis.call('HSET', KEYS[3], 'phase', 'generate', 'updated', ARGV[5])
redis.call('XADD', KEYS[4], '*', 'kind', 'redo-batch', 'step', ARGV[3], 'phase', 'generate',
  'detail', ARGV[4])
return 1
"""
)

# KEYS: lease, fence, state, events, metrics | ARGV: owner, fence, step, phase, detail, now
# The records of the steps given up leave the metrics stream (a record's own "step" is the version it
# reached: committed step k records step k + 1), so each step appears once.
_REWIND = (
    _GUARD
    + """
for _, entry in ipairs(redis.call('XRANGE', KEYS[5], '-', '+')) do
  local fields = entry[2]
  for i = 1, #fields, 2 do
    if fields[i] == 'record' and cjson.decode(fields[i + 1])['step'] > tonumber(ARGV[3]) then
      redis.call('XDEL', KEYS[5], entry[1])
    end
  end
end
redis.call('HSET', KEYS[3], 'step', ARGV[3], 'phase', ARGV[4], 'updated', ARGV[6])
redis.call('XADD', KEYS[4], '*', 'kind', 'recovery', 'step', ARGV[3], 'phase', ARGV[4], 'detail', ARGV[5])
return 1
"""
)


# KEYS: config, config_hash, state | ARGV: config JSON, hash -> 1 if created (all at once), else 0
_INIT_CONFIG = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX') then
  redis.call('SET', KEYS[2], ARGV[2])
  redis.call('HSETNX', KEYS[3], 'step', 0)
  redis.call('HSETNX', KEYS[3], 'phase', 'generate')
  return 1
end
return 0
"""

# KEYS: lease | ARGV: owner -> 1 if this owner's lease was deleted
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class ConfigMismatch(ValueError):
    """The run exists with a different config."""


class LeaseLost(RuntimeError):
    """Another coordinator holds (or took over) the run."""


@dataclass(frozen=True)
class RunState:
    step: int
    phase: str


class RunStore:
    def __init__(self, client: redis.Redis, run_id: str) -> None:
        # redis-py's replies are typed loosely (bytes | str | None); this store always reads bytes.
        self.client: Any = client
        self.run_id = run_id
        self.prefix = f"fp8rl:run:{run_id}:"
        k = self.key
        self._lease_keys = [k("lease"), k("fence")]
        self._transition: Any = client.register_script(_TRANSITION)
        self._commit: Any = client.register_script(_COMMIT)
        self._acquire: Any = client.register_script(_ACQUIRE)
        self._take_over: Any = client.register_script(_TAKE_OVER)
        self._renew: Any = client.register_script(_RENEW)
        self._hset: Any = client.register_script(_GUARDED_HSET)
        self._xadd: Any = client.register_script(_GUARDED_XADD)
        self._hset_field: Any = client.register_script(_GUARDED_HSET_FIELD)
        self._rewind: Any = client.register_script(_REWIND)
        self._redo_batch: Any = client.register_script(_REDO_BATCH)
        self._base_record: Any = client.register_script(_BASE_RECORD)
        self._init_config: Any = client.register_script(_INIT_CONFIG)
        self._release: Any = client.register_script(_RELEASE)
        self.owner = ""
        self.fence = ""

    def key(self, name: str) -> str:
        return self.prefix + name

    # -- config ---------------------------------------------------------------------------------------
    def init_config(self, identity: dict[str, Any], digest: str) -> bool:
        """Store the run's config, or check it against the stored one. True if the run is new."""
        keys = [self.key("config"), self.key("config_hash"), self.key("state")]
        if self._init_config(keys=keys, args=[json.dumps(identity, sort_keys=True), digest]) == 1:
            return True  # one script: a crash cannot leave a config without its state
        stored = json.loads(self.client.get(self.key("config")) or "{}")
        differing = config_diff(stored, identity)
        if differing:
            raise ConfigMismatch(
                f"run {self.run_id} exists with a different config; differing fields: {', '.join(differing)}"
            )
        return False

    # -- lease ----------------------------------------------------------------------------------------
    def acquire(
        self, owner: str, ttl_s: float, holder_is_dead: Callable[[str], bool] = lambda _: False
    ) -> None:
        """Take the lease, or take it over from a holder known to be dead (a crashed coordinator's lease
        would otherwise block its own resume until it expires)."""
        fence = self._acquire(keys=self._lease_keys, args=[owner, int(ttl_s * 1000)])
        if fence is None:
            holder = (self.client.get(self.key("lease")) or b"").decode()
            if holder and holder_is_dead(holder):
                fence = self._take_over(keys=self._lease_keys, args=[holder, owner, int(ttl_s * 1000)])
            if fence is None:
                left_s = max(self.client.pttl(self.key("lease")), 0) / 1000
                raise LeaseLost(
                    f"run {self.run_id} is driven by another coordinator ({holder or '?'}); "
                    f"its lease expires in {left_s:.0f} s unless it renews it"
                )
        self.owner, self.fence = owner, str(fence)

    def renew(self, ttl_s: float) -> None:
        if self._renew(keys=self._lease_keys, args=[self.owner, self.fence, int(ttl_s * 1000)]) != 1:
            raise LeaseLost(f"lost the lease on run {self.run_id}")

    def release(self) -> None:
        """Give the lease up, if it is still ours (compare-and-delete: never another coordinator's)."""
        if self.owner:
            self._release(keys=[self.key("lease")], args=[self.owner])

    # -- state ----------------------------------------------------------------------------------------
    def read(self) -> RunState:
        raw = self.client.hgetall(self.key("state"))
        return RunState(int(raw[b"step"]), raw[b"phase"].decode())

    def transition(self, expect: RunState, new: RunState, detail: str = "") -> None:
        keys = [*self._lease_keys, self.key("state"), self.key("events")]
        args = [self.owner, self.fence, expect.step, expect.phase, new.step, new.phase, detail, time.time()]
        self._checked(self._transition(keys=keys, args=args), f"{expect} -> {new}")

    def commit(self, step: int, record: dict[str, Any], next_phase: str = "generate") -> None:
        keys = [
            *self._lease_keys,
            self.key("state"),
            self.key("events"),
            self.key("metrics"),
            self.key(f"batch:{step}"),
        ]
        args = [self.owner, self.fence, step, json.dumps(record), next_phase, time.time()]
        self._checked(self._commit(keys=keys, args=args), f"commit of step {step}")

    def record_base(self, record: dict[str, Any]) -> bool:
        """The step-0 record (validation of the base model), written once per run. True if written now."""
        keys = [*self._lease_keys, self.key("state"), self.key("metrics")]
        result = self._base_record(keys=keys, args=[self.owner, self.fence, json.dumps(record)])
        if result == -1:
            raise LeaseLost(
                f"base record refused: this coordinator no longer holds the lease on run {self.run_id}"
            )
        return bool(result == 1)

    def base_recorded(self) -> bool:
        return bool(self.client.hget(self.key("state"), "base_recorded"))

    def rewind(self, step: int, detail: str) -> None:
        keys = [*self._lease_keys, self.key("state"), self.key("events"), self.key("metrics")]
        self._checked(
            self._rewind(keys=keys, args=[self.owner, self.fence, step, "generate", detail, time.time()]),
            f"rewind to step {step}",
        )

    def redo_batch(self, step: int, detail: str) -> None:
        """Drop the stored batch of ``step`` (in phase train) and go back to generating it afresh."""
        keys = [*self._lease_keys, self.key("state"), self.key("events"), self.key(f"batch:{step}")]
        self._checked(
            self._redo_batch(keys=keys, args=[self.owner, self.fence, step, detail, time.time()]),
            f"regenerating the batch of step {step}",
        )

    def _checked(self, result: int, what: str) -> None:
        if result == -1:
            raise LeaseLost(
                f"{what} refused: this coordinator no longer holds the lease on run {self.run_id}"
            )
        if result != 1:
            raise RuntimeError(f"{what} refused: the run's state changed underneath (now {self.read()})")

    # -- batches, replicas, metrics, events -----------------------------------------------------------
    def put_batch(self, step: int, request: bytes, version: int, info: dict[str, Any]) -> None:
        keys = [*self._lease_keys, self.key(f"batch:{step}")]
        args = [self.owner, self.fence, "request", request, "version", version, "info", json.dumps(info)]
        self._checked(self._hset(keys=keys, args=args), f"storing the batch of step {step}")

    def get_batch(self, step: int) -> tuple[bytes, int, dict[str, Any]] | None:
        raw = self.client.hgetall(self.key(f"batch:{step}"))
        if not raw:
            return None
        return raw[b"request"], int(raw[b"version"]), json.loads(raw[b"info"])

    def set_replica_version(self, address: str, version: int) -> None:
        keys = [*self._lease_keys, self.key("replicas")]
        self._checked(
            self._hset_field(keys=keys, args=[self.owner, self.fence, address, version]),
            f"recording {address} at version {version}",
        )

    def replica_versions(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.client.hgetall(self.key("replicas")).items()}

    def event(self, kind: str, detail: str, step: int | None = None) -> None:
        """One entry of the run's event stream, fenced like every write under a lease: a coordinator that
        lost its lease records nothing more (LeaseLost). Before any lease (the supervisor noting a restart
        of its children) there is nothing to fence."""
        fields = {"kind": kind, "step": "" if step is None else step, "detail": detail}
        if not self.owner:
            self.client.xadd(self.key("events"), fields)
            return
        pairs = [x for item in fields.items() for x in item]
        keys = [*self._lease_keys, self.key("events")]
        self._checked(
            self._xadd(keys=keys, args=[self.owner, self.fence, *pairs]), f"recording a {kind} event"
        )

    def metrics(self) -> list[dict[str, Any]]:
        return [json.loads(fields[b"record"]) for _, fields in self.client.xrange(self.key("metrics"))]

    def events(self) -> list[dict[str, str]]:
        return [
            {k.decode(): v.decode() for k, v in fields.items()}
            for _, fields in self.client.xrange(self.key("events"))
        ]

    def request_stop(self) -> None:
        self.client.set(self.key("stop"), 1)

    def stop_requested(self) -> bool:
        return bool(self.client.get(self.key("stop")))

    def clear_stop(self) -> None:
        self.client.delete(self.key("stop"))
