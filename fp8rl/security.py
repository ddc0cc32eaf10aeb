"""Who may call what, and proof of where a weight update comes from.

- Transport: TLS on every server that has a certificate, mutual TLS where it also has a CA (callers must
  present a certificate it signed); clients verify servers against the CA under a fixed name per role
  (``trainer``, ``replica``), so a service's certificate must carry its role as a DNS name.
- Identity: a verified client certificate's common name, else an ``authorization: Bearer <token>``
  header whose SHA-256 is listed in the server's tokens file (``<role> <sha256 hex>`` per line: a server
  holds digests, never the tokens themselves).
- Roles: :data:`WRITERS` names who may make each call that changes or exposes a model; every other call
  (Generate, GetStatus, health, reflection) is a read, open to any identified caller, or to anyone where
  ``open_reads`` is set. A server with no way to identify callers (no tokens, no client CA) lets
  everyone in, and so may only bind loopback (:func:`exposure_problem`).
- Updates: the trainer signs each part of an update with the run's Ed25519 private key, which only it
  holds (over a BLAKE3 hash of the part's header fields and every byte of its blob: the part's own digest,
  XXH3, is not collision-resistant); replicas hold only the public key, so no replica can sign. A replica
  with it applies only updates that verify, and only forward: (epoch, version) must grow, where epoch is
  the fencing token of the coordinator that asked for the publish; a replica with a high-water file keeps
  that mark across restarts. A coordinator that takes a run over (a restart, a rewind to a checkpoint)
  holds a higher token, which is how a signed keyframe of an older version heals replicas.
- Replicas prove they belong to the run with ``HMAC(registration key, address, expiry)``, made fresh for
  every status read and valid for minutes, which the trainer checks before sending weights anywhere
  (:func:`registration_proof`, :func:`proof_refusal`).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import ipaddress
import json
import string
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import blake3
import grpc
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fp8rl.errors import PermissionDenied, Unauthenticated

Role = Literal["coordinator", "trainer", "replica", "reader"]
ROLES: tuple[Role, ...] = ("coordinator", "trainer", "replica", "reader")
SERVER_NAMES = {"trainer": "trainer", "rollout": "replica"}
"""The name a client expects in the certificate of each kind of server (TLS host-name check)."""

WRITERS: dict[str, frozenset[str]] = {
    "/fp8rl.v1.Rollout/UpdateWeights": frozenset({"trainer"}),
    "/fp8rl.v1.Rollout/JoinWeightTransfer": frozenset({"trainer"}),
    "/fp8rl.v1.Rollout/UpdateWeightsOnDevice": frozenset({"trainer"}),
    "/fp8rl.v1.Trainer/TrainStep": frozenset({"coordinator"}),
    "/fp8rl.v1.Trainer/PublishWeights": frozenset({"coordinator"}),
    "/fp8rl.v1.Trainer/SaveCheckpoint": frozenset({"coordinator"}),
    "/fp8rl.v1.Trainer/ComputeLogprobs": frozenset({"coordinator", "reader"}),
}
READS = frozenset(
    {
        "/fp8rl.v1.Rollout/Generate",
        "/fp8rl.v1.Rollout/GenerateStream",
        "/fp8rl.v1.Rollout/GetStatus",
        "/fp8rl.v1.Trainer/GetStatus",
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    }
)
"""Calls any identified caller may make (anyone, with open_reads). A method in neither table is refused to
everyone: a new RPC is closed until it is classified here."""
RUN_ROLES = frozenset({"coordinator", "trainer"})
"""The run's own callers: their Generate calls come before outside readers' (rollout_service.generation)."""
TOKEN_METADATA = "authorization"
_CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar("fp8rl_caller_role", default=None)


def caller_role() -> str | None:
    """The role of the caller whose call is being served here (None: not identified, or no security)."""
    return _CALLER.get()


def is_run_caller() -> bool:
    """Whether the call being served is the run's own (the coordinator's or the trainer's)."""
    return _CALLER.get() in RUN_ROLES


@contextlib.contextmanager
def serving_caller(role: str | None) -> Iterator[None]:
    """Serve what runs inside as a call of ``role`` (the HTTP face's middleware; gRPC's interceptor)."""
    token = _CALLER.set(role)
    try:
        yield
    finally:
        _CALLER.reset(token)


MIN_KEY_BYTES = 16


