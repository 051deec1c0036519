"""A job whose conclusion the bus could not answer (a server failing over for longer than a
call's retries) is left to the runner's sweep, which looks again within seconds, and said at
warning level: not a crashed task at error level, which read as a runner bug (chaos seed 1 in
a CI run of session 40). Anything else still fails loudly."""

from __future__ import annotations

import logging
from typing import Any
from unittest.mock import MagicMock

import nats.errors
import pytest

from services.runner.run import GangRun


def gang_run(failure: BaseException) -> GangRun:
    run = GangRun(MagicMock())

    async def conclude_now(gang: str, epoch: int) -> None:
        raise failure

    run._conclude_now = conclude_now  # type: ignore[method-assign]
    return run


async def test_a_bus_that_does_not_answer_leaves_the_conclusion_to_the_sweep(
    caplog: Any,
) -> None:
    with caplog.at_level(logging.WARNING, logger="nodus.runner"):
        await gang_run(nats.errors.TimeoutError())._conclude("acme.train", 3)
    (record,) = [r for r in caplog.records if "not concluded yet" in r.getMessage()]
    assert record.levelno == logging.WARNING and "acme.train epoch 3" in record.getMessage()


async def test_any_other_failure_of_a_conclusion_is_raised() -> None:
    with pytest.raises(ValueError):
        await gang_run(ValueError("a bug"))._conclude("acme.train", 3)
