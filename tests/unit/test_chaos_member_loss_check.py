"""The chaos run's check that a member silenced past the heartbeat timeout was lost (a later
epoch placed) excuses only a job that ended on its own before the member was due to be lost:
its ranks' exits were reported just before the stop, which a lagging read can hide from the
harness's choice (CI seed 215971). A job that ended later still fails the run."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from libs.contracts.jobs import Job, Phase
from tests.chaos.checks import HEARTBEAT_TIMEOUT_SECONDS, FaultRecord, ended_before_lost
from tests.factories import relayed

STOPPED = 1_796_578_829.0


def ended(seconds_after_stop: float | None, epoch: int = 1) -> Job:
    found = relayed("rl", Phase.SUCCEEDED, [0, 1], 1).value
    finished = (
        None
        if seconds_after_stop is None
        else datetime.fromtimestamp(STOPPED + seconds_after_stop, UTC)
    )
    status = msgspec.structs.replace(found.status, epoch=epoch, finished_time=finished)
    return msgspec.structs.replace(found, status=status)


def silenced(epoch: int = 1) -> FaultRecord:
    return FaultRecord(
        "lose-member", "agent-rl-1", 41.0, 8.0, gang="acme.rl", epoch=epoch, silenced_time=STOPPED
    )


def test_a_job_that_ended_before_the_member_was_due_to_be_lost_owes_no_later_epoch() -> None:
    assert ended_before_lost(ended(-0.05), silenced())
    assert ended_before_lost(ended(HEARTBEAT_TIMEOUT_SECONDS - 0.5), silenced())


def test_a_job_that_ended_after_the_timeout_or_in_another_epoch_still_owes_one() -> None:
    assert not ended_before_lost(ended(HEARTBEAT_TIMEOUT_SECONDS + 0.5), silenced())
    assert not ended_before_lost(ended(1.0, epoch=2), silenced())
    assert not ended_before_lost(ended(None), silenced())
