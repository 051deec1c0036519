"""The CLI's shared pieces as a user sees them: the AGE column, `-o json|yaml|jsonpath=...|wide`
on a sample record, and every subject's commands reachable from `nodus --help`."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
import yaml

from app.cli import build_parser, daemons, jobs, main, repair, system
from app.cli.common import age, emit, render
from libs.client.client import job_document
from libs.contracts.jobs import Job
from tests.factories import job

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0, "0s"),
        (59, "59s"),
        (119, "119s"),
        (120, "2m"),
        (7199, "119m"),
        (7200, "2h"),
        (3 * 86400, "72h"),  # jobs and repairs alike: hours, never days
    ],
)
def test_age_column(seconds: int, shown: str) -> None:
    assert age(NOW - timedelta(seconds=seconds), now=NOW) == shown


def test_age_of_nothing_is_a_dash() -> None:
    assert age(None) == "-"


SAMPLE = {"metadata": {"name": "llama-ft", "org": "acme"}, "status": {"phase": "Running"}}


def test_document_formats() -> None:
    assert json.loads(render(SAMPLE, "json") or "") == SAMPLE
    assert yaml.safe_load(render(SAMPLE, "yaml") or "") == SAMPLE
    assert render(SAMPLE, "jsonpath={.status.phase}") == "Running"
    assert render(SAMPLE, "jsonpath='{.metadata.name}/{.metadata.org}'") == "llama-ft/acme"


@pytest.mark.parametrize("output", ["", "wide"])
def test_no_document_format_means_the_commands_table(
    output: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert render(SAMPLE, output) is None
    assert emit(SAMPLE, output) is False
    assert capsys.readouterr().out == ""


class FakeClient:
    """What `nodus get` reads from the bus, without a bus."""

    jobs = [job("llama-ft", distributed={"members": 2})]

    @classmethod
    async def connect(cls, url: str | None = None, credentials: str | None = None) -> FakeClient:
        return cls()

    async def close(self) -> None:
        pass

    async def list_jobs(self) -> list[Job]:
        return self.jobs

    async def get_job(self, name: str, org: str | None = None) -> Job:
        return self.jobs[0]


@pytest.fixture
def fake_bus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs, "Client", FakeClient)


def _nodus(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(list(args)) == 0
    return capsys.readouterr().out


@pytest.mark.usefixtures("fake_bus")
def test_get_jobs_in_every_format(capsys: pytest.CaptureFixture[str]) -> None:
    document = json.loads(json.dumps(job_document(FakeClient.jobs[0]), default=str))
    assert json.loads(_nodus(capsys, "get", "jobs", "-o", "json")) == [document]
    assert yaml.safe_load(_nodus(capsys, "get", "jobs", "-o", "yaml")) == [document]
    assert _nodus(capsys, "get", "job", "llama-ft", "-o", "jsonpath={.metadata.org}") == "acme\n"
    shown = _nodus(capsys, "get", "jobs").splitlines()
    assert shown[0].split() == jobs.JOB_COLUMNS
    assert shown[1].split() == ["llama-ft", "acme", "Pending", "0", "-", "2", "-", "-", "-"]
    # `-o wide` is the table, for a list and for one job
    assert _nodus(capsys, "get", "jobs", "-o", "wide").splitlines() == shown
    assert _nodus(capsys, "get", "job", "llama-ft", "-o", "wide").splitlines() == shown


def test_every_subjects_commands_are_in_nodus_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = {
        line.split()[0] for line in capsys.readouterr().out.splitlines() if line[:4] == " " * 4
    }
    subjects = [
        jobs.APPLY,
        *jobs.COMMANDS,
        *repair.commands(),
        *system.LOCAL,
        system.SCHEMA,
        *daemons.JOB_DAEMONS,
        *daemons.REPAIR_DAEMONS,
    ]
    assert {command.name for command in subjects} | {"get", "describe"} <= listed


def test_get_and_describe_take_every_subjects_kinds() -> None:
    parser = build_parser()
    for kind in [*jobs.GET_KINDS, *repair.GET_KINDS]:
        assert parser.parse_args(["get", kind.name]).kind == kind.name
    for kind in [*jobs.DESCRIBE_KINDS, *repair.DESCRIBE_KINDS]:
        assert parser.parse_args(["describe", kind.name, "x"]).kind == kind.name
