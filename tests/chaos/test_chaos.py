"""The chaos run (tests/chaos/harness.py) with a fixed seed and one drawn at random (printed;
`CHAOS_SEED=N` replays it); `make chaos` runs the seeds that found defects before and more
random ones."""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.chaos.harness import Chaos

pytestmark = pytest.mark.slow

FIXED = 1
RANDOM = int(os.environ.get("CHAOS_SEED") or random.randrange(1 << 20))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", [FIXED, RANDOM], ids=["fixed", f"random-{RANDOM}"])
async def test_every_job_and_every_byte_survive_any_one_process_dying(
    tmp_path: Path, seed: int
) -> None:
    print(
        f"chaos seed {seed} (replay: CHAOS_SEED={seed} or python -m tests.chaos.harness --seed {seed})"
    )
    chaos = Chaos(tmp_path / "state", seed)
    try:
        report = await chaos.run()
    finally:
        chaos.stop()  # a run cut short (the timeout) leaves nothing behind
    print(json.dumps(asdict(report), indent=1))
    assert report.faults and len({f.kind for f in report.faults}) == len(report.faults)
    paths = {"private", "relayed", "direct"} if report.netns else {"private", "relayed"}
    assert set(report.succeeded) == paths, f"Succeeded per path: {report.succeeded}"
    assert report.violations == [], f"seed {seed}: {report.violations}"
