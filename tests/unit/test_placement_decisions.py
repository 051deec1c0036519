"""The placement bench's decisions do not change when placement is made faster: for its fixed
seed (10,000 machines, 1,000 jobs, placed one after another on what is left free), the path
and the machines of every job are the ones recorded in tests/fixtures/placements-seed-1.json.

A change that means to place differently records the new decisions with
`NODUS_RECORD_PLACEMENTS=1 pytest tests/unit/test_placement_decisions.py` and says why."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from services.placer.candidates import Candidates
from services.placer.config import load_config
from services.placer.planner import Exclusions, Planner
from tests.bench.placement_workload import build_fleet, build_jobs

RECORDED = Path(__file__).parents[1] / "fixtures" / "placements-seed-1.json"


def decisions(seed: int, machines: int, jobs: int) -> list[list[object]]:
    rng = random.Random(seed)
    fleet = build_fleet(machines, rng)
    applied = build_jobs(jobs, rng)
    config = load_config()
    config.distributed_access = ["*"]
    planner = Planner(config)
    free = Candidates(fleet)
    made: list[list[object]] = []
    for job in applied:
        plan, _ = planner.plan(job, free, Exclusions())
        if plan is None:
            made.append([job.key, None, []])
            continue
        made.append([job.key, plan.path.value, plan.nodes])
        for node in plan.nodes:
            free.remove(node)
    return made


def test_the_bench_fleet_is_placed_as_recorded() -> None:
    made = decisions(1, 10_000, 1_000)
    if os.environ.get("NODUS_RECORD_PLACEMENTS"):
        RECORDED.write_text("[\n" + ",\n".join(json.dumps(one) for one in made) + "\n]\n")
    recorded = json.loads(RECORDED.read_text())
    changed = [(r, m) for r, m in zip(recorded, made, strict=True) if r != m]
    assert not changed, f"{len(changed)} of {len(made)} decisions changed, first: {changed[:3]}"
