"""A session (the whitepaper's transport key pair): seal and open transport messages.

The hot path. Each session keeps one ChaCha20Poly1305 object per direction, seals straight
into the outgoing message buffer and opens straight into the plaintext buffer.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from libs.wg.constants import (
    REJECT_AFTER_MESSAGES,
    REJECT_AFTER_TIME,
    TAG_SIZE,
    TRANSPORT_HEADER_SIZE,
    TYPE_TRANSPORT,
)
from libs.wg.crypto import nonce
from libs.wg.handshake import SessionKeys
from libs.wg.messages import TRANSPORT_HEADER
from libs.wg.replay import ReplayWindow

__all__ = ["Session"]

_OVERHEAD = TRANSPORT_HEADER_SIZE + TAG_SIZE
_pack_header = TRANSPORT_HEADER.pack_into


class Session:
    __slots__ = (
        "_decrypt_into",
        "_encrypt_into",
        "created",
        "initiator",
        "local_index",
        "peer",
        "remote_index",
        "replay",
        "send_counter",
    )

    def __init__(
        self,
        peer: bytes,
        keys: SessionKeys,
        local_index: int,
        remote_index: int,
        initiator: bool,
        created: float,
    ) -> None:
        self.peer = peer
        self.local_index = local_index
        self.remote_index = remote_index
        self.initiator = initiator
        self.created = created
        self.send_counter = 0
        self.replay = ReplayWindow()
        self._encrypt_into = ChaCha20Poly1305(keys.send).encrypt_into
        self._decrypt_into = ChaCha20Poly1305(keys.receive).decrypt_into

    def can_send(self, now: float) -> bool:
        return self.send_counter < REJECT_AFTER_MESSAGES and now - self.created < REJECT_AFTER_TIME

    def can_receive(self, now: float) -> bool:
        return now - self.created < REJECT_AFTER_TIME

    def seal(self, plaintext: bytes | bytearray | memoryview) -> bytearray:
        """The transport message (type 4) carrying `plaintext` (already padded)."""
        counter = self.send_counter
        self.send_counter = counter + 1
        message = bytearray(len(plaintext) + _OVERHEAD)
        _pack_header(message, 0, TYPE_TRANSPORT, self.remote_index, counter)
        self._encrypt_into(nonce(counter), plaintext, None, memoryview(message)[16:])
        return message

    def open(self, message: bytes | bytearray | memoryview, counter: int) -> bytearray | None:
        """The padded plaintext of a transport message, or None if it does not authenticate.

        The counter is not recorded here: the caller checks it against `replay`."""
        plaintext = bytearray(len(message) - _OVERHEAD)
        try:
            self._decrypt_into(nonce(counter), memoryview(message)[16:], None, plaintext)
        except InvalidTag:
            return None
        return plaintext