class SecurityConfig(BaseModel):
    """How a process proves who it is, and checks who calls it (section ``security`` of each config)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    tls_cert: Path | None = None
    """PEM certificate (chain) this process presents: as a server, and as a client under mutual TLS."""
    tls_key: Path | None = None
    """PEM private key of tls_cert."""
    tls_ca: Path | None = None
    """PEM CA certificate(s): clients verify servers against it (and then talk TLS); a server requires
    callers to present a certificate it signed (mutual TLS) unless require_client_cert is false."""
    require_client_cert: bool = True
    """With tls_ca on a server: refuse callers without a client certificate (false: tokens identify them)."""
    token_file: Path | None = None
    """File holding the bearer token this process sends as a client."""
    tokens_file: Path | None = None
    """Server: the callers it accepts, one `<role> <sha256 hex of the token>` per line."""
    update_signing_key_file: Path | None = None
    """Trainer: the run's Ed25519 private key (PEM), which signs every weight update; no other process
    holds it."""
    update_public_key_file: Path | None = None
    """Replica: the trainer's Ed25519 public key (PEM); only updates it verifies apply, and only forward."""
    update_high_water_file: Path | None = None
    """Replica: where it keeps the (epoch, version) of the newest signed update it applied (written
    atomically, 0600), so that a restarted replica refuses older ones; unset: kept in memory (a replica
    beyond loopback must set it)."""
    registration_key_file: Path | None = None
    """Trainer and replicas: the run's registration key (hex): a replica proves with it, a few minutes at
    a time, that the address it advertises is the run's; the trainer sends weights only to those."""
    update_key_file: Path | None = Field(None, exclude=True)
    """Removed: the symmetric update key, with which any replica could sign updates. Setting it is a
    config error that says what replaced it."""
    open_reads: bool = False
    """Server: Generate, GetStatus and health answer callers without identity too."""
    allow_plaintext: bool = False
    """Allow plaintext beyond loopback (tokens then cross the network readable: only on trusted networks)."""

    @field_validator("update_key_file")
    @classmethod
    def _symmetric_key_removed(cls, value: Path | None) -> Path | None:
        if value is not None:
            raise ValueError(SYMMETRIC_KEY_REMOVED)
        return value

    @model_validator(mode="after")
    def _pairs(self) -> SecurityConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("give tls_cert and tls_key together")
        return self

    def missing_files(self) -> list[str]:
        """``security.FIELD: PATH`` for each configured file that is not there (checked at start-up, not
        when a config is validated: a compose file's paths exist only inside its containers)."""
        fields = (
            "tls_cert",
            "tls_key",
            "tls_ca",
            "token_file",
            "tokens_file",
            "update_signing_key_file",
            "update_public_key_file",
            "registration_key_file",
        )  # (not update_high_water_file: a replica writes it)
        return [
            f"security.{name}: {getattr(self, name)}"
            for name in fields
            if getattr(self, name) is not None and not Path(getattr(self, name)).is_file()
        ]

    @property
    def client_certs(self) -> bool:
        return self.tls_ca is not None and self.tls_cert is not None and self.require_client_cert

    @property
    def identifies_callers(self) -> bool:
        return self.client_certs or self.tokens_file is not None

    def update_signing_key(self) -> Ed25519PrivateKey | None:
        """The trainer's key that signs updates (None without update_signing_key_file)."""
        if self.update_signing_key_file is None:
            return None
        path = self.update_signing_key_file
        key = _load_pem(path, "update_signing_key_file", private=True)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"security.update_signing_key_file: {path} {_NOT_ED25519}")
        return key

    def update_public_key(self) -> Ed25519PublicKey | None:
        """The trainer's public key, which verifies updates (None without update_public_key_file)."""
        if self.update_public_key_file is None:
            return None
        path = self.update_public_key_file
        key = _load_pem(path, "update_public_key_file", private=False)
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError(f"security.update_public_key_file: {path} {_NOT_ED25519}")
        return key

    def registration_key(self) -> bytes | None:
        if self.registration_key_file is None:
            return None
        try:
            key = bytes.fromhex(self.registration_key_file.read_text().strip())
        except ValueError:
            key = b""
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(
                f"security.registration_key_file: {self.registration_key_file} holds no key of at least "
                f"{MIN_KEY_BYTES} bytes (hex); `python -m fp8rl.run_secrets DIR` writes DIR/registration.key"
            )
        return key

    def check_keys(self) -> None:
        """Read every configured key (raises ValueError naming the field of one that is unusable)."""
        self.update_signing_key()
        self.update_public_key()
        self.registration_key()


