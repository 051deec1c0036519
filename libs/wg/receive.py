"""The receive path: classify, authenticate, then act on each message type.

Nothing here raises on bad input: every message that is not accepted comes back as a
`Dropped` event with its reason, and the device counts it.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from libs.wg import send, timers
from libs.wg.constants import (
    MIN_INITIATION_INTERVAL,
    REKEY_ON_RECEIVE_AFTER,
    TYPE_COOKIE_REPLY,
    TYPE_INITIATION,
    TYPE_RESPONSE,
    TYPE_TRANSPORT,
)
from libs.wg.crypto import DecryptError
from libs.wg.events import (
    Delivered,
    DropReason,
    Event,
    HandshakeCompleted,
    Outgoing,
)
from libs.wg.handshake import (
    consume_initiation,
    consume_response,
    create_response,
    open_timestamp,
)
from libs.wg.messages import (
    TRANSPORT_HEADER,
    classify,
    parse_cookie_reply,
    parse_initiation,
    parse_response,
)
from libs.wg.peer import Peer
from libs.wg.session import Session

if TYPE_CHECKING:
    from libs.wg.device import Device

__all__ = ["receive"]

_SENDER = struct.Struct("<I")
_unpack_transport = TRANSPORT_HEADER.unpack_from
_NO_SESSION: tuple[Peer | None, Session | None] = (None, None)


def receive(
    device: Device, data: bytes | bytearray | memoryview, now: float, source: bytes
) -> list[Event]:
    kind = classify(data)
    if kind == TYPE_TRANSPORT:
        return _transport(device, data, now)
    if isinstance(kind, DropReason):
        return device.drop(kind)
    message = bytes(data)
    if kind == TYPE_COOKIE_REPLY:
        return _cookie_reply(device, message, now)
    refused = _admit_handshake(device, message, now, source)
    if refused is not None:
        return refused
    if kind == TYPE_INITIATION:
        return _initiation(device, message, now)
    assert kind == TYPE_RESPONSE
    return _response(device, message, now)


def _admit_handshake(
    device: Device, message: bytes, now: float, source: bytes
) -> list[Event] | None:
    """mac1 always; under load, a valid mac2 (else a cookie reply) and the source's rate."""
    if not device.checker.mac1_valid(message):
        return device.drop(DropReason.BAD_MAC1)
    device.load.observe(now)
    if not device.under_load(now):
        return None
    if not device.checker.mac2_valid(message, source, now):
        (sender,) = _SENDER.unpack_from(message, 4)
        reply = device.checker.reply(message, sender, source, now)
        return [Outgoing(None, reply, reply_to=source), *device.drop(DropReason.COOKIE_SENT)]
    if not device.rate_limiter.allow(source, now):
        return device.drop(DropReason.RATE_LIMITED)
    return None


def _initiation(device: Device, message: bytes, now: float) -> list[Event]:
    try:
        consumed = consume_initiation(device.identity, parse_initiation(message))
    except DecryptError:
        return device.drop(DropReason.HANDSHAKE_AUTH)
    peer = device.peers.get(consumed.peer_public)
    if peer is None:
        return device.drop(DropReason.UNKNOWN_PEER)
    try:
        open_timestamp(consumed, peer.keys)
    except DecryptError:
        return device.drop(DropReason.HANDSHAKE_AUTH, peer)
    if consumed.timestamp <= peer.greatest_timestamp:
        return device.drop(DropReason.STALE_TIMESTAMP, peer)
    if now - peer.last_initiation_received < MIN_INITIATION_INTERVAL:
        return device.drop(DropReason.INITIATION_FLOOD, peer)
    index = device.reserve_index(peer)
    try:
        response, keys = create_response(consumed, peer.keys, index)
    except DecryptError:  # the initiator's ephemeral key is a low-order point
        device.release_index(index)
        return device.drop(DropReason.HANDSHAKE_AUTH, peer)
    peer.greatest_timestamp = consumed.timestamp
    peer.last_initiation_received = now
    peer.cookies.add_macs(response, now)
    session = Session(peer.public_key, keys, index, consumed.remote_index, False, now)
    device.retire(peer.install_responder_session(session))
    device.bind_index(index, peer, session)
    timers.on_authenticated_received(peer, now)
    timers.on_session_derived(peer, now)
    timers.on_authenticated_sent(peer, now)
    return [Outgoing(peer.public_key, bytes(response))]


