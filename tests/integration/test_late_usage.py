"""Usage the relays publish after a job's bill was made amends the bill (G17): a relay killed
mid-run publishes what its journal kept once it is back, after the job ended (found by the
chaos run: 12 MB of a Relayed job's bytes went unbilled). On a real bus and its stream."""

from __future__ import annotations

from datetime import timedelta

import msgspec
import pytest

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.bounds import derive
from libs.contracts.epochs import Epoch
from libs.contracts.jobs import Billing, Job, PathClass, Phase
from libs.contracts.relay import UsageRecord
from services.runner.billing import LateUsage
from tests.factories import job

GIB = 2**30


async def _job(bus: Bus, name: str, phase: Phase, billed: int, path: PathClass) -> Job:
    t = now()
    spec = job(name, org="acme")
    finished = phase in (Phase.SUCCEEDED, Phase.FAILED)
    status = msgspec.structs.replace(
        spec.status,
        phase=phase,
        epoch=1,
        finished_time=t if finished else None,
        billing=Billing(run_seconds=3.0, mesh_relay_gi_b=billed / GIB) if finished else None,
    )
    record = msgspec.structs.replace(spec, status=status)
    await bus.bucket(names.BUCKET_JOBS, Job).put(record.key, record)
    epoch = Epoch(
        gang=record.key,
        epoch=1,
        path=path,
        mesh_id="m" * 32,
        verify_key="v",
        members=[],
        bounds=derive(path, 2),
        created_time=t,
        join_keys_expire_time=t + timedelta(minutes=15),
        placed_by="test",
    )
    await bus.bucket(names.BUCKET_EPOCHS, Epoch).put(names.epoch_key(record.key, 1), epoch)
    return record


_seq = iter(range(1, 1_000_000))


async def _usage(bus: Bus, gang: str, relay: str, sent: int) -> None:
    seq = next(_seq)
    t = now()
    record = UsageRecord(
        relay=relay,
        boot="b1",
        gang=gang,
        epoch=1,
        node="c-0",
        seq=seq,
        bytes_sent=sent,
        start_time=t - timedelta(seconds=1),
        end_time=t,
    )
    await bus.publish(
        names.usage_subject(relay, gang), record, dedup_id=f"{relay}:b1:{gang}:1:c-0:{seq}"
    )


async def _billed(bus: Bus, gang: str) -> int:
    stored = await bus.bucket(names.BUCKET_JOBS, Job).get(gang)
    assert stored is not None and stored.value.status.billing is not None
    return round(stored.value.status.billing.mesh_relay_gi_b * GIB)


async def test_a_record_after_the_bill_amends_it_once_and_says_so(bus: Bus) -> None:
    await _job(bus, "done", Phase.SUCCEEDED, 3000, PathClass.RELAYED)
    await _usage(bus, "acme.done", "relay-0", 1000)
    await _usage(bus, "acme.done", "relay-1", 2000)
    late = LateUsage(bus)
    assert await late.sweep() == []  # the bill holds every byte: nothing to amend
    await _usage(bus, "acme.done", "relay-1", 500)  # relay-1's journal, after its restart
    assert await late.sweep() == ["acme.done"]
    assert await _billed(bus, "acme.done") == 3500
    # A second replica sweeping the same records writes nothing more.
    assert await LateUsage(bus).sweep() == []
    assert await late.sweep() == []
    stream = await bus.replay(names.EVENTS_STREAM, "nodus.evt.job.acme.done.billingamended")
    assert len(stream) == 1
    assert b"+500 relay bytes" in stream[0].data


async def test_a_record_that_lands_while_the_job_ends_is_billed_after_the_end(bus: Bus) -> None:
    """The record arrives while the job still runs, but after the end's own count of the
    stream: the sweep follows the gang until its job has ended, then amends."""
    await _job(bus, "ending", Phase.RUNNING, 0, PathClass.RELAYED)
    late = LateUsage(bus)
    await late.sweep()
    await _usage(bus, "acme.ending", "relay-0", 700)
    assert await late.sweep() == []  # still running: its end bills it
    await _job(bus, "ending", Phase.SUCCEEDED, 0, PathClass.RELAYED)  # the end missed it
    assert await late.sweep() == ["acme.ending"]
    assert await _billed(bus, "acme.ending") == 700


async def test_a_direct_jobs_fallback_through_the_relays_stays_unbilled(bus: Bus) -> None:
    await _job(bus, "direct", Phase.SUCCEEDED, 0, PathClass.DIRECT)
    late = LateUsage(bus)
    await late.sweep()
    await _usage(bus, "acme.direct", "relay-0", 900)
    assert await late.sweep() == []
    assert await _billed(bus, "acme.direct") == 0


@pytest.mark.parametrize("killed_in", ["publish", "amend"])
async def test_a_runner_killed_while_amending_leaves_the_bill_and_its_event_to_the_next(
    bus: Bus, monkeypatch: pytest.MonkeyPatch, killed_in: str
) -> None:
    """A runner killed between the amended bill and its `BillingAmended` event lost the event
    for good: the next sweep found the bill right and said nothing (chaos seed 1). Now the
    event is stored first, and the runner started again amends the bill and stores the event
    once."""
    await _job(bus, "cut", Phase.SUCCEEDED, 1000, PathClass.RELAYED)
    await _usage(bus, "acme.cut", "relay-0", 1000)
    late = LateUsage(bus)
    assert await late.sweep() == []
    await _usage(bus, "acme.cut", "relay-1", 250)

    class Killed(Exception):
        pass

    async def killed(*args: object, **kwargs: object) -> None:
        raise Killed

    if killed_in == "publish":  # the event never stored
        monkeypatch.setattr(bus, "publish", killed)
    else:  # the event stored, the bill not amended
        monkeypatch.setattr(late.jobs, "mutate", killed)
    with pytest.raises(Killed):
        await late.sweep()
    monkeypatch.undo()
    again = LateUsage(bus)  # the runner, started again
    assert await again.sweep() == ["acme.cut"]
    assert await _billed(bus, "acme.cut") == 1250
    stream = await bus.replay(names.EVENTS_STREAM, "nodus.evt.job.acme.cut.billingamended")
    assert len(stream) == 1 and b"+250 relay bytes" in stream[0].data
