"""mac1, mac2 and cookie replies (whitepaper section 5.4.4 and 5.4.7).

Every handshake message ends with mac1 (keyed by the receiver's public key: proves the sender
knows it) and mac2 (keyed by a cookie the receiver gave this sender, or zero). A responder
under load processes only messages whose mac2 is valid, and answers the others with a cookie
reply: the cookie is a MAC of the sender's source address under a secret that changes every
two minutes, sent encrypted with XChaCha20-Poly1305 bound to the message's mac1.
"""

from __future__ import annotations

import hmac
import os

from libs.wg.constants import COOKIE_NONCE_SIZE, COOKIE_REFRESH_TIME, KEY_SIZE, MAC_SIZE
from libs.wg.crypto import DecryptError, mac, xaead_decrypt, xaead_encrypt
from libs.wg.messages import CookieReply, pack_cookie_reply

__all__ = ["CookieChecker", "CookieJar"]

_MACS = 2 * MAC_SIZE
_NO_MAC = bytes(MAC_SIZE)


def _mac1_of(data: bytes) -> bytes:
    return data[-_MACS:-MAC_SIZE]


class CookieChecker:
    """The receiving side: checks macs on our incoming handshakes, makes cookie replies."""

    __slots__ = ("_cookie_key", "_mac1_key", "_secret", "_secret_time")

    def __init__(self, mac1_key: bytes, cookie_key: bytes) -> None:
        self._mac1_key = mac1_key
        self._cookie_key = cookie_key
        self._secret = b""
        self._secret_time = float("-inf")

    def mac1_valid(self, data: bytes) -> bool:
        expected = mac(self._mac1_key, data[:-_MACS])
        return hmac.compare_digest(expected, _mac1_of(data))

    def mac2_valid(self, data: bytes, source: bytes, now: float) -> bool:
        if now - self._secret_time >= COOKIE_REFRESH_TIME:
            return False  # the secret that made any cookie out there has expired
        cookie = mac(self._secret, source)
        return hmac.compare_digest(mac(cookie, data[:-MAC_SIZE]), data[-MAC_SIZE:])

    def reply(self, data: bytes, receiver: int, source: bytes, now: float) -> bytes:
        """The cookie reply (type 3) to handshake message `data` whose sender index is
        `receiver`, for the address `source` it came from."""
        if now - self._secret_time >= COOKIE_REFRESH_TIME:
            self._secret = os.urandom(KEY_SIZE)
            self._secret_time = now
        cookie = mac(self._secret, source)
        nonce = os.urandom(COOKIE_NONCE_SIZE)
        sealed = xaead_encrypt(self._cookie_key, nonce, cookie, _mac1_of(data))
        return pack_cookie_reply(receiver, nonce, sealed)


class CookieJar:
    """The sending side, one per peer: writes macs, keeps the cookie the peer gave us."""

    __slots__ = ("_cookie", "_cookie_key", "_cookie_time", "_last_mac1", "_mac1_key")

    def __init__(self, mac1_key: bytes, cookie_key: bytes) -> None:
        self._mac1_key = mac1_key
        self._cookie_key = cookie_key
        self._cookie: bytes | None = None
        self._cookie_time = float("-inf")
        self._last_mac1: bytes | None = None

    def add_macs(self, message: bytearray, now: float) -> None:
        """Fill in mac1 and mac2 (zero without a cookie younger than two minutes)."""
        mac1 = mac(self._mac1_key, bytes(message[:-_MACS]))
        message[-_MACS:-MAC_SIZE] = mac1
        self._last_mac1 = mac1
        if self._cookie is not None and now - self._cookie_time < COOKIE_REFRESH_TIME:
            message[-MAC_SIZE:] = mac(self._cookie, bytes(message[:-MAC_SIZE]))
        else:
            message[-MAC_SIZE:] = _NO_MAC

    def consume_reply(self, reply: CookieReply, now: float) -> bool:
        """Store the cookie of a reply to the last message we sent; False if it is not one."""
        if self._last_mac1 is None:
            return False
        try:
            cookie = xaead_decrypt(self._cookie_key, reply.nonce, reply.cookie, self._last_mac1)
        except DecryptError:
            return False
        self._cookie = cookie
        self._cookie_time = now
        self._last_mac1 = None
        return True

    @property
    def has_cookie(self) -> bool:
        return self._cookie is not None

    def forget(self) -> None:
        self._cookie = None
        self._last_mac1 = None
