"""The timers of whitepaper section 6, as deadlines that `Device.tick(now)` fires.

Events on the send and receive paths arm or clear deadlines (the `on_*` functions); `expire`
fires the due ones for a peer:

    retransmit      no response Rekey-Timeout (+ jitter) after an initiation: send another,
                    until Rekey-Attempt-Time has passed; then give up and drop the queue
    keepalive       data received and nothing sent for Keepalive-Timeout: send a keepalive
    new handshake   data sent and nothing received for Keepalive-Timeout + Rekey-Timeout:
                    the session looks dead, start a new handshake
    zero keys       no new session for 3 x Reject-After-Time: erase every key
    persistent      nothing sent or received for the peer's persistent keepalive interval
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from libs.wg import send
from libs.wg.constants import (
    KEEPALIVE_TIMEOUT,
    REKEY_ATTEMPT_TIME,
    REKEY_TIMEOUT,
    ZERO_KEYS_AFTER,
)
from libs.wg.events import DropReason, Event, HandshakeFailed
from libs.wg.peer import Peer

if TYPE_CHECKING:
    from libs.wg.device import Device

__all__ = ["expire", "next_deadline"]


def on_handshake_initiated(peer: Peer, now: float, jitter: float) -> None:
    peer.retransmit_at = now + REKEY_TIMEOUT + jitter


def on_handshake_completed(peer: Peer, now: float) -> None:
    peer.retransmit_at = None
    peer.attempts_started = None
    peer.rekey_on_receive_sent = False
    peer.last_handshake = now


def on_session_derived(peer: Peer, now: float) -> None:
    peer.zero_keys_at = now + ZERO_KEYS_AFTER


def on_data_sent(peer: Peer, now: float, jitter: Callable[[], float]) -> None:
    if peer.new_handshake_at is None:
        peer.new_handshake_at = now + KEEPALIVE_TIMEOUT + REKEY_TIMEOUT + jitter()


def on_data_received(peer: Peer, now: float) -> None:
    if peer.keepalive_at is None:
        peer.keepalive_at = now + KEEPALIVE_TIMEOUT
    else:
        peer.keepalive_again = True


def on_authenticated_sent(peer: Peer, now: float) -> None:
    peer.keepalive_at = None
    _traversal(peer, now)


def on_authenticated_received(peer: Peer, now: float) -> None:
    peer.new_handshake_at = None
    _traversal(peer, now)


def _traversal(peer: Peer, now: float) -> None:
    if peer.persistent_keepalive:
        peer.persistent_keepalive_at = now + peer.persistent_keepalive


def next_deadline(peer: Peer) -> float | None:
    deadlines = [
        d
        for d in (
            peer.retransmit_at,
            peer.keepalive_at,
            peer.new_handshake_at,
            peer.zero_keys_at,
            peer.persistent_keepalive_at,
        )
        if d is not None
    ]
    return min(deadlines) if deadlines else None


def expire(device: Device, peer: Peer, now: float) -> list[Event]:
    events: list[Event] = []
    if peer.retransmit_at is not None and now >= peer.retransmit_at:
        peer.retransmit_at = None
        started = peer.attempts_started if peer.attempts_started is not None else now
        if now - started >= REKEY_ATTEMPT_TIME:
            events.extend(_give_up(device, peer, now))
        else:
            events.extend(send.initiate(device, peer, now, retry=True))
    if peer.keepalive_at is not None and now >= peer.keepalive_at:
        peer.keepalive_at = None
        events.extend(send.keepalive(device, peer, now))
        if peer.keepalive_again:
            peer.keepalive_again = False
            peer.keepalive_at = now + KEEPALIVE_TIMEOUT
    if peer.new_handshake_at is not None and now >= peer.new_handshake_at:
        peer.new_handshake_at = None
        events.extend(send.initiate(device, peer, now))
    if peer.zero_keys_at is not None and now >= peer.zero_keys_at:
        peer.zero_keys_at = None
        events.extend(_zero_keys(device, peer))
    if peer.persistent_keepalive_at is not None and now >= peer.persistent_keepalive_at:
        peer.persistent_keepalive_at = None
        events.extend(send.keepalive(device, peer, now))
    return events


def _give_up(device: Device, peer: Peer, now: float) -> list[Event]:
    peer.attempts_started = None
    peer.new_handshake_at = None
    dropped = device.flush_queue(peer, DropReason.HANDSHAKE_FAILED)
    if peer.zero_keys_at is None:
        peer.zero_keys_at = now + ZERO_KEYS_AFTER
    return [HandshakeFailed(peer.public_key, dropped)]


def _zero_keys(device: Device, peer: Peer) -> list[Event]:
    """Erase the sessions; a handshake series in progress (and its queue) carries on."""
    device.retire(peer.clear_sessions())
    peer.new_handshake_at = None
    peer.keepalive_at = None
    if peer.attempts_started is None:
        device.drop_pending(peer)
        device.flush_queue(peer, DropReason.SESSION_EXPIRED)
    return []
