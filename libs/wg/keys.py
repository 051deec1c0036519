"""Keys as raw 32-byte values, and WireGuard's base64 text form (what `wg genkey` prints)."""

from __future__ import annotations

import base64
import binascii
import os

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from libs.wg.constants import KEY_SIZE

__all__ = [
    "generate_preshared_key",
    "generate_private_key",
    "key_from_base64",
    "key_to_base64",
    "public_key",
]


def generate_private_key() -> bytes:
    """A fresh Curve25519 private key, clamped like `wg genkey`."""
    key = bytearray(os.urandom(KEY_SIZE))
    key[0] &= 248
    key[31] = (key[31] & 127) | 64
    return bytes(key)


def generate_preshared_key() -> bytes:
    return os.urandom(KEY_SIZE)


def public_key(private_key: bytes) -> bytes:
    """The public key of a raw private key (like `wg pubkey`)."""
    check_key(private_key, "private key")
    return X25519PrivateKey.from_private_bytes(private_key).public_key().public_bytes_raw()


def key_to_base64(key: bytes) -> str:
    check_key(key, "key")
    return base64.b64encode(key).decode("ascii")


def key_from_base64(text: str) -> bytes:
    """Decode WireGuard's base64 form (44 characters); ValueError when it is not one."""
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not a base64 WireGuard key") from None
    check_key(key, "key")
    return key


def check_key(key: bytes, what: str) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_SIZE:
        raise ValueError(f"a {what} is {KEY_SIZE} raw bytes")
