"""A member's two relays and which one is home: both kept connected, the home one carrying
the tunnel; when it dies the tunnel moves to the other at once (make-before-break, G15) and
whoever waits for a peer to be reachable is woken. When the relay the placer chose is back
and stays up, the tunnel moves home to it again, so the placer's spread of gangs over the
relays holds after a relay restarts (an upgrade, a crash). When both are gone for longer than
a restart takes (their host lost), the member is given another relay (`rescue`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from nats.errors import Error as NatsError
from prometheus_client import Counter

from libs.contracts.errors import NodusError
from libs.contracts.relay import RelayRecord
from libs.relayproto.client import RelayClient
from libs.runtime.tasks import TaskSet
from libs.tunnel import Link

log = logging.getLogger("nodus.agent.tunnel")

# A member that reaches its other relay first waits this long for its home one (the placer
# spreads gangs across relays by which one they home on) before taking the other.
HOME_GRACE_SECONDS = 1.0

# The chosen relay back must stay up this long before the tunnel moves home to it: a relay
# that keeps restarting is not moved to and from.
RETURN_HOME_SECONDS = 5.0
# A move home waits at most this long for what is in flight through the current relay to be
# acknowledged (then it sends it again through the new home, as a failover does).
RETURN_DRAIN_SECONDS = 1.0
# A member none of whose relays has been up for this long is given another live relay: a
# relay restarting is back within a second or two, a relay host lost is not back for minutes.
RESCUE_SECONDS = 5.0
# At most this many relays beyond its gang's two (each is kept connected for the epoch).
RESCUES_AT_MOST = 2

FAILOVERS = Counter("nodus_agent_relay_failovers_total", "Moves to the other relay", ["node"])
RETURNS = Counter(
    "nodus_agent_relay_returns_total",
    "Moves back to the relay the placer chose once it was up again",
    ["node"],
)
RESCUES = Counter(
    "nodus_agent_relay_rescues_total",
    "Relays a member was given beyond its gang's two, every one of its relays being gone",
    ["node"],
)


class RelayHome:
    def __init__(
        self,
        node: str,
        relays: list[RelayClient],
        moved: Callable[[], None],
        plan_return: Callable[[RelayClient], None] | None = None,
    ) -> None:
        """`moved` runs once a relay became home: every link resends what is not acknowledged.
        The first of `relays` is the one to home on when it is up; the others are failovers.
        `plan_return`: asked to move home to the chosen relay back up, it calls `go_home` once
        what is in flight through the current one is acknowledged (none of it is sent again);
        without it, the move is at once, like a failover."""
        self.node = node
        self.relays = relays
        self.home: RelayClient | None = None
        self._grace: asyncio.TimerHandle | None = None
        self._return: asyncio.TimerHandle | None = None
        self._moved = moved
        self._plan_return = plan_return
        self._reachability = asyncio.Event()  # pulsed when a relay or a peer comes or goes
        self._tasks: TaskSet | None = None
        self._chosen = len(relays)  # the gang's relays; any after them are rescues
        # Since when no relay of this member has been up, once one was (loop time).
        self._stranded_since: float | None = None

    def keep(self, tasks: TaskSet) -> None:
        self._tasks = tasks
        for relay in self.relays:
            self._keep(relay)

    def _keep(self, relay: RelayClient) -> None:
        if self._tasks is not None:
            self._tasks.spawn(relay.keep(self._up, self._down, log), name=f"relay {relay.name}")

    @property
    def rescues(self) -> int:
        return len(self.relays) - self._chosen

    def stranded_for(self) -> float:
        """Seconds since the last of this member's relays went down (0 while one is up, or
        before any was)."""
        since = self._stranded_since
        return 0.0 if since is None else asyncio.get_running_loop().time() - since

    def rescue(self, relay: RelayClient) -> None:
        """Another relay for a member whose relays are all gone: kept connected like them,
        home as soon as it is up. The chosen relay is still moved home to once it is back and
        stays up. The stranded clock starts again, so that another rescue waits as long."""
        RESCUES.labels(self.node).inc()
        log.warning(
            "no relay of %s up for %.0f s: adding relay %s",
            ", ".join(r.name for r in self.relays),
            self.stranded_for(),
            relay.name,
        )
        self.relays.append(relay)
        self._stranded_since = asyncio.get_running_loop().time()
        self._keep(relay)

    def close(self) -> None:
        for timer in (self._grace, self._return):
            if timer is not None:
                timer.cancel()
        for relay in self.relays:
            relay.close()

    async def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.home is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no relay reachable among {[r.address for r in self.relays]}")
            await asyncio.sleep(0.02)

    @property
    def path(self) -> str:
        return f"derp:{self.home.region}" if self.home is not None else "none"

    def reaches(self, key: bytes) -> bool:
        """A relay is home and can deliver to the peer with `key` (the peer is connected to
        it, or to a relay it meshes with)."""
        home = self.home
        return home is not None and home.up and key in home.present

    def reaches_elsewhere(self, key: bytes) -> bool:
        """Some connected relay, home or not, can deliver to the peer."""
        return any(r.up and key in r.present for r in self.relays)

    async def changed(self, timeout: float) -> None:
        """Return when a relay or a peer comes or goes, or after `timeout`."""
        try:
            await asyncio.wait_for(self._reachability.wait(), timeout)
        except TimeoutError:
            pass

    def presence(self, relay: RelayClient) -> None:
        """A relay says who is connected to it (or its mesh) changed."""
        self._pulse()

    def _pulse(self) -> None:
        self._reachability.set()
        self._reachability = asyncio.Event()

    def _up(self, relay: RelayClient) -> None:
        stranded, self._stranded_since = self._stranded_since is not None, None
        if self.home is not None:
            if relay is self.relays[0] and self._return is None:
                self._return = asyncio.get_running_loop().call_later(
                    RETURN_HOME_SECONDS, self._return_home
                )
            return
        if relay is self.relays[0] or stranded:
            # The chosen relay, or the first back after every relay was lost: the grace for
            # the chosen one is for a member's start, when the placer's spread is made.
            self._make_home(relay, failover=False)
        elif self._grace is None:
            self._grace = asyncio.get_running_loop().call_later(HOME_GRACE_SECONDS, self._settle)

    def _settle(self) -> None:
        """The home relay did not come up in its grace: the first other one up is home."""
        self._grace = None
        if self.home is None:
            relay = next((r for r in self.relays if r.up), None)
            if relay is not None:
                self._make_home(relay, failover=False)

    def _return_home(self) -> None:
        """The chosen relay stayed up: carry the tunnel there again. Both are connected, so
        nothing waits for a connection; the tunnel's plan moves once what is in flight is
        acknowledged (without one, what is unacknowledged is sent again, as on a failover)."""
        self._return = None
        chosen = self.relays[0]
        if self.home is not None and self.home is not chosen and chosen.up:
            if self._plan_return is None:
                self.go_home(resend=True)
            else:
                self._plan_return(chosen)

    def go_home(self, resend: bool) -> None:
        """Home on the chosen relay again, if it is up and not home already. `resend`: what is
        unacknowledged goes again through it (False: it was all acknowledged first)."""
        chosen, was = self.relays[0], self.home
        if was is None or was is chosen or not chosen.up:
            return
        RETURNS.labels(self.node).inc()
        log.info("relay %s is back; moving home to it from %s", chosen.name, was.name)
        self._make_home(chosen, failover=False, resend=resend)

    def _down(self, relay: RelayClient) -> None:
        if relay is self.relays[0] and self._return is not None:
            self._return.cancel()  # down again before it was moved to
            self._return = None
        if self.home is relay:
            self._failover(relay)
        if self._stranded_since is None and not any(r.up for r in self.relays):
            self._stranded_since = asyncio.get_running_loop().time()

    def _make_home(self, relay: RelayClient, failover: bool, resend: bool = True) -> None:
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        self.home = relay
        relay.home(failover)
        if resend:
            self._moved()
        self._pulse()

    def _failover(self, lost: RelayClient) -> None:
        """Make-before-break: the other relay is already connected; move to it and resend."""
        self.home = None
        self._pulse()
        for relay in self.relays:
            if relay is not lost and relay.up:
                FAILOVERS.labels(self.node).inc()
                log.warning("relay %s lost; moving to %s", lost.name, relay.name)
                self._make_home(relay, failover=True)
                return
        log.warning("relay %s lost and no other relay is up", lost.name)


async def rescue_when_stranded(
    relays: RelayHome,
    spares: Callable[[], Awaitable[list[RelayRecord]]],
    client_for: Callable[[RelayRecord], RelayClient],
) -> None:
    """A gang's two relays are its for the epoch; when both have been down longer than a
    restart takes (their host lost, or both lost at once), the member is given the first of
    `spares()` (the live relays in its order of preference) it does not have: every relay
    meshes with every other, so its peers, wherever they are homed, reach it there. Once the
    chosen relay is back and stays up, the member moves home to it, as after any failover.
    Runs until cancelled: the Relayed path's tunnel and a Direct member's fallback alike."""
    said = False  # that no other relay is live, once per stranding
    while True:
        await relays.changed(1.0)
        if relays.stranded_for() < RESCUE_SECONDS:
            said = False
            continue
        if relays.rescues >= RESCUES_AT_MOST:
            continue  # said at each rescue; the relays it has are still dialled
        try:
            records = await spares()
        except (NodusError, NatsError, OSError, TimeoutError) as error:  # the bus down too
            log.warning("no relay list to rescue %s from: %s", relays.node, error)
            continue
        have = {r.name for r in relays.relays}
        spare = [r for r in records if r.name not in have]
        if not spare:
            if not said:
                log.warning("%s: no relay it has is up, and no other is live", relays.node)
                said = True
            continue
        relays.rescue(client_for(spare[0]))


class ReturnHome:
    """A move home to the chosen relay back up, made once what is in flight through the
    current one is acknowledged: meanwhile the tunnel sends acknowledgements only, and its
    numbered messages wait. The link is go-back-N, so a move at once would send the whole
    window again (the peer's programs would wait for it, as after a failover); this way none
    of it is sent twice and the wait is the acknowledgements' way back."""

    def __init__(
        self, relays: RelayHome, links: Callable[[], Iterable[Link]], flush: Callable[[], None]
    ) -> None:
        self._relays = relays
        self._links = links
        self._flush = flush
        self._deadline: asyncio.TimerHandle | None = None
        self._began = 0.0

    @property
    def under_way(self) -> bool:
        return self._deadline is not None

    def plan(self, relay: RelayClient) -> None:
        if self._deadline is None:
            loop = asyncio.get_running_loop()
            self._deadline = loop.call_later(RETURN_DRAIN_SECONDS, self._finish, True)
            self._began = time.monotonic()
            self.check()

    def check(self) -> None:
        """After acknowledgements came: the move, if nothing is awaited any more."""
        if self._deadline is not None and not any(
            link.awaiting_acknowledgement for link in self._links()
        ):
            self._finish(resend=False)

    def stop(self) -> None:
        """A failover moved the tunnel meanwhile (it resends what is unacknowledged)."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _finish(self, resend: bool) -> None:
        self.stop()
        waited = (time.monotonic() - self._began) * 1000
        if resend:
            log.warning("in flight not acknowledged within %.0f ms: sent again", waited)
        else:
            log.info("in flight acknowledged in %.0f ms", waited)
        self._relays.go_home(resend)
        self._flush()
