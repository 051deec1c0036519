"""WireGuard (Noise_IKpsk2 handshake, cookies, transport data, timers), sans-I/O.

No sockets, no event loop, no clock reads in the protocol: the caller passes the bytes it
received and its monotonic `now`, and gets back events, among them the bytes to send. See
device.py for the API; messages.py for `message_type`, which relays use to check that they
carry only WireGuard messages.
"""

from libs.wg.constants import MAX_MESSAGE_SIZE, MAX_PAYLOAD
from libs.wg.device import Device, PeerStatus, UnknownPeer
from libs.wg.events import (
    Delivered,
    Dropped,
    DropReason,
    Event,
    HandshakeCompleted,
    HandshakeFailed,
    Outgoing,
)
from libs.wg.framing import IP_PACKETS, SIZED, Framing, IPFraming, SizedFraming
from libs.wg.keys import (
    generate_preshared_key,
    generate_private_key,
    key_from_base64,
    key_to_base64,
    public_key,
)
from libs.wg.messages import message_type

__all__ = [
    "IP_PACKETS",
    "MAX_MESSAGE_SIZE",
    "MAX_PAYLOAD",
    "SIZED",
    "Delivered",
    "Device",
    "DropReason",
    "Dropped",
    "Event",
    "Framing",
    "HandshakeCompleted",
    "HandshakeFailed",
    "IPFraming",
    "Outgoing",
    "PeerStatus",
    "SizedFraming",
    "UnknownPeer",
    "generate_preshared_key",
    "generate_private_key",
    "key_from_base64",
    "key_to_base64",
    "message_type",
    "public_key",
]
