"""A run's secrets in one private directory: a bearer token per role, the tokens file servers check them
against (digests only), the trainer's Ed25519 key pair that signs weight updates (the private key goes to
the trainer alone, the public key to replicas), the registration key replicas prove their address with
and, for TLS, a private CA with a certificate per role.

`python -m fp8rl.run_secrets DIR [--no-tls] [--export ROLE=DIR ...]` writes them and copies each role's
share where that process mounts it (compose's one-shot `secrets` service does); an embedded `coordinator
start` writes its own into RUN_DIR/secrets. Existing files are kept, so a restarted or resumed run keeps
its identities. Certificates carry their role as common name (what servers read as the caller's role) and
as their one DNS name (what clients check: fp8rl.security).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import secrets
from pathlib import Path

from fp8rl.credentials import write_private
from fp8rl.security import ROLES, SecurityConfig, token_digest

CERT_DAYS = 825


def token_path(directory: Path, role: str) -> Path:
    return directory / f"{role}.token"


SIGNING_KEY, PUBLIC_KEY, REGISTRATION_KEY = "update-signing.key", "update-verify.pub", "registration.key"
HIGH_WATER = "replica.high-water"  # the embedded replica's (epoch, version) mark, beside its secrets
OLD_UPDATE_KEY = "update.key"  # the symmetric key of earlier versions, which any replica could sign with


def write_run_secrets(directory: Path, tls: bool = False) -> None:
    """Tokens, tokens file, the update-signing key pair and the registration key (and with ``tls`` a CA
    and role certificates) in ``directory`` (0700; files 0600), keeping what is there."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    for role in ROLES:
        if not token_path(directory, role).exists():
            write_private(token_path(directory, role), secrets.token_urlsafe(32) + "\n")
    digests = "".join(f"{role} {token_digest(token_path(directory, role).read_text())}\n" for role in ROLES)
    tokens = directory / "tokens"
    if not tokens.exists() or tokens.read_text() != digests:  # servers may be reading it: swap it whole
        write_private(tokens.with_suffix(".new"), digests)
        os.replace(tokens.with_suffix(".new"), tokens)
    write_signing_pair(directory)
    if not (directory / REGISTRATION_KEY).exists():
        write_private(directory / REGISTRATION_KEY, secrets.token_hex(32) + "\n")
    (directory / OLD_UPDATE_KEY).unlink(missing_ok=True)  # replaced by the pair: nothing reads it now
    if tls:
        write_pki(directory)


def security_for(directory: Path, role: str, tls: bool) -> SecurityConfig:
    """The ``security`` section of a process of ``role`` in a run whose secrets are in ``directory``
    (written first where missing)."""
    write_run_secrets(directory, tls)
    pki = (
        {
            "tls_cert": directory / f"{role}.pem",
            "tls_key": directory / f"{role}.key",
            "tls_ca": directory / "ca.pem",
        }
        if tls
        else {}
    )
    keys: dict[str, Path] = {}
    if role == "trainer":
        keys = {"update_signing_key_file": directory / SIGNING_KEY}
    elif role == "replica":
        keys = {
            "update_public_key_file": directory / PUBLIC_KEY,
            "update_high_water_file": directory / HIGH_WATER,
        }
    if role in ("trainer", "replica"):
        keys["registration_key_file"] = directory / REGISTRATION_KEY
    return SecurityConfig(
        token_file=token_path(directory, role), tokens_file=directory / "tokens", **keys, **pki
    )


def write_signing_pair(directory: Path) -> None:
    """The trainer's Ed25519 key pair: the private key (PKCS8 PEM) that signs updates, and its public key
    (PEM) that replicas verify them with. Kept when both are there."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if (directory / SIGNING_KEY).exists() and (directory / PUBLIC_KEY).exists():
        return
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    write_private(directory / SIGNING_KEY, private.decode())
    write_private(directory / PUBLIC_KEY, public.decode())


def write_pki(directory: Path) -> None:
    """A private CA (ca.pem, ca.key) and a key pair per role (ROLE.pem, ROLE.key), valid for client and
    server use and naming its role only (clients check that name, whatever host they dial), plus Redis'
    server certificate (redis.pem: `redis`, localhost and the loopback addresses)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def pem_key(key: ec.EllipticCurvePrivateKey) -> str:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode()

    def pem_cert(cert: x509.Certificate) -> str:
        return cert.public_bytes(serialization.Encoding.PEM).decode()

    now = datetime.datetime.now(datetime.timezone.utc)
    if (directory / "ca.pem").exists() and (directory / "ca.key").exists():
        ca_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fp8rl run CA")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(ca_key, hashes.SHA256())
        )
        write_private(directory / "ca.key", pem_key(ca_key))
        write_private(directory / "ca.pem", pem_cert(ca_cert))
    for role in (*ROLES, "redis"):  # redis: the compose Redis' server certificate (it speaks TLS too)
        if (directory / f"{role}.pem").exists() and (directory / f"{role}.key").exists():
            continue
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = [x509.DNSName(role)]
        if role == "redis":  # redis-py checks the host it dials
            names += [x509.DNSName("localhost")]
            names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "::1")]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, role)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        write_private(directory / f"{role}.key", pem_key(key))
        write_private(directory / f"{role}.pem", pem_cert(cert))


_SERVER = ("ca.pem", "tokens", REGISTRATION_KEY)  # (a server's, beside its own certificate and token)
BUNDLES = {
    "trainer": (*_SERVER, "trainer.pem", "trainer.key", "trainer.token", SIGNING_KEY),
    "replica": (*_SERVER, "replica.pem", "replica.key", "replica.token", PUBLIC_KEY),
    "coordinator": ("ca.pem", "coordinator.pem", "coordinator.key", "coordinator.token"),
    "reader": ("ca.pem", "reader.pem", "reader.key", "reader.token"),
    "redis": ("ca.pem", "redis.pem", "redis.key"),
}
"""What each process needs, and nothing more (never ca.key): servers hold the tokens file, the trainer
the key that signs updates, replicas only its public key (both the registration key), clients their own
certificate and token."""


def export_bundle(directory: Path, role: str, target: Path) -> None:
    """Copy ``role``'s files from ``directory`` into ``target`` (0700, files 0600)."""
    target.mkdir(parents=True, exist_ok=True)
    os.chmod(target, 0o700)
    (target / OLD_UPDATE_KEY).unlink(missing_ok=True)  # an earlier version's export
    for name in BUNDLES[role]:
        if (directory / name).exists():
            write_private(target / name, (directory / name).read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fp8rl.run_secrets", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where all of the run's secrets are kept (with ca.key)")
    parser.add_argument("--no-tls", action="store_true", help="tokens and update keys only, no CA")
    parser.add_argument(
        "--export",
        action="append",
        default=[],
        metavar="ROLE=DIR",
        help=f"also copy what ROLE needs into DIR (roles: {', '.join(BUNDLES)}); repeat the flag for more",
    )
    args = parser.parse_args(argv)
    write_run_secrets(args.directory, tls=not args.no_tls)
    for spec in args.export:
        role, _, target = spec.partition("=")
        if role not in BUNDLES or not target:
            parser.error(f"--export {spec!r}: expected ROLE=DIR with ROLE in {', '.join(BUNDLES)}")
        export_bundle(args.directory, role, Path(target))
    print(f"run secrets in {args.directory}" + "".join(f"; {spec}" for spec in args.export))


if __name__ == "__main__":
    main()
