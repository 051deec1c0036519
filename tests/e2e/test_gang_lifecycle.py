"""Done-when of the gang's life (issue 5), with real processes (`LocalSystem`: nats-server,
placer, runner, two meshed relays, one agent per fleet machine):

- a 4-member Private gang goes from apply to Succeeded running the example all-reduce, probed
  in 2 rounds (4 pairs, then 2: 6 pairs), `status.gang.probe` filled from measured values, the
  workload's data verified on every rank;
- a Relayed pair (container + VM, transport Auto) goes to Succeeded through the relays, its probe
  path `derp:<region>`, its relay bytes billed as mesh-relay GiB and shown by `nodus usage`;
- the bill counts every relay byte the run sent, and a gang that ended gives its machines back.

(A member lost during the run: test_gang_member_loss.py; the runner killed and restarted:
test_runner_restart.py.)
"""

from __future__ import annotations

import asyncio
import itertools
import re
import sys
import time
from pathlib import Path

import pytest

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import decode
from libs.contracts.epochs import Lease
from libs.contracts.jobs import ConditionType, Phase
from libs.contracts.relay import RelayRecord, UsageRecord
from services.runner.schedule import rounds
from tests.e2e.gang_system import (
    SAMPLE_SECONDS,
    WORKLOAD,
    ended,
    eu_machine,
    local_system,
    rank_reports,
    vm_in_vpc,
    wait_job,
)
from tests.factories import job

pytestmark = pytest.mark.slow


async def test_a_four_member_gang_is_probed_in_two_rounds_and_runs_the_allreduce_to_succeeded(
    tmp_path: Path,
) -> None:
    machines = [vm_in_vpc(f"h100-{c}", 81 + i) for i, c in enumerate("abcd")]
    async with local_system(tmp_path, machines) as (system, client, _):
        await client.apply(
            job(
                "ring4",
                org="acme",
                command=[sys.executable, WORKLOAD],
                env={"ALLREDUCE_MIB": "4", "ALLREDUCE_ITERS": "2"},
                accelerators={"model": "H100"},
                distributed={"members": 4, "network": "Colocated", "transport": "Direct"},
            )
        )
        done = await wait_job(client, system, "ring4", ended, 150, "the end of the run")
        reports = await rank_reports(client, "ring4", 4)
        assert done.status.phase is Phase.SUCCEEDED, (done.status.conditions, reports)
        assert done.status.epoch == 1
        gang = done.status.gang
        assert gang is not None and gang.transport.value == "private"
        assert sorted(m.address for m in gang.members) == [f"127.0.2.{81 + i}" for i in range(4)]

        # status.gang.probe: the slowest pair, from measured values (G11).
        probe = gang.probe
        assert probe is not None
        assert probe.tcp_gbps > 0 and probe.rtt_ms > 0 and probe.path == "direct"
        qualified = done.condition(ConditionType.NETWORK_QUALIFIED)
        assert qualified is not None and qualified.status == "True"
        assert qualified.reason == "ProbePassed" and "6 pairs measured" in qualified.message

        # Every pair measured once, in N/2 = 2 rounds where no member sends two samples nor
        # receives two at once; 3 fresh connections each way per pair (G10.1).
        record = await client.probe(done)
        assert record is not None and record.state == "Qualified"
        assert record.rounds == 2 and len(record.pairs) == 6
        nodes = [m.node for m in sorted(gang.members, key=lambda m: m.rank)]
        assert {frozenset((p.a, p.b)) for p in record.pairs} == {
            frozenset(pair) for pair in itertools.combinations(nodes, 2)
        }
        schedule = rounds(nodes)
        assert [len(r) for r in schedule] == [4, 2]
        assert [[(p.a, p.b) for p in record.pairs[i:j]] for i, j in ((0, 4), (4, 6))] == schedule
        for pair in record.pairs:
            assert pair.ok and pair.path == "direct" and pair.connections == 6, pair
            assert pair.tcp_gbps > 0 and pair.rtt_ms > 0, pair
        assert min(p.tcp_gbps for p in record.pairs) == probe.tcp_gbps
        assert max(p.rtt_ms for p in record.pairs) == probe.rtt_ms
        times = [[p.measured_time for p in record.pairs[i:j]] for i, j in ((0, 4), (4, 6))]
        for earlier, later in itertools.pairwise(times):
            # A round starts when the previous one ended and samples for SAMPLE_SECONDS.
            assert all(a is not None for a in [*earlier, *later])
            gap = min(t for t in later if t) - max(t for t in earlier if t)
            assert gap.total_seconds() >= SAMPLE_SECONDS * 0.9, times

        # The workload's data verified on every rank, over the private addresses.
        for rank, report in enumerate(reports):
            assert report["rank"] == rank and report["world"] == 4, report
            assert report["verified"] is True, report
        billing = done.status.billing
        assert billing is not None and billing.boot_seconds > 0 and billing.run_seconds > 0
        assert billing.mesh_relay_gi_b == 0  # Private adds nothing (G17)


# -- b. a Relayed pair -----------------------------------------------------------------------------


