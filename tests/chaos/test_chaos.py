"""The chaos run with a fixed seed, one of the seeds that once found a defect (a different one
each day), and a random one (printed; `CHAOS_SEED=N` replays it); `make chaos` runs every seed
that found a defect and random ones."""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from dataclasses import asdict
from datetime import date
from pathlib import Path

import pytest

from tests.chaos.harness import KINDS, PAIRS, Chaos

pytestmark = pytest.mark.slow

SEED = 1
# Seeds that found a defect once (make chaos runs them all): one per day, in turn, here.
DEFECT_SEEDS = (7, 276742, 789536)
DEFECT_SEED = DEFECT_SEEDS[date.today().toordinal() % len(DEFECT_SEEDS)]
# A different seed each run, shown in the test's id: `CHAOS_SEED=N pytest ...` replays it.
RANDOM_SEED = int(os.environ.get("CHAOS_SEED") or random.randrange(1 << 20))


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "seed",
    [SEED, DEFECT_SEED, RANDOM_SEED],
    ids=["seed-1", f"seed-{DEFECT_SEED}", f"seed-{RANDOM_SEED}"],
)
async def test_every_job_succeeds_and_every_byte_is_billed_through_the_faults(
    tmp_path: Path, seed: int
) -> None:
    print(f"chaos seed {seed} (replay: CHAOS_SEED={seed})")
    chaos = Chaos(tmp_path / "state", seed)
    try:
        report = await chaos.run()
    finally:
        chaos.stop()  # a run cut short (the timeout) leaves nothing behind
    print(json.dumps(asdict(report), indent=1))
    kinds = Counter(f.kind for f in report.faults)
    assert all(kinds[k] == 2 for k in KINDS) and all(kinds[p] == 1 for p in PAIRS), kinds
    assert sum(report.succeeded.values()) >= 3, "too few jobs succeeded"
    assert report.violations == []
