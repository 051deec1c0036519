"""Which path one Direct pair's WireGuard takes (G13), decided without I/O: straight to the
peer while the peer's heartbeats come over it, the relays while they do not, and a new round
of ICE checks to get back.

Each side runs this for the pair and tells the other, in its heartbeats, its round and
whether it sends directly. A round that joined is direct until the peer has been silent for
LOSS_AFTER, or says it is not direct on that same round; then the pair falls back to the
relays at once and starts the next round. A round that found no path is tried again after
RETRY_AFTER. A peer that started a higher round is joined there.
"""

from __future__ import annotations

import math
from enum import StrEnum

HEARTBEAT_INTERVAL = 0.25
LOSS_AFTER = 2.0  # eight heartbeats missed: the direct path is gone
RETRY_AFTER = 3.0  # after a round that found no path
AGREE_WITHIN = 3.0  # after a round joined, how long the peer may still say it is not direct


class State(StrEnum):
    JOINING = "joining"  # the first round has not ended: traffic goes by the relays
    DIRECT = "direct"
    RELAYED = "relayed"


class PairPath:
    def __init__(self, now: float) -> None:
        self.state = State.JOINING
        self.round = 0  # the round this side is on (running, or the last one that ended)
        self.running = True  # the first round starts at once
        self.since = now  # when the state last changed
        self.heard = -math.inf  # the peer's last heartbeat
        self.peer_round = -1
        self.peer_direct = False
        self.retry_at = math.inf

    @property
    def direct(self) -> bool:
        return self.state is State.DIRECT

    def heartbeat(self, now: float, peer_round: int, peer_direct: bool) -> None:
        self.heard = now
        self.peer_round = max(self.peer_round, peer_round)
        if peer_round == self.round:
            self.peer_direct = peer_direct

    def round_ended(self, round_: int, joined: bool, now: float) -> None:
        if round_ != self.round:
            return
        self.running = False
        self.since = now
        if joined:
            self.state = State.DIRECT
            self.heard = max(self.heard, now)  # the peer has LOSS_AFTER to be heard over it
            self.retry_at = math.inf
        else:
            self.state = State.RELAYED
            self.retry_at = now + RETRY_AFTER

    def next_round(self, now: float, offered: int = -1) -> int | None:
        """The round to start now, if one is due (`offered`: the highest round the peer
        offered checks for); the caller starts it and this side is on it from then."""
        wanted: int | None = None
        highest = max(offered, self.peer_round)
        if highest > self.round:
            wanted = highest  # the peer started a new round: join it
        elif self.running:
            return None
        elif self.state is State.DIRECT and self._lost(now):
            wanted = self.round + 1
        elif self.state is State.RELAYED and now >= self.retry_at:
            wanted = self.round + 1
        if wanted is None:
            return None
        if self.state is State.DIRECT:
            self.state = State.RELAYED
            self.since = now
        self.round = wanted
        self.running = True
        self.peer_direct = False
        return wanted

    def _lost(self, now: float) -> bool:
        if now - self.heard > LOSS_AFTER:
            return True
        disagrees = self.peer_round == self.round and not self.peer_direct
        return disagrees and now - self.since > AGREE_WITHIN