def _response(device: Device, message: bytes, now: float) -> list[Event]:
    response = parse_response(message)
    peer = device.pending_peer(response.receiver)
    if peer is None or peer.pending is None:
        return device.drop(DropReason.UNKNOWN_INDEX)
    pending = peer.pending
    try:
        keys = consume_response(device.identity, peer.keys, pending, response)
    except DecryptError:
        return device.drop(DropReason.HANDSHAKE_AUTH, peer)
    peer.pending = None
    session = Session(peer.public_key, keys, pending.local_index, response.sender, True, now)
    device.retire(peer.install_initiator_session(session))
    device.bind_index(pending.local_index, peer, session)
    timers.on_authenticated_received(peer, now)
    timers.on_session_derived(peer, now)
    timers.on_handshake_completed(peer, now)
    events: list[Event] = [HandshakeCompleted(peer.public_key, initiator=True)]
    # The responder may send only once it has seen its new session used: confirm at once.
    out = send.send_queued(device, peer, now)
    events.extend(out if out else send.keepalive(device, peer, now))
    return events


def _cookie_reply(device: Device, message: bytes, now: float) -> list[Event]:
    reply = parse_cookie_reply(message)
    peer = device.index_peer(reply.receiver)
    if peer is None:
        return device.drop(DropReason.UNKNOWN_INDEX)
    if not peer.cookies.consume_reply(reply, now):
        return device.drop(DropReason.BAD_COOKIE, peer)
    return []


def _transport(device: Device, data: bytes | bytearray | memoryview, now: float) -> list[Event]:
    """The hot path: look the session up, check age and counter, open, deliver."""
    _, receiver, counter = _unpack_transport(data)
    peer, session = device.index.get(receiver, _NO_SESSION)
    if session is None or peer is None:
        return device.drop(DropReason.UNKNOWN_INDEX)
    if not session.can_receive(now):
        return device.drop(DropReason.SESSION_EXPIRED, peer)
    replay = session.replay
    if not replay.could_accept(counter):
        return device.drop(DropReason.REPLAYED, peer)
    plaintext = session.open(data, counter)
    if plaintext is None:
        return device.drop(DropReason.TRANSPORT_AUTH, peer)
    if not replay.accept(counter):
        return device.drop(DropReason.REPLAYED, peer)
    peer.received_bytes += len(data)
    timers.on_authenticated_received(peer, now)
    if session is peer.next or now - session.created > REKEY_ON_RECEIVE_AFTER:
        events = _session_news(device, peer, session, now)
    else:
        events = []
    if not plaintext:
        return events  # a keepalive
    payload = device.framing.decode(plaintext)
    if payload is None:
        events.extend(device.drop(DropReason.BAD_PAYLOAD, peer))
        return events
    timers.on_data_received(peer, now)
    events.append(Delivered(peer.public_key, payload))
    return events


def _session_news(device: Device, peer: Peer, session: Session, now: float) -> list[Event]:
    """A responder's new session confirmed by its first use; an initiator's session near
    Reject-After-Time still receiving: rekey, once (section 6.2)."""
    events: list[Event] = []
    if session is peer.next:
        device.retire(peer.confirm_next())
        timers.on_handshake_completed(peer, now)
        events.append(HandshakeCompleted(peer.public_key, initiator=False))
        events.extend(send.send_queued(device, peer, now))
    current = peer.current
    if (
        current is not None
        and current.initiator
        and not peer.rekey_on_receive_sent
        and now - current.created > REKEY_ON_RECEIVE_AFTER
    ):
        peer.rekey_on_receive_sent = True
        events.extend(send.initiate(device, peer, now))
    return events
