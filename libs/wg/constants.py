"""Protocol constants from the WireGuard whitepaper (sections 5.4 and 6)."""

from __future__ import annotations

from typing import Final

CONSTRUCTION: Final = b"Noise_IKpsk2_25519_ChaChaPoly_BLAKE2s"
IDENTIFIER: Final = b"WireGuard v1 zx2c4 Jason@zx2c4.com"
LABEL_MAC1: Final = b"mac1----"
LABEL_COOKIE: Final = b"cookie--"

KEY_SIZE: Final = 32
TAG_SIZE: Final = 16
MAC_SIZE: Final = 16
TIMESTAMP_SIZE: Final = 12
COOKIE_NONCE_SIZE: Final = 24

# Message types (the first byte; the next three bytes are zero).
TYPE_INITIATION: Final = 1
TYPE_RESPONSE: Final = 2
TYPE_COOKIE_REPLY: Final = 3
TYPE_TRANSPORT: Final = 4

# Exact sizes of the handshake messages, and the smallest transport message (a keepalive).
INITIATION_SIZE: Final = 148
RESPONSE_SIZE: Final = 92
COOKIE_REPLY_SIZE: Final = 64
TRANSPORT_HEADER_SIZE: Final = 16
KEEPALIVE_SIZE: Final = TRANSPORT_HEADER_SIZE + TAG_SIZE

# Payloads travel in length-prefixed TCP frames, not UDP datagrams, so they are not bounded by
# an MTU: a payload is at most 65,535 bytes. The largest transport message carries that
# payload with its 2-byte length (see framing.py) padded to 16 bytes.
MAX_PAYLOAD: Final = 65_535
PADDING_MULTIPLE: Final = 16
MAX_PLAINTEXT: Final = (
    (2 + MAX_PAYLOAD + PADDING_MULTIPLE - 1) // PADDING_MULTIPLE * PADDING_MULTIPLE
)
MAX_MESSAGE_SIZE: Final = TRANSPORT_HEADER_SIZE + MAX_PLAINTEXT + TAG_SIZE

# Timers and limits (whitepaper section 6.1), in seconds and messages.
REKEY_AFTER_MESSAGES: Final = 2**60
REJECT_AFTER_MESSAGES: Final = 2**64 - 2**13 - 1
REKEY_AFTER_TIME: Final = 120.0
REJECT_AFTER_TIME: Final = 180.0
REKEY_ATTEMPT_TIME: Final = 90.0
REKEY_TIMEOUT: Final = 5.0
REKEY_TIMEOUT_JITTER: Final = 1 / 3
KEEPALIVE_TIMEOUT: Final = 10.0
COOKIE_REFRESH_TIME: Final = 120.0
# Key material is erased when no new session was derived for this long (section 6.3).
ZERO_KEYS_AFTER: Final = 3 * REJECT_AFTER_TIME
# The initiator of the current session starts a new handshake when a message arrives on a
# session this old, so that it rekeys before the responder's keys expire (section 6.2).
REKEY_ON_RECEIVE_AFTER: Final = REJECT_AFTER_TIME - KEEPALIVE_TIMEOUT - REKEY_TIMEOUT
# The responder ignores initiations from one peer that arrive closer together than this.
MIN_INITIATION_INTERVAL: Final = 1 / 50

# Under load (section 5.3): the responder answers handshakes without a valid mac2 with a
# cookie reply, and rate-limits each source address; the state lasts this long after the
# load was last seen.
UNDER_LOAD_HOLD: Final = 1.0
DEFAULT_LOAD_THRESHOLD: Final = 50  # handshake messages per second
SOURCE_RATE: Final = 20.0  # handshake messages per second per source, under load
SOURCE_BURST: Final = 5

# Replay window (section 5.4.6 and RFC 6479): a ring of 64-bit blocks, one kept spare, as in
# the Linux driver (8192 bits, a window of 8128 counters).
REPLAY_BLOCK_BITS: Final = 64
REPLAY_RING_BLOCKS: Final = 128
REPLAY_WINDOW: Final = (REPLAY_RING_BLOCKS - 1) * REPLAY_BLOCK_BITS

# Payloads queued per peer while its handshake is in progress.
DEFAULT_QUEUE_LIMIT: Final = 256