async def test_b_a_relayed_pair_runs_through_the_relays_and_bills_mesh_relay_bytes(
    tmp_path: Path,
) -> None:
    machines = [eu_machine("vast-r", "container", 86), eu_machine("lam-r", "vm", 87)]
    async with local_system(tmp_path, machines) as (system, client, bus):
        await client.apply(
            job(
                "pair",
                org="acme",
                command=[sys.executable, WORKLOAD],
                env={"ALLREDUCE_MIB": "4", "ALLREDUCE_ITERS": "2"},
                accelerators={"model": "L4"},
                distributed={"members": 2, "transport": "Auto"},
            )
        )
        done = await wait_job(client, system, "pair", ended, 150, "the end of the run")
        reports = await rank_reports(client, "pair", 2)
        assert done.status.phase is Phase.SUCCEEDED, (done.status.conditions, reports)
        gang = done.status.gang
        assert gang is not None and gang.transport.value == "relayed"
        relays = await bus.bucket(names.BUCKET_RELAYS, RelayRecord).snapshot()
        regions = {f"derp:{r.value.region}" for r in relays.values()}
        probe = gang.probe
        assert probe is not None and probe.tcp_gbps > 0 and probe.rtt_ms > 0
        assert re.fullmatch(r"derp:[a-z0-9-]+", probe.path) and probe.path in regions, probe
        record = await client.probe(done)
        assert record is not None and record.rounds == 1 and len(record.pairs) == 1
        assert record.pairs[0].connections == 6 and record.pairs[0].path in regions
        for rank, report in enumerate(reports):
            assert report["rank"] == rank and report["world"] == 2 and report["verified"], report

        billing = done.status.billing
        assert billing is not None and billing.boot_seconds > 0 and billing.run_seconds > 0
        assert billing.mesh_relay_gi_b > 0  # the probe and the all-reduce crossed the relays
        usage = await client.usage()
        assert usage.get(done.key, 0) > 0, usage


# -- found while writing the tests above ----------------------------------------------------------


async def usage_records(bus: Bus, gang: str) -> list[UsageRecord]:
    """Every usage record the relays published for `gang` (the NODUS_USAGE stream)."""
    records: list[UsageRecord] = []
    sub = await bus.js.subscribe(f"nodus.usage.*.{gang}", ordered_consumer=True)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except Exception:  # nothing more within the timeout
                break
            records.append(decode(msg.data, UsageRecord))
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return records


async def test_b_the_bill_counts_every_relay_byte_the_run_sent(tmp_path: Path) -> None:
    """G17, issue 5 (6): `status.billing.meshRelayGiB` is the bytes the relays measured. The
    relays publish their counts once a second; every record that began before the job's
    finishedTime holds bytes the run sent, so the bill must cover at least their sum (and
    `nodus usage` must not show more for the job than it was billed for its run).

    Fails today: the runner sums the usage stream the instant the last rank exits, before the
    relays' last flush, so up to the last second of the run's relay bytes is never billed."""
    machines = [eu_machine("vast-s", "container", 88), eu_machine("lam-s", "vm", 89)]
    async with local_system(tmp_path, machines) as (system, client, bus):
        await client.apply(
            job(
                "metered",
                org="acme",
                command=[sys.executable, WORKLOAD],
                env={"ALLREDUCE_MIB": "8", "ALLREDUCE_ITERS": "2"},
                accelerators={"model": "L4"},
                distributed={"members": 2, "transport": "Auto"},
            )
        )
        done = await wait_job(client, system, "metered", ended, 150, "the end of the run")
        assert done.status.phase is Phase.SUCCEEDED, done.status.conditions
        assert done.status.billing is not None and done.status.finished_time is not None
        await asyncio.sleep(3.0)  # three flush intervals: every relay count has landed
        records = await usage_records(bus, done.key)
        finished = done.status.finished_time
        during_run = sum(r.bytes_sent for r in records if r.start_time < finished)
        billed = round(done.status.billing.mesh_relay_gi_b * 2**30)
        late = [
            (r.relay, r.node, r.bytes_sent, r.start_time.isoformat(), r.end_time.isoformat())
            for r in records
            if r.start_time < finished < r.end_time
        ]
        assert billed >= during_run, (
            f"billed {billed} bytes, but the relays metered {during_run} bytes in records that "
            f"began before finishedTime {finished.isoformat()}; {during_run - billed} bytes "
            f"unbilled; records still open at the end: {late}"
        )


async def test_d_a_gang_that_ended_gives_its_machines_back(tmp_path: Path) -> None:
    """An operator expects a Job that has Succeeded to hold no machines: the next Job that
    needs them is placed on them. T2 also keeps only running gangs in the global ranktable.
    (A finished gang used to keep its leases until `nodus delete`; the placer now tears the
    epoch of a finished gang down.)"""
    machines = [vm_in_vpc("h100-p", 95), vm_in_vpc("h100-q", 96)]
    async with local_system(tmp_path, machines) as (system, client, bus):
        spec = {
            "command": [sys.executable, "-c", "pass"],
            "accelerators": {"model": "H100"},
            "distributed": {"members": 2, "network": "Colocated", "transport": "Direct"},
        }
        await client.apply(job("first", org="acme", **spec))
        first = await wait_job(client, system, "first", ended, 60, "the end of the first job")
        assert first.status.phase is Phase.SUCCEEDED, first.status.conditions
        await client.apply(job("second", org="acme", **spec))
        deadline = time.monotonic() + 30
        second = await client.get_job("second")
        while time.monotonic() < deadline and not ended(second):
            await asyncio.sleep(0.2)
            second = await client.get_job("second")
        leases = await bus.bucket(names.BUCKET_LEASES, Lease).snapshot()
        ranktables = await client.global_ranktable()
        held = {node: (v.value.gang, v.value.epoch) for node, v in leases.items()}
        listed = {gang: v.value.phase for gang, v in ranktables.items()}
        ready = second.condition(ConditionType.GANG_READY)
        assert second.status.phase is Phase.SUCCEEDED, (
            f"second job {second.status.phase.value} ({ready.reason if ready else None}: "
            f"{ready.message if ready else None}) 30 s after the first Succeeded; "
            f"leases {held}; global ranktable {listed}"
        )
        assert "acme.first" not in listed, f"a finished gang in the global ranktable: {listed}"
