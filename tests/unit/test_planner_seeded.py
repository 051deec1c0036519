"""The planner's decisions for a seeded workload are pinned: the digest below was taken from
the planner before issue 25 narrowed what it walks (VMs only for Direct, a private network's
machines of the model asked for), so any change of a decision, a shortfall's words or an
admission's refusal shows here."""

from __future__ import annotations

import hashlib
import json
import random

from libs.contracts.errors import NodusError
from services.placer import admission
from services.placer.candidates import Candidates
from services.placer.config import load_config
from services.placer.planner import Exclusions, Planner
from tests.bench.placement_workload import build_fleet, build_jobs

# sha256 of the decisions below, computed with the planner of commit 5b7c6ba.
DECISIONS_BEFORE_ISSUE_25 = "895e8edbdd8b91cc230efcf689490e627afa8e3917dafc925c7102a25f6eb414"


def test_a_seeded_workload_gets_the_decisions_it_got_before() -> None:
    rng = random.Random(11)
    fleet = build_fleet(2000, rng)
    jobs = build_jobs(400, rng)
    config = load_config()
    config.distributed_access = ["*"]
    planner = Planner(config)
    free, registered = Candidates(fleet), Candidates(fleet)
    decisions: list[list[object]] = []
    for job in jobs:
        try:
            admission.check_feasible(job, planner, registered)
        except NodusError as error:
            decisions.append([job.key, "refused", error.code.value])
            continue
        plan, shortfalls = planner.plan(job, free, Exclusions())
        if plan is None:
            decisions.append([job.key, "unschedulable", [s.message for s in shortfalls]])
            continue
        for node in plan.nodes:
            free.remove(node)
        decisions.append([job.key, plan.path.value, plan.nodes])
    paths = {decision[1] for decision in decisions}
    assert {"private", "direct", "relayed", "unschedulable"} <= paths
    digest = hashlib.sha256(json.dumps(decisions).encode()).hexdigest()
    assert digest == DECISIONS_BEFORE_ISSUE_25
