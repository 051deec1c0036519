"""The send path: payloads into transport messages, initiations, keepalives (section 6)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from libs.wg import timers
from libs.wg.constants import REKEY_AFTER_MESSAGES, REKEY_AFTER_TIME, REKEY_TIMEOUT
from libs.wg.events import DropReason, Outgoing
from libs.wg.handshake import create_initiation
from libs.wg.peer import Peer
from libs.wg.session import Session

if TYPE_CHECKING:
    from libs.wg.device import Device

__all__ = ["initiate", "keepalive", "send", "send_queued"]


def send(
    device: Device, peer: Peer, plaintext: bytearray | memoryview, now: float
) -> list[Outgoing]:
    """Seal a padded plaintext now if the current session allows it, else queue a copy of it
    (`plaintext` may be a view of a buffer the caller reuses)."""
    session = peer.current
    if session is not None and not peer.queue and session.can_send(now):
        out = [_seal(device, peer, session, plaintext, now)]
        if session.initiator:
            out.extend(_keep_fresh(device, peer, session, now))
        return out
    if len(peer.queue) >= device.queue_limit:
        peer.queue.popleft()
        device.count_drop(DropReason.QUEUE_FULL)
    peer.queue.append(bytearray(plaintext))
    return send_queued(device, peer, now)


def send_queued(device: Device, peer: Peer, now: float) -> list[Outgoing]:
    """Send the queue on the current session, or start a handshake to get one."""
    session = peer.current
    if session is None or not session.can_send(now):
        return initiate(device, peer, now) if peer.queue else []
    out = [_seal(device, peer, session, plaintext, now) for plaintext in peer.queue]
    peer.queue.clear()
    if out:
        out.extend(_keep_fresh(device, peer, session, now))
    return out


def keepalive(device: Device, peer: Peer, now: float) -> list[Outgoing]:
    """An empty transport message; a handshake when there is no session to carry it."""
    session = peer.current
    if session is None or not session.can_send(now):
        return initiate(device, peer, now)
    return [_seal(device, peer, session, b"", now)]


def initiate(device: Device, peer: Peer, now: float, *, retry: bool = False) -> list[Outgoing]:
    """A handshake initiation, at most one per Rekey-Timeout unless it is a retransmission."""
    if not retry and now - peer.last_initiation_sent < REKEY_TIMEOUT:
        return []
    peer.last_initiation_sent = now
    if peer.attempts_started is None:
        peer.attempts_started = now
    device.drop_pending(peer)
    index = device.reserve_index(peer)
    message, pending = create_initiation(device.identity, peer.keys, index, device.timestamp())
    peer.pending = pending
    peer.cookies.add_macs(message, now)
    timers.on_authenticated_sent(peer, now)
    timers.on_handshake_initiated(peer, now, device.jitter())
    return [Outgoing(peer.public_key, bytes(message))]


def _seal(
    device: Device,
    peer: Peer,
    session: Session,
    plaintext: bytes | bytearray | memoryview,
    now: float,
) -> Outgoing:
    message = session.seal(plaintext)
    peer.sent_bytes += len(message)
    timers.on_authenticated_sent(peer, now)
    if plaintext:
        timers.on_data_sent(peer, now, device.jitter)
    return Outgoing(peer.public_key, message)


def _keep_fresh(device: Device, peer: Peer, session: Session, now: float) -> list[Outgoing]:
    """The initiator of a session rekeys after Rekey-After-Time or -Messages (section 6.2)."""
    if session.initiator and (
        session.send_counter > REKEY_AFTER_MESSAGES or now - session.created > REKEY_AFTER_TIME
    ):
        return initiate(device, peer, now)
    return []
