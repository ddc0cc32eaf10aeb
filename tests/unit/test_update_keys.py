"""Updates only the trainer can sign, and proofs that expire: Ed25519 signatures checked part by part
before a byte is yielded, registration proofs bound to an address and an expiry."""

from __future__ import annotations

import os

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fp8rl.codec.encode import keyframe_parts
from fp8rl.codec.stream import parts_to_chunks, receive_parts
from fp8rl.codec.weight_set import WeightSet
from fp8rl.errors import Unauthenticated
from fp8rl.security import CLOCK_SKEW_S, PROOF_TTL_S, proof_refusal, registration_proof


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
