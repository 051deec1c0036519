"""The Noise_IKpsk2 handshake of the whitepaper (section 5.4.2 to 5.4.5), without macs.

Four steps, each a pure function of keys and message fields: the initiator creates an
initiation, the responder consumes it and creates a response, the initiator consumes the
response. Both end with the pair of transport keys. Indices, timestamps' freshness, macs and
sessions belong to the callers (send.py, receive.py, cookie.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from libs.wg.constants import KEY_SIZE, LABEL_COOKIE, LABEL_MAC1
from libs.wg.crypto import (
    INITIAL_CHAIN_KEY,
    INITIAL_HASH,
    DecryptError,
    aead_decrypt,
    aead_encrypt,
    dh,
    hash_,
    kdf1,
    kdf2,
    kdf3,
)
from libs.wg.messages import Initiation, Response, pack_initiation, pack_response

__all__ = [
    "ConsumedInitiation",
    "Identity",
    "PeerKeys",
    "PendingInitiation",
    "SessionKeys",
    "consume_initiation",
    "consume_response",
    "create_initiation",
    "create_response",
    "open_timestamp",
]

_NO_PRESHARED_KEY = bytes(KEY_SIZE)


class Identity:
    """This device's static key pair and the values derived from it once."""

    __slots__ = ("cookie_key", "hash", "mac1_key", "private", "public")

    def __init__(self, private_key: bytes) -> None:
        self.private = X25519PrivateKey.from_private_bytes(private_key)
        self.public = self.private.public_key().public_bytes_raw()
        self.hash = hash_(INITIAL_HASH, self.public)  # the responder's starting hash
        self.mac1_key = hash_(LABEL_MAC1, self.public)
        self.cookie_key = hash_(LABEL_COOKIE, self.public)


class PeerKeys:
    """A peer's static public key, the optional preshared key, and precomputed values."""

    __slots__ = ("cookie_key", "hash", "mac1_key", "preshared", "public", "static_static")

    def __init__(self, identity: Identity, public: bytes, preshared: bytes | None) -> None:
        self.public = public
        self.preshared = preshared if preshared is not None else _NO_PRESHARED_KEY
        try:
            self.static_static = dh(identity.private, public)
        except DecryptError:
            raise ValueError("a peer's public key must not be a low-order point") from None
        self.hash = hash_(INITIAL_HASH, public)  # the initiator's starting hash
        self.mac1_key = hash_(LABEL_MAC1, public)
        self.cookie_key = hash_(LABEL_COOKIE, public)


@dataclass(slots=True)
class PendingInitiation:
    """The initiator's state between sending an initiation and receiving its response."""

    local_index: int
    ephemeral: X25519PrivateKey
    chain_key: bytes
    hash: bytes


@dataclass(slots=True)
class ConsumedInitiation:
    """What the responder learned from a valid initiation (timestamp not yet judged)."""

    peer_public: bytes
    remote_index: int
    ephemeral_public: bytes
    timestamp: bytes
    chain_key: bytes
    hash: bytes


@dataclass(slots=True)
class SessionKeys:
    send: bytes
    receive: bytes


def _ephemeral() -> tuple[X25519PrivateKey, bytes]:
    private = X25519PrivateKey.generate()
    return private, private.public_key().public_bytes_raw()


def create_initiation(
    identity: Identity, peer: PeerKeys, local_index: int, timestamp: bytes
) -> tuple[bytearray, PendingInitiation]:
    """Message 1 (macs still zero) and the state to consume the response with."""
    chain_key = INITIAL_CHAIN_KEY
    ephemeral, ephemeral_public = _ephemeral()
    chain_key = kdf1(chain_key, ephemeral_public)
    hash_value = hash_(peer.hash, ephemeral_public)
    chain_key, key = kdf2(chain_key, dh(ephemeral, peer.public))
    static = aead_encrypt(key, 0, identity.public, hash_value)
    hash_value = hash_(hash_value, static)
    chain_key, key = kdf2(chain_key, peer.static_static)
    encrypted_timestamp = aead_encrypt(key, 0, timestamp, hash_value)
    hash_value = hash_(hash_value, encrypted_timestamp)
    message = pack_initiation(local_index, ephemeral_public, static, encrypted_timestamp)
    return message, PendingInitiation(local_index, ephemeral, chain_key, hash_value)


def consume_initiation(identity: Identity, message: Initiation) -> ConsumedInitiation:
    """Message 1 up to the initiator's static key; DecryptError when it does not open.

    The caller looks that key up among its peers, then calls `open_timestamp`."""
    chain_key = kdf1(INITIAL_CHAIN_KEY, message.ephemeral)
    hash_value = hash_(identity.hash, message.ephemeral)
    chain_key, key = kdf2(chain_key, dh(identity.private, message.ephemeral))
    peer_public = aead_decrypt(key, 0, message.static, hash_value)
    hash_value = hash_(hash_value, message.static)
    return ConsumedInitiation(
        peer_public=peer_public,
        remote_index=message.sender,
        ephemeral_public=message.ephemeral,
        timestamp=message.timestamp,  # still encrypted; see open_timestamp
        chain_key=chain_key,
        hash=hash_value,
    )


def open_timestamp(consumed: ConsumedInitiation, peer: PeerKeys) -> None:
    """Second half of consuming message 1, once the peer is known: decrypts the timestamp
    in place of `consumed.timestamp`; DecryptError when it does not open."""
    chain_key, key = kdf2(consumed.chain_key, peer.static_static)
    timestamp = aead_decrypt(key, 0, consumed.timestamp, consumed.hash)
    consumed.hash = hash_(consumed.hash, consumed.timestamp)
    consumed.chain_key = chain_key
    consumed.timestamp = timestamp


def create_response(
    consumed: ConsumedInitiation, peer: PeerKeys, local_index: int
) -> tuple[bytearray, SessionKeys]:
    """Message 2 (macs still zero) and the responder's transport keys."""
    ephemeral, ephemeral_public = _ephemeral()
    chain_key = kdf1(consumed.chain_key, ephemeral_public)
    hash_value = hash_(consumed.hash, ephemeral_public)
    chain_key = kdf1(chain_key, dh(ephemeral, consumed.ephemeral_public))
    chain_key = kdf1(chain_key, dh(ephemeral, peer.public))
    chain_key, tau, key = kdf3(chain_key, peer.preshared)
    hash_value = hash_(hash_value, tau)
    empty = aead_encrypt(key, 0, b"", hash_value)
    receive_key, send_key = kdf2(chain_key, b"")
    message = pack_response(local_index, consumed.remote_index, ephemeral_public, empty)
    return message, SessionKeys(send=send_key, receive=receive_key)


def consume_response(
    identity: Identity, peer: PeerKeys, pending: PendingInitiation, message: Response
) -> SessionKeys:
    """The initiator's transport keys from message 2; DecryptError when it does not open."""
    chain_key = kdf1(pending.chain_key, message.ephemeral)
    hash_value = hash_(pending.hash, message.ephemeral)
    chain_key = kdf1(chain_key, dh(pending.ephemeral, message.ephemeral))
    chain_key = kdf1(chain_key, dh(identity.private, message.ephemeral))
    chain_key, tau, key = kdf3(chain_key, peer.preshared)
    hash_value = hash_(hash_value, tau)
    if aead_decrypt(key, 0, message.empty, hash_value) != b"":
        raise DecryptError("the response's empty payload is not empty")
    send_key, receive_key = kdf2(chain_key, b"")
    return SessionKeys(send=send_key, receive=receive_key)
