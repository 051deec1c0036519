"""A relay's record in nodus-relays (C6), written only by the relay that holds its name.

Records, usage ids and bills are keyed by a relay's name, so two relays given one name (two
hosts with one hostname, a copied unit) would overwrite each other's address, each sending
members to the other, and the usage stream would drop one's records as the other's duplicates.
So every write of the record is a compare-and-set against this relay's last one: of two relays
with one name exactly one keeps it, and the other stops with an error that says why.

A relay starting where a live record of another key holds its name (a relay restarted without
`--key-file`, or another relay) waits CLAIM_WAIT, two announcements: a relay that died does not
announce again, a live one does, and then this one does not start."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from libs.bus import Bus
from libs.bus.auth import WHO_AM_I_WAIT, may_publish, relay_of
from libs.bus.kv import Bucket
from libs.contracts.base import now
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.relay import RelayRecord
from libs.jobs.relays import is_live

log = logging.getLogger("nodus.relay.announce")

ANNOUNCE_EVERY = 2.0  # seconds between heartbeats (a record is live for RELAY_FRESH_SECONDS)
CLAIM_WAIT = 2.5 * ANNOUNCE_EVERY
CLAIM_POLL = 0.5


class NameTaken(NodusError):
    def __init__(self, name: str, holder: RelayRecord) -> None:
        age = (now() - holder.heartbeat_time).total_seconds()
        super().__init__(
            ErrorCode.CONFLICT,
            f"relay name {name!r} is held by another live relay at {holder.address} (key "
            f"{holder.public_key[:12]}..., heard {max(age, 0.0):.0f} s ago). Records and bills "
            "are keyed by a relay's name, so two relays may not share one: give each its own "
            "--name (the systemd units name a host's relays HOST and HOST-PORT, so two hosts "
            "need distinct hostnames)",
        )


class Announcer:
    """Claims the relay's name, then keeps its record fresh."""

    def __init__(
        self,
        relays: Bucket[RelayRecord],
        name: str,
        public_key: str,
        record: Callable[[], RelayRecord],
    ) -> None:
        self.relays = relays
        self.name = name
        self.public_key = public_key
        self.record = record  # the record as of now (address, heartbeat time, ...)
        self.revision: int | None = None  # of this relay's last write; None: create

    async def check_credentials(self, bus: Bus) -> None:
        """A relay given another relay's bus user (a seed copied between hosts, one Kubernetes
        secret for every relay) could never write its record, so members would never find
        it: it does not start, and says whose credentials it has."""
        try:
            info = await bus.user_info(timeout=WHO_AM_I_WAIT)
        except NodusError:
            return  # an older bus configuration: the announcements' failures say it instead
        if may_publish(info, self.relays.subject(self.name)):
            return  # its own user, an operator's, a service's, or a bus without authentication
        holder = relay_of(info)
        whose = f"relay {holder!r}'s" if holder else "not a relay's"
        raise NodusError(
            ErrorCode.UNAUTHORIZED,
            f"relay {self.name!r}: the bus user of --credentials is {whose}, so the bus would "
            "refuse this relay's record and usage; make its own with "
            f"`nodus bus user --relay {self.name}`",
        )

    async def claim(self) -> None:
        """Take the name, or raise NameTaken while another live relay holds it."""
        found = await self.relays.get(self.name)
        if found is None:
            return
        held = found.value
        if held.public_key == self.public_key or not is_live(held, now()):
            self.revision = found.revision
            return
        log.info(
            "relay name %s: a live record of another key (at %s) holds it; waiting %.0f s to "
            "see whether that relay is still announcing it",
            self.name,
            held.address,
            CLAIM_WAIT,
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLAIM_WAIT
        while loop.time() < deadline:
            await asyncio.sleep(CLAIM_POLL)
            again = await self.relays.get(self.name)
            if again is None:
                self.revision = None
                return
            if again.revision != found.revision:
                raise NameTaken(self.name, again.value)
        self.revision = found.revision

    async def announce(self) -> None:
        """Write the record once; NameTaken when another relay wrote it since our last write."""
        record = self.record()
        if self.revision is None:
            written = await self.relays.create(self.name, record)
        else:
            written = await self.relays.update(self.name, record, self.revision)
        if written is not None:
            self.revision = written
            return
        found = await self.relays.get(self.name)
        if found is None:  # deleted (an operator, a bucket's limit): created again next time
            self.revision = None
        elif found.value.public_key == self.public_key:
            self.revision = found.revision
        else:
            raise NameTaken(self.name, found.value)

    async def first(self) -> None:
        """The first announcement, as the relay starts: NameTaken when it lost a race for the
        name; the bus's failures are waited out, as in `run`."""
        try:
            await self.announce()
        except NameTaken:
            raise
        except Exception as error:  # the bus reconnects; keep announcing
            log.warning("announce failed: %s", error)

    async def run(self) -> None:
        """Announce every ANNOUNCE_EVERY until NameTaken."""
        while True:
            await asyncio.sleep(ANNOUNCE_EVERY)
            await self.first()
