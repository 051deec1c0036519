"""Proofs: a member proves it holds the WireGuard key recorded for its epoch; a relay proves it
holds the mesh key. Both answer a fresh challenge, so a recorded proof cannot be replayed."""

from __future__ import annotations

import hashlib
import hmac

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey


def x25519_public(private_key: bytes) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return (
        X25519PrivateKey.from_private_bytes(private_key)
        .public_key()
        .public_bytes(Encoding.Raw, PublicFormat.Raw)
    )


def _shared(private_key: bytes, public_key: bytes) -> bytes:
    return X25519PrivateKey.from_private_bytes(private_key).exchange(
        X25519PublicKey.from_public_bytes(public_key)
    )


def member_proof(
    private_key: bytes, relay_public_key: bytes, nonce: bytes, gang: str, epoch: int, node: str
) -> bytes:
    """HMAC over the challenge and the claimed identity, keyed by DH(member key, relay key):
    the relay computes the same from its own private key and the member's public key."""
    message = b"nodus-relay-v1\x00" + nonce + f"{gang}\x00{epoch}\x00{node}".encode()
    return hmac.new(_shared(private_key, relay_public_key), message, hashlib.sha256).digest()


def mesh_proof(mesh_key: bytes, nonce: bytes, name: str) -> bytes:
    message = b"nodus-mesh-v1\x00" + nonce + name.encode()
    return hmac.new(mesh_key, message, hashlib.sha256).digest()
