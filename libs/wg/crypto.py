"""The primitives the whitepaper names (section 5.4): HASH, MAC, HMAC, KDF, AEAD, XAEAD, DH.

BLAKE2s and HMAC come from hashlib/hmac, ChaCha20-Poly1305 and X25519 from `cryptography`,
XChaCha20-Poly1305 (cookie replies only) from PyNaCl (libsodium).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from nacl.bindings import (
    crypto_aead_xchacha20poly1305_ietf_decrypt,
    crypto_aead_xchacha20poly1305_ietf_encrypt,
)
from nacl.exceptions import CryptoError

from libs.wg.constants import CONSTRUCTION, IDENTIFIER, MAC_SIZE

__all__ = [
    "INITIAL_CHAIN_KEY",
    "INITIAL_HASH",
    "ZERO_NONCE",
    "DecryptError",
    "aead_decrypt",
    "aead_encrypt",
    "dh",
    "hash_",
    "kdf1",
    "kdf2",
    "kdf3",
    "mac",
    "nonce",
    "xaead_decrypt",
    "xaead_encrypt",
]

ZERO_NONCE = bytes(12)
_NONCE = struct.Struct("<4xQ")
nonce = _NONCE.pack
"""The 96-bit ChaCha20-Poly1305 nonce: 32 zero bits, then the 64-bit counter, little-endian."""


class DecryptError(Exception):
    """Authentication failed, or a Diffie-Hellman result was the all-zero point."""


def hash_(*parts: bytes) -> bytes:
    """HASH(a || b || ...): BLAKE2s with a 32-byte digest."""
    h = hashlib.blake2s()
    for part in parts:
        h.update(part)
    return h.digest()


def mac(key: bytes, data: bytes) -> bytes:
    """MAC(key, input): keyed BLAKE2s with a 16-byte digest."""
    return hashlib.blake2s(data, key=key, digest_size=MAC_SIZE).digest()


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.digest(key, data, "blake2s")


def kdf1(key: bytes, data: bytes) -> bytes:
    t0 = _hmac(key, data)
    return _hmac(t0, b"\x01")


def kdf2(key: bytes, data: bytes) -> tuple[bytes, bytes]:
    t0 = _hmac(key, data)
    t1 = _hmac(t0, b"\x01")
    t2 = _hmac(t0, t1 + b"\x02")
    return t1, t2


def kdf3(key: bytes, data: bytes) -> tuple[bytes, bytes, bytes]:
    t0 = _hmac(key, data)
    t1 = _hmac(t0, b"\x01")
    t2 = _hmac(t0, t1 + b"\x02")
    t3 = _hmac(t0, t2 + b"\x03")
    return t1, t2, t3


def aead_encrypt(key: bytes, counter: int, plaintext: bytes, auth: bytes) -> bytes:
    return ChaCha20Poly1305(key).encrypt(_NONCE.pack(counter), plaintext, auth)


def aead_decrypt(key: bytes, counter: int, ciphertext: bytes, auth: bytes) -> bytes:
    try:
        return ChaCha20Poly1305(key).decrypt(_NONCE.pack(counter), ciphertext, auth)
    except InvalidTag:
        raise DecryptError("authentication failed") from None


def xaead_encrypt(key: bytes, nonce_: bytes, plaintext: bytes, auth: bytes) -> bytes:
    return bytes(crypto_aead_xchacha20poly1305_ietf_encrypt(plaintext, auth, nonce_, key))


def xaead_decrypt(key: bytes, nonce_: bytes, ciphertext: bytes, auth: bytes) -> bytes:
    try:
        return bytes(crypto_aead_xchacha20poly1305_ietf_decrypt(ciphertext, auth, nonce_, key))
    except CryptoError:
        raise DecryptError("authentication failed") from None


def dh(private: X25519PrivateKey, public: bytes) -> bytes:
    """X25519; an all-zero shared secret (a low-order public key) is refused."""
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:
        raise DecryptError("invalid public key") from None
    if not any(shared):
        raise DecryptError("invalid public key")
    return shared


INITIAL_CHAIN_KEY = hash_(CONSTRUCTION)
INITIAL_HASH = hash_(INITIAL_CHAIN_KEY, IDENTIFIER)
