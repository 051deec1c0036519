"""Billing across a relay crash (issue 9, G17): bytes a relay metered survive SIGKILL in its
usage journal and are published when it starts again, once, whatever moment the kill hit:
between frames, with a record prepared and unpublished, or published and not yet marked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from libs.bus import Bus
from libs.bus.server import NatsServer
from libs.client.client import Client
from services.relay.billing import (
    HEADER,
    SLOT_HEAD,
    V1_MAGIC,
    V1_NUMBERS,
    V1_NUMBERS_AT,
    V1_SLOT_SIZE,
    Journal,
    UsageMeter,
)

REPO = Path(__file__).resolve().parents[2]


def killed_run(nats: NatsServer, journal: Path, script: str) -> None:
    """Run `script` in a process that meters into `journal`, then SIGKILLs itself."""
    program = (
        textwrap.dedent(
            f"""
        import asyncio, os, signal
        from pathlib import Path
        from libs.bus import Bus
        from libs.contracts import names
        from services.relay.billing import UsageMeter

        async def main():
            bus = await Bus.open({nats.url!r}, name="dying-relay", streams=True)
            meter = UsageMeter(bus, "relay-x", Path({str(journal)!r}))
        """
        )
        + textwrap.indent(textwrap.dedent(script), "    ")
        + ("\n    os.kill(os.getpid(), signal.SIGKILL)\n\nasyncio.run(main())\n")
    )
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO, capture_output=True, timeout=60
    )
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()


async def billed(bus: Bus) -> int:
    return (await Client(bus).usage()).get("acme.g", 0)


async def restarted(bus: Bus, journal: Path) -> None:
    meter = UsageMeter(bus, "relay-x", journal)
    await meter.flush()
    await meter.flush()
    meter.close()


async def test_bytes_metered_before_a_kill_are_billed_once_after_the_restart(
    nats_server: NatsServer, bus: Bus, tmp_path: Path
) -> None:
    journal = tmp_path / "usage.journal"
    killed_run(
        nats_server,
        journal,
        """
        for _ in range(1000):
            meter.add("acme.g", 1, "a", 1400)
        await meter.flush()                 # 1,400,000 bytes published
        for _ in range(77):
            meter.add("acme.g", 1, "a", 1000)   # 77,000 metered, then the kill
        """,
    )
    assert await billed(bus) == 1_400_000
    await restarted(bus, journal)
    assert await billed(bus) == 1_477_000
    await restarted(bus, journal)  # a second restart has nothing more to say
    assert await billed(bus) == 1_477_000


@pytest.mark.parametrize("acknowledged", [False, True])
async def test_a_record_caught_mid_publish_lands_exactly_once(
    nats_server: NatsServer, bus: Bus, tmp_path: Path, acknowledged: bool
) -> None:
    """Killed after the record was prepared: before it was published, or after the stream
    took it but before the journal marked it. Either way the restart republishes the same
    record under the same id, and the stream keeps one."""
    journal = tmp_path / "usage.journal"
    publish = "await meter._publish(key, slot, 0.0)" if acknowledged else "pass  # never published"
    killed_run(
        nats_server,
        journal,
        f"""
        meter.add("acme.g", 2, "b", 5000)
        key = ("acme.g", 2, "b")
        slot = meter.journal.slots[key]
        meter.journal.prepare(slot)
        {publish}
        meter.add("acme.g", 2, "b", 300)    # metered after the record was fixed
        """,
    )
    assert await billed(bus) == (5000 if acknowledged else 0)
    await restarted(bus, journal)
    assert await billed(bus) == 5300


def test_a_file_that_is_not_a_journal_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "usage.journal"
    path.write_bytes(b"not a journal at all" * 100)
    with pytest.raises(ValueError, match="not a relay usage journal"):
        Journal(path)


def test_the_journal_grows_past_its_first_slots(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "usage.journal")
    for node in range(1500):
        journal.count(journal.slot(("acme.g", 1, f"n{node}")), node)
    journal.close()
    again = Journal(tmp_path / "usage.journal")
    assert len(again.slots) == 1500
    assert again.slots[("acme.g", 1, "n1499")].counted == 1499
    again.close()
    os.remove(tmp_path / "usage.journal")


async def test_a_members_own_total_survives_the_kill_and_is_billed_once(
    nats_server: NatsServer, bus: Bus, tmp_path: Path
) -> None:
    """The relay metered a's resends too (1,400,000 bytes); a said it sent 1,390,000, last
    just before the kill. The restarted relay publishes that total, and the bill is a's."""
    journal = tmp_path / "usage.journal"
    killed_run(
        nats_server,
        journal,
        """
        meter.add("acme.g", 1, "a", 1_400_000)  # one read's worth, for short
        meter.report("acme.g", 1, "a", 1_000_000)
        await meter.flush()
        meter.report("acme.g", 1, "a", 1_390_000)  # told, then the kill: no record holds it
        """,
    )
    assert await billed(bus) == 1_000_000
    await restarted(bus, journal)
    assert await billed(bus) == 1_390_000


async def test_a_journal_of_the_first_layout_is_upgraded_with_what_it_had_not_published(
    bus: Bus, tmp_path: Path
) -> None:
    path = tmp_path / "usage.journal"
    raw = bytearray(HEADER.size + 4 * V1_SLOT_SIZE)
    HEADER.pack_into(raw, 0, V1_MAGIC, b"0123456789abcdef", 4)
    at = HEADER.size + 2 * V1_SLOT_SIZE
    key = b"acme.g\x003\x00a"
    SLOT_HEAD.pack_into(raw, at, 1, len(key))
    raw[at + SLOT_HEAD.size : at + SLOT_HEAD.size + len(key)] = key
    # 9,000 metered, 1,000 published; record 4 (3,000 bytes) prepared and not acknowledged
    V1_NUMBERS.pack_into(raw, at + V1_NUMBERS_AT, 9000, 1000, 4, 3000, 0.0)
    path.write_bytes(raw)
    await restarted(bus, path)
    assert await billed(bus) == 8000
    journal = Journal(path)  # upgraded in place, under the same id
    assert journal.id == "0123456789abcdef"
    slot = journal.slots[("acme.g", 3, "a")]
    assert (slot.counted, slot.published, slot.pending) == (9000, 9000, False)
    journal.close()
