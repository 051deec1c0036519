"""The placement bench's R14 check after a burst (`one_placement_per_job`) says a job placed
twice, or a machine leased to another epoch, and is quiet about a clean placement."""

from __future__ import annotations

import msgspec

from libs.bus import Bus
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.epochs import Epoch, Lease
from tests.bench.placement_harness import one_placement_per_job
from tests.conftest import StartPlacer, placed
from tests.factories import job, machine, node_record, register


async def test_the_check_passes_one_placement_and_names_a_second(
    bus: Bus, start_placer: StartPlacer
) -> None:
    await register(bus, [node_record(machine(f"m{i}", address=f"10.0.0.{i}")) for i in (1, 2)])
    await start_placer()
    await Client(bus).apply(job("once"))
    await placed(bus, "acme.once")
    assert (await one_placement_per_job(bus, {"acme.once"}))["ok"]

    epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
    first = await epochs.get(names.epoch_key("acme.once", 1))
    assert first is not None
    # A second live epoch of the same job, as two replicas placing it both would leave.
    await epochs.put(names.epoch_key("acme.once", 2), msgspec.structs.replace(first.value, epoch=2))
    found = await one_placement_per_job(bus, {"acme.once"})
    assert not found["ok"] and "live epochs [1, 2]" in found["problems"][0]

    await epochs.delete(names.epoch_key("acme.once", 2))
    node = first.value.members[0].node
    await bus.bucket(names.BUCKET_LEASES, Lease).put(
        node, Lease(gang="acme.other", epoch=1, placer="elsewhere")
    )
    found = await one_placement_per_job(bus, {"acme.once"})
    assert not found["ok"] and f"{node} of acme.once epoch 1 is leased to" in found["problems"][0]
