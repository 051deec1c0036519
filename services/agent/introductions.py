"""What a peer says of itself (S1): its member record, addressed to this node.

The server lets a node write only under its own name (the key's last token), so the key says
who wrote it; the record is taken only if it agrees, and names a member of this epoch at the
address the epoch gives it. Anything else is a node speaking for another: dropped, and said.
"""

from __future__ import annotations

import logging

from libs.bus.kv import Change
from libs.contracts.epochs import Epoch
from libs.contracts.relay import Member

log = logging.getLogger("nodus.agent")


def introduced_peer(epoch: Epoch, me: str, change: Change[Member]) -> Member | None:
    peer = change.value
    if peer is None:
        return None
    sender = change.key.rsplit(".", 1)[-1]
    expected = next((m for m in epoch.members if m.node == sender), None)
    if (
        sender == me
        or expected is None
        or peer.node != sender
        or (peer.gang, peer.epoch) != (epoch.gang, epoch.epoch)
        or peer.address != expected.address
    ):
        log.warning(
            "%s epoch %d: dropped the introduction %s: it does not match the epoch's members",
            epoch.gang,
            epoch.epoch,
            change.key,
        )
        return None
    return peer
