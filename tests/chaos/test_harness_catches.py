"""The chaos harness fails a broken build, naming the violation (issue 23): a check that
cannot fail is worse than none. Each is a short run on loopback (no lab) with one daemon from
tests/chaos/broken.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.harness import Chaos

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("defect", "kinds", "faults", "jobs", "violation"),
    [
        ("runner-fails-all", ("agent",), 1, 3, "ended Failed"),
        # Each of the two placers refuses its own third apply: six applies show it.
        ("placer-refuses-every-third", ("agent", "nats"), 2, 6, "refused or timed out"),
        ("relay-never-restarts", ("relay",), 1, 3, "did not come back after its restart"),
    ],
)
async def test_a_broken_build_fails_the_chaos_run_with_its_violation_named(
    tmp_path: Path, defect: str, kinds: tuple[str, ...], faults: int, jobs: int, violation: str
) -> None:
    chaos = Chaos(
        tmp_path / "state",
        1,
        faults=faults,
        netns=False,
        kinds=kinds,
        repair=False,
        defect=defect,
        min_jobs=jobs,
    )
    try:
        report = await chaos.run()
    finally:
        chaos.stop()
    named = [v for v in report.violations if violation in v]
    assert named, f"{defect}: no violation says {violation!r}: {report.violations}"