SYMMETRIC_KEY_REMOVED = (
    "the run's symmetric update key is no longer used (whoever held it, every replica included, could sign "
    "updates for every replica): the trainer signs with security.update_signing_key_file (an Ed25519 "
    "private key only it holds), replicas verify with security.update_public_key_file and prove their "
    "address with security.registration_key_file; `python -m fp8rl.run_secrets DIR` writes "
    "update-signing.key, update-verify.pub and registration.key"
)
_NOT_ED25519 = "is not an Ed25519 key in PEM; `python -m fp8rl.run_secrets DIR` writes the run's pair"


def _load_pem(path: Path, field: str, private: bool) -> object:
    """A PEM key from ``path``; a ValueError naming ``field`` and the fix for anything else (an old
    symmetric key above all, or the trainer's private key where a replica's public key belongs)."""
    data = path.read_bytes()
    text = data.decode("ascii", "replace").strip()
    if text and all(c in string.hexdigits for c in text):
        raise ValueError(f"security.{field}: {path} holds a symmetric key (hex); {SYMMETRIC_KEY_REMOVED}")
    if not private and b"PRIVATE KEY" in data:
        raise ValueError(
            f"security.{field}: {path} holds a private key; a replica holds only the trainer's public key "
            "(update-verify.pub), never the key that signs"
        )
    try:
        if private:
            return serialization.load_pem_private_key(data, password=None)
        return serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise ValueError(f"security.{field}: {path} {_NOT_ED25519}") from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_problem(security: SecurityConfig, host: str, applies_updates: bool = False) -> str | None:
    """Why a server must not bind ``host`` as configured (None when it may). ``applies_updates``: a
    replica, which beyond loopback applies only signed updates."""
    if is_loopback(host):
        return None
    if applies_updates and security.update_public_key_file is None:
        return (
            f"{host} is not loopback, and a replica there applies only signed weight updates: set "
            "security.update_public_key_file (the trainer's public key, update-verify.pub)"
        )
    if applies_updates and security.update_high_water_file is None:
        return (
            f"{host} is not loopback, and a restarted replica there must refuse replays of older updates: "
            "set security.update_high_water_file (a writable path of its own)"
        )
    if not security.identifies_callers:
        return (
            f"{host} is not loopback, and nothing identifies callers: set security.tokens_file (bearer "
            "tokens) or security.tls_ca with tls_cert/tls_key (mutual TLS); `python -m fp8rl.run_secrets "
            "DIR` writes both"
        )
    if security.tls_cert is None and not security.allow_plaintext:
        return (
            f"{host} is not loopback and security.tls_cert/tls_key are unset: calls (and tokens) would "
            "cross the network in plaintext; configure TLS, or set security.allow_plaintext=true on a "
            "trusted network"
        )
    return None


def refuse_exposure(prog: str, security: SecurityConfig, host: str, applies_updates: bool = False) -> None:
    """Exit with status 2 and a message saying how to configure it, when a server must not bind ``host``
    as configured, a configured file is missing, or a key is unusable."""
    import sys

    problem = exposure_problem(security, host, applies_updates)
    if problem:
        print(f"{prog}: refusing to serve: {problem}", file=sys.stderr)
        raise SystemExit(2)
    missing = security.missing_files()
    if missing:
        print(f"{prog}: no such file: {'; '.join(missing)}", file=sys.stderr)
        raise SystemExit(2)
    try:
        security.check_keys()
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def token_digest(token: str) -> str:
    return hashlib.sha256(token.strip().encode()).hexdigest()


