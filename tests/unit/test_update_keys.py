"""Updates only the trainer can sign, and marks and proofs that hold across restarts and expire: Ed25519
signatures checked part by part before a byte is yielded, the replica's high-water file (atomic, 0600,
bound to the signing key), registration proofs bound to an address and an expiry."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fp8rl.codec.encode import keyframe_parts
from fp8rl.codec.stream import parts_to_chunks, receive_parts
from fp8rl.codec.weight_set import WeightSet
from fp8rl.errors import PreconditionFailed, Unauthenticated
from fp8rl.security import CLOCK_SKEW_S, PROOF_TTL_S, proof_refusal, registration_proof, signer_id
from rollout_service.high_water import HighWater


def parted(gen: torch.Generator, signer: Ed25519PrivateKey | None) -> list:
    weights = WeightSet("bf16", {f"w{i}": torch.randn(256, 256, generator=gen).bfloat16() for i in range(4)})
    return list(parts_to_chunks(keyframe_parts(weights, 3, part_bytes=1 << 17), 2, signer, 1 << 15))


def test_every_part_verifies_before_it_is_yielded(gen: torch.Generator) -> None:
    trainer = Ed25519PrivateKey.generate()
    chunks = parted(gen, trainer)
    headers = [c.header for c in chunks if c.WhichOneof("part") == "header"]
    assert len(headers) > 1 and all(h.signature.startswith("ed25519:") for h in headers)
    assert len(list(receive_parts(chunks, verifier=trainer.public_key()))) == len(headers)
    # A byte of the last part flipped: every part before it was yielded, that one never is.
    tampered = [type(c)() for c in chunks]
    for copy, chunk in zip(tampered, chunks, strict=True):
        copy.CopyFrom(chunk)
    tampered[-1].data = bytes([tampered[-1].data[0] ^ 1]) + tampered[-1].data[1:]
    yielded = []
    with pytest.raises(Unauthenticated, match=r"header\.signature: does not verify"):
        for header, _ in receive_parts(tampered, verifier=trainer.public_key()):
            yielded.append(header.part)
    assert yielded == [h.part for h in headers[:-1]]
    # Another key's signature, or none, is refused at the first part (an unsigned one before its data).
    for signer in (Ed25519PrivateKey.generate(), None):
        with pytest.raises(Unauthenticated, match=r"header\.signature"):
            next(receive_parts(parted(gen, signer), verifier=trainer.public_key()))


def test_the_high_water_mark_survives_a_restart_and_is_written_privately(tmp_path: Path) -> None:
    path, signer = tmp_path / "state" / "mark.json", signer_id(Ed25519PrivateKey.generate().public_key())
    mark = HighWater(path, signer)
    mark.raise_to(4, 10)
    mark.raise_to(4, 9)  # never lowered
    assert json.loads(path.read_text()) == {"signer": signer, "epoch": 4, "version": 10}
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    restarted = HighWater(path, signer)
    assert restarted.newest == (4, 10)
    with pytest.raises(PreconditionFailed, match=r"delta of version 9 \(epoch 4\) refused: older than"):
        restarted.check(4, 9, "delta")
    restarted.check(4, 10, "keyframe")  # the same again heals
    restarted.check(5, 0, "keyframe")  # a newer epoch (a coordinator that took over) goes back
    # Replicas sharing the file keep the highest mark either of them took.
    other = HighWater(path, signer)
    restarted.raise_to(4, 12)
    other.raise_to(4, 11)
    assert HighWater(path, signer).newest == (4, 12)
    # A run with new keys starts afresh; a file that is no mark is an error naming the field.
    assert HighWater(path, signer_id(Ed25519PrivateKey.generate().public_key())).newest == (-1, -1)
    path.write_text("not json")
    with pytest.raises(ValueError, match=r"security\.update_high_water_file"):
        HighWater(path, signer)


def test_a_mark_that_cannot_be_written_is_not_raised(tmp_path: Path) -> None:
    path = tmp_path / "mark.json"
    mark = HighWater(path, "s")
    mark.raise_to(1, 1)
    (tmp_path / f".mark.json.{os.getpid()}.tmp").mkdir()  # where the write would go: it fails, even as root
    with pytest.raises(OSError):
        mark.raise_to(2, 0)
    assert mark.newest == (1, 1) and HighWater(path, "s").newest == (1, 1)


def test_registration_proofs_name_an_address_and_expire() -> None:
    key, now = os.urandom(32), 1_000_000.0
    proof = registration_proof(key, "10.0.0.7:50051", now)
    assert proof_refusal(key, "10.0.0.7:50051", proof, now) is None
    assert proof_refusal(key, "10.0.0.7:50051", proof, now + PROOF_TTL_S + CLOCK_SKEW_S) is None
    assert "expired" in str(proof_refusal(key, "10.0.0.7:50051", proof, now + PROOF_TTL_S + CLOCK_SKEW_S + 1))
    assert "does not verify" in str(proof_refusal(key, "10.0.0.8:50051", proof, now))
    assert "does not verify" in str(proof_refusal(os.urandom(32), "10.0.0.7:50051", proof, now))
    # Changing the expiry breaks the MAC: a proof cannot be stretched.
    scheme, expires, mac = proof.split(":")
    stretched = f"{scheme}:{int(expires) + 3600}:{mac}"
    assert "does not verify" in str(proof_refusal(key, "10.0.0.7:50051", stretched, now))
    ahead = registration_proof(key, "10.0.0.7:50051", now + 3600)
    assert "beyond" in str(proof_refusal(key, "10.0.0.7:50051", ahead, now))