def bearer_role(authorization: str, tokens: dict[str, str]) -> str | None:
    """The role whose token an ``authorization: Bearer <token>`` value carries (``tokens``: sha256 hex ->
    role, :func:`read_tokens`); None for anything else. Compared in constant time."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    digest = token_digest(token)
    return next((r for d, r in tokens.items() if hmac.compare_digest(d, digest)), None)


def read_tokens(path: Path) -> dict[str, str]:
    """sha256 hex -> role, from a tokens file."""
    accepted: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        role, _, digest = line.partition(" ")
        digest = digest.strip().lower()
        if role not in ROLES or len(digest) != 64:
            raise ValueError(f"{path}:{number}: expected `<role> <sha256 hex>` with a role in {ROLES}")
        accepted[digest] = role
    return accepted


# -- the server side ------------------------------------------------------------------------------------


def server_credentials(security: SecurityConfig) -> grpc.ServerCredentials | None:
    if security.tls_cert is None or security.tls_key is None:
        return None
    pair = [(security.tls_key.read_bytes(), security.tls_cert.read_bytes())]
    ca = security.tls_ca.read_bytes() if security.tls_ca else None
    return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=security.client_certs)


class AccessControl(grpc.ServerInterceptor):
    """Checks each call's identity against :data:`WRITERS` and :data:`READS` before its handler runs (for
    a token, before its request is even parsed): a caller without identity gets UNAUTHENTICATED, one with
    the wrong role PERMISSION_DENIED."""

    def __init__(self, security: SecurityConfig) -> None:
        self.enabled = security.identifies_callers
        self.client_certs = security.client_certs
        self.open_reads = security.open_reads
        self.tokens = read_tokens(security.tokens_file) if security.tokens_file else {}

    def token_role(self, metadata: Sequence[tuple[str, Any]]) -> str | None:
        return bearer_role(next((str(v) for k, v in metadata if k == TOKEN_METADATA), ""), self.tokens)

    @staticmethod
    def certificate_role(context: grpc.ServicerContext) -> str | None:
        names = context.auth_context().get("x509_common_name") or []
        role = names[0].decode(errors="replace") if names else None
        return role if role in ROLES else None  # a certificate the handshake verified against our CA

    def refusal(self, method: str, role: str | None) -> Unauthenticated | PermissionDenied | None:
        """Why ``role`` (None: no identity) may not call ``method``; None when it may."""
        if method in READS and (self.open_reads or role is not None):
            return None
        if role is None:
            return Unauthenticated(
                f"{method}: no identity (send `authorization: Bearer <token>` or a client certificate)"
            )
        allowed = WRITERS.get(method, frozenset())
        if role not in allowed:
            who = ", ".join(sorted(allowed)) or "no role: the method is not classified in fp8rl.security"
            return PermissionDenied(f"{method}: role {role} may not call it (only {who})")
        return None

    def intercept_service(
        self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or not self.enabled:
            return handler
        method, metadata = details.method, tuple(details.invocation_metadata or ())
        role = self.token_role(metadata)
        if role is not None or not self.client_certs:
            # Decided from the metadata alone: a refused call never has its request parsed.
            refused = self.refusal(method, role)
            return _as_caller(handler, lambda _: role) if refused is None else _refuse(handler, refused)

        def check(context: grpc.ServicerContext) -> str | None:  # the verified certificate decides
            certified = self.certificate_role(context)
            refused = self.refusal(method, certified)
            if refused is not None:
                context.abort(_code(refused), str(refused))
            return certified

        return _as_caller(handler, check)


def _code(refused: Exception) -> grpc.StatusCode:
    if isinstance(refused, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED
    return grpc.StatusCode.PERMISSION_DENIED


# A method handler's kind (request streaming, response streaming) -> its behaviour attribute and factory.
_HANDLER_KINDS: dict[tuple[bool, bool], tuple[str, Callable[..., grpc.RpcMethodHandler]]] = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def _refuse(handler: Any, refused: Exception) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that aborts at once, leaving the request bytes unparsed."""

    def abort(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(_code(refused), str(refused))

    _, make = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    return make(abort, request_deserializer=None, response_serializer=handler.response_serializer)


def _as_caller(handler: Any, identify: Callable[[grpc.ServicerContext], str | None]) -> grpc.RpcMethodHandler:
    """``handler`` served as the caller ``identify(context)`` names (:func:`caller_role` inside it), which
    runs before its behaviour (and so before any request is read) and may refuse the call."""
    attr, make = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    behaviour = getattr(handler, attr)

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        with serving_caller(identify(context)):
            return behaviour(request, context)

    def streaming(request: Any, context: grpc.ServicerContext) -> Any:
        _CALLER.set(identify(context))  # (a generator's frames may end on another context: no reset)
        try:
            yield from behaviour(request, context)
        finally:
            _CALLER.set(None)

    return make(
        streaming if handler.response_streaming else unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


# -- weight updates -----------------------------------------------------------------------------------

UPDATE_SIGNATURE_SCHEME = "ed25519:"
_UPDATE_CONTEXT = b"fp8rl 2026-12 weight update part\n"  # what the signature is over: this, then the hash


def signer_id(public: Ed25519PublicKey) -> str:
    """A public key's fingerprint (SHA-256 of its raw bytes, hex): names the signer a replica trusts."""
    return hashlib.sha256(public.public_bytes(Encoding.Raw, PublicFormat.Raw)).hexdigest()


class PartHash:
    """BLAKE3 (collision-resistant, on every core for big chunks) over the header fields of one part of an
    update (its index and the part count among them, never the signature) and then every byte of the
    part's blob, fed as it streams. The trainer signs this hash with Ed25519; a replica recomputes it and
    verifies the signature with the public key alone."""

    def __init__(self, header: Any) -> None:
        fields = [
            "fp8rl-update-v4",
            header.version,
            header.base_version,
            header.epoch,
            header.encoding,
            header.part,
            header.parts,
            header.total_bytes,
            header.digest,
            header.format,
            header.recipe,
        ]
        self._hash = blake3.blake3(max_threads=blake3.blake3.AUTO)
        self._hash.update(json.dumps(fields).encode() + b"\n")  # JSON: one reading of where a field ends

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)

    def message(self) -> bytes:
        return _UPDATE_CONTEXT + self._hash.digest()


def sign_update(signer: Ed25519PrivateKey, header: Any, pieces: Iterable[bytes | memoryview]) -> str:
    """The signature of one part (``header`` with ``pieces``, its blob), for ``header.signature``."""
    part = PartHash(header)
    for piece in pieces:
        part.update(piece)
    return UPDATE_SIGNATURE_SCHEME + signer.sign(part.message()).hex()


def verify_update(verifier: Ed25519PublicKey, part: PartHash, claimed: str) -> None:
    """Raise :class:`~fp8rl.errors.Unauthenticated` unless ``claimed`` is the trainer's signature of
    ``part``."""
    if not claimed:
        raise Unauthenticated(
            "header.signature: missing; this replica applies only updates signed by the run's trainer"
        )
    try:
        scheme, _, hex_signature = claimed.partition(":")
        signature = bytes.fromhex(hex_signature)
        if scheme + ":" != UPDATE_SIGNATURE_SCHEME:
            raise ValueError(scheme)
        verifier.verify(signature, part.message())
    except (ValueError, InvalidSignature):
        raise Unauthenticated(
            "header.signature: does not verify under the run's update public key (forged, altered, or "
            "signed by another run's trainer)"
        ) from None


# -- replica registration -----------------------------------------------------------------------------

PROOF_SCHEME = "hmac-sha256-exp"
PROOF_TTL_S = 300
"""A registration proof's lifetime: a replica makes a fresh one for every GetStatus; a proof read there
(or anywhere) stops working this long after it was made."""
CLOCK_SKEW_S = 60
"""How far the trainer's clock and a replica's may differ: a proof expired this long ago, or expiring this
much beyond PROOF_TTL_S, still passes."""


def registration_proof(key: bytes, address: str, now: float | None = None) -> str:
    """What a replica reachable at ``address`` shows, valid for PROOF_TTL_S, to be sent the run's weights:
    only holders of the run's registration key (the trainer and its replicas) make it."""
    expires = int((time.time() if now is None else now) + PROOF_TTL_S)
    return f"{PROOF_SCHEME}:{expires}:{_proof_mac(key, address, expires)}"


def proof_refusal(key: bytes, address: str, proof: str, now: float | None = None) -> str | None:
    """Why ``proof`` does not show that a replica of the run is at ``address`` (None when it does)."""
    if not proof:
        return "no proof"
    scheme, _, rest = proof.partition(":")
    expires_text, _, mac = rest.partition(":")
    if scheme != PROOF_SCHEME or not expires_text.isdigit():
        return f"its proof is not of the form {PROOF_SCHEME}:<expiry>:<mac> (a replica of an older version?)"
    expires, now = int(expires_text), time.time() if now is None else now
    if not hmac.compare_digest(_proof_mac(key, address, expires), mac):
        return "its proof does not verify under the run's registration key"
    if expires < now - CLOCK_SKEW_S:
        return f"its proof expired {now - expires:.0f} s ago (replayed, or its clock is behind)"
    if expires > now + PROOF_TTL_S + CLOCK_SKEW_S:
        return f"its proof expires {expires - now:.0f} s from now, beyond {PROOF_TTL_S} s (a clock ahead)"
    return None


def _proof_mac(key: bytes, address: str, expires: int) -> str:
    return hmac.new(key, f"fp8rl-replica-v2\n{address}\n{expires}".encode(), hashlib.sha256).hexdigest()
