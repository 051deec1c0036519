"""The Python client: apply, get, watch, delete, env. The CLI is a thin layer on top."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

from libs.bus import Bus, Versioned
from libs.bus.connection import default_credentials
from libs.contracts import names
from libs.contracts.api import ApplyReply, ApplyRequest, DeleteReply, DeleteRequest
from libs.contracts.base import convert, decode, now
from libs.contracts.epochs import Epoch, Lease, Ranktable
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import NodeHealth, NodeRecord
from libs.contracts.jobs import Job, JobEvent
from libs.contracts.lifecycle import LogsReply, LogsRequest, ProbeRecord
from libs.contracts.relay import RelayLoad, RelayRecord, UsageRecord
from libs.jobs.billing import billed_bytes
from libs.jobs.relays import relay_loads

# How long an apply is asked again while no placer answers it (one restarting, the other
# reconnecting), or a placer took it and died before answering; and each try's wait, well
# above a placer's answer under a thousand applies at once (under 3 s).
APPLY_PATIENCE_SECONDS = 20.0
APPLY_TRY_SECONDS = 5.0

T = TypeVar("T")

CLIENT_BUCKETS = [
    names.BUCKET_JOBS,
    names.BUCKET_NODES,
    names.BUCKET_HEALTH,
    names.BUCKET_LEASES,
    names.BUCKET_EPOCHS,
    names.BUCKET_RANKTABLES,
    names.BUCKET_PROBES,
    names.BUCKET_QUALIFICATIONS,
]


def error_field(error: msgspec.ValidationError) -> str | None:
    """The JSON path msgspec names at the end of its message, without the backticks."""
    found = (
        re.findall(r"`([^`]*)`", str(error).rsplit(" - at ", 1)[-1])
        if " - at " in str(error)
        else []
    )
    return found[-1] if found else None


def parse_job(text: str, source: str = "job") -> Job:
    """YAML to a Job; every refusal names the field (S3). Status in the file is ignored."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise NodusError(ErrorCode.INVALID, f"{source}: not valid YAML: {error}") from None
    except RecursionError:
        raise NodusError(ErrorCode.INVALID, f"{source}: YAML nested too deeply") from None
    if not isinstance(raw, dict):
        raise NodusError(
            ErrorCode.INVALID, f"{source}: expected a Job mapping, got {type(raw).__name__}"
        )
    raw.pop("status", None)
    try:
        return convert(raw, Job)
    except msgspec.ValidationError as error:
        raise NodusError(
            ErrorCode.INVALID, f"{source}: {error}", field=error_field(error)
        ) from None


def load_jobs(path: Path) -> list[Job]:
    """One or more Jobs from a file (YAML documents separated by ---)."""
    try:
        text = path.read_text()
    except OSError as error:
        raise NodusError(ErrorCode.INVALID, f"{path}: {error.strerror}") from None
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as error:
        raise NodusError(ErrorCode.INVALID, f"{path}: not valid YAML: {error}") from None
    except RecursionError:
        raise NodusError(ErrorCode.INVALID, f"{path}: YAML nested too deeply") from None
    return [parse_job(yaml.safe_dump(d), str(path)) for d in documents]


class Client:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.jobs = bus.bucket(names.BUCKET_JOBS, Job)
        self.nodes = bus.bucket(names.BUCKET_NODES, NodeRecord)
        self.health = bus.bucket(names.BUCKET_HEALTH, NodeHealth)
        self.epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
        self.ranktables = bus.bucket(names.BUCKET_RANKTABLES, Ranktable)

    @classmethod
    async def connect(cls, url: str | None = None, credentials: str | None = None) -> Client:
        return cls(
            await Bus.open(
                url,
                name="nodus-client",
                credentials=credentials or client_credentials(),
                buckets=CLIENT_BUCKETS,
            )
        )

    async def close(self) -> None:
        await self.bus.close()

    async def apply(
        self, job: Job, timeout: float = APPLY_TRY_SECONDS, patience: float = APPLY_PATIENCE_SECONDS
    ) -> ApplyReply:
        """Admit `job`, each try waiting up to `timeout` for the answer. Asked again while
        `patience` seconds have not passed when no placer answers (a replica restarting while
        the other reconnects after losing its server) or the answer does not come (chaos seed
        552850: the placer that took the request was killed before it answered). An apply is
        safe to repeat: the same spec again is answered "unchanged"."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        while True:
            left = max(deadline - loop.time(), 0.0)
            try:
                return await self.bus.request(
                    names.API_JOBS_APPLY,
                    ApplyRequest(job=job),
                    ApplyReply,
                    timeout,
                    unanswered_seconds=left,
                )
            except NodusError as error:
                if error.code is not ErrorCode.TIMEOUT or loop.time() >= deadline:
                    raise

    async def delete(self, name: str, org: str | None = None) -> DeleteReply:
        job = await self.get_job(name, org)
        return await self.bus.request(
            names.API_JOBS_DELETE,
            DeleteRequest(org=job.metadata.org, name=job.metadata.name),
            DeleteReply,
        )

    async def list_jobs(self) -> list[Job]:
        jobs = await self.jobs.snapshot()
        return sorted(
            (item.value for item in jobs.values()), key=lambda j: (j.metadata.org, j.metadata.name)
        )

    async def list_relays(self) -> list[RelayLoad]:
        """Every relay that announced itself, with the members homed on it and the gangs that
        name it."""
        await self.bus.ensure_bucket(names.BUCKET_RELAYS)  # here, not in every command's start
        records = await self.bus.bucket(names.BUCKET_RELAYS, RelayRecord).snapshot()
        jobs = await self.jobs.snapshot()
        return relay_loads(
            (item.value for item in records.values()), (item.value for item in jobs.values()), now()
        )

    async def get_job(self, name: str, org: str | None = None) -> Job:
        """By name; `org` is needed only when two orgs use the name."""
        if org:
            found = await self.jobs.get(f"{org}.{name}")
            if found is None:
                raise NodusError(ErrorCode.NOT_FOUND, f"job {name} (org {org}) not found")
            return found.value
        matches = await self.jobs.snapshot(f"*.{name}")
        if not matches:
            raise NodusError(ErrorCode.NOT_FOUND, f"job {name} not found")
        if len(matches) > 1:
            orgs = ", ".join(sorted(m.value.metadata.org for m in matches.values()))
            raise NodusError(
                ErrorCode.INVALID, f"job {name} exists in several orgs ({orgs}); pass --org"
            )
        return next(iter(matches.values())).value

    async def watch_job(self, name: str, org: str | None = None) -> AsyncIterator[Job]:
        job = await self.get_job(name, org)
        async for change in self.jobs.watch(job.key):
            if change.value is None:
                return
            yield change.value

    async def epoch(self, job: Job) -> Epoch:
        if not job.status.epoch:
            raise NodusError(
                ErrorCode.NOT_FOUND,
                f"job {job.metadata.name} has no epoch yet (phase {job.status.phase})",
            )
        found = await self.epochs.get(names.epoch_key(job.key, job.status.epoch))
        if found is None:
            raise NodusError(
                ErrorCode.NOT_FOUND, f"epoch {job.status.epoch} of {job.key} not found"
            )
        return found.value

    async def rank_env(self, name: str, rank: int, org: str | None = None) -> dict[str, str]:
        job = await self.get_job(name, org)
        epoch = await self.epoch(job)
        for member in epoch.members:
            if member.rank == rank:
                return member.env
        raise NodusError(
            ErrorCode.NOT_FOUND, f"job {name} has ranks 0..{len(epoch.members) - 1}, not {rank}"
        )

    async def logs(
        self, name: str, rank: int, offset: int = 0, org: str | None = None
    ) -> LogsReply:
        """A rank's output, from the agent that runs it."""
        job = await self.get_job(name, org)
        epoch = await self.epoch(job)
        member = next((m for m in epoch.members if m.rank == rank), None)
        if member is None:
            raise NodusError(
                ErrorCode.NOT_FOUND, f"job {name} has ranks 0..{len(epoch.members) - 1}, not {rank}"
            )
        return await self.bus.request(
            names.node_request(member.node, names.AgentVerb.LOGS),
            LogsRequest(gang=job.key, epoch=epoch.epoch, rank=rank, offset=offset),
            LogsReply,
        )

    async def probe(self, job: Job) -> ProbeRecord | None:
        found = await self.bus.bucket(names.BUCKET_PROBES, ProbeRecord).get(
            names.epoch_key(job.key, job.status.epoch)
        )
        return found.value if found else None

    async def list_nodes(self) -> list[tuple[NodeRecord, NodeHealth | None, str | None]]:
        """Every registered node, its last heartbeat, and the gang holding it."""
        records = await self.nodes.snapshot()
        health = await self.health.snapshot()
        leases = await self.bus.bucket(names.BUCKET_LEASES, Lease).snapshot()
        result = []
        for key in sorted(records):
            lease = leases.get(key)
            beat = health.get(key)
            result.append(
                (
                    records[key].value,
                    beat.value if beat else None,
                    lease.value.gang if lease else None,
                )
            )
        return result

    async def events(self, job: Job, limit: int = 50) -> list[JobEvent]:
        """The job's recent events from the events stream, oldest first."""
        events = await self._replay(names.EVENTS_STREAM, names.job_event(job.key, ">"), JobEvent)
        return events[-limit:]

    async def usage(self) -> dict[str, int]:
        """Relay bytes billed per gang (`org.name`), from the usage stream (billed_bytes:
        what members' programs sent, counted once)."""
        return billed_bytes(await self.usage_records())

    async def usage_records(self) -> list[UsageRecord]:
        """Every usage record the relays published, oldest first."""
        return await self._replay(names.USAGE_STREAM, names.USAGE_SUBJECTS[0], UsageRecord)

    async def _replay(self, stream: str, subject: str, kind: type[T]) -> list[T]:
        """Every record `stream` holds on `subject`, oldest first; records that do not
        decode are skipped."""
        records: list[T] = []
        for msg in await self.bus.replay(stream, subject):
            try:
                records.append(decode(msg.data, kind))
            except msgspec.ValidationError:
                continue
        return records

    async def global_ranktable(self) -> dict[str, Versioned[Ranktable]]:
        return await self.ranktables.snapshot()


def job_document(job: Job) -> dict[str, Any]:
    """The job as kubectl-shaped builtins: apiVersion and kind first."""
    data: dict[str, Any] = msgspec.to_builtins(job)
    ordered = {"apiVersion": data.pop("apiVersion", "nodus/v1"), "kind": data.pop("kind", "Job")}
    ordered.update(data)
    return ordered


# Where `nodus up` (default state dir) keeps the operator's seed: the CLI run beside it
# reaches that bus without an export.
LOCAL_OPERATOR = Path(".nodus") / "nats" / "users" / "operator.nk"


def client_credentials() -> str | None:
    """The CLI's bus user: NODUS_CREDENTIALS, else the local `nodus up`'s operator."""
    found = default_credentials()
    if found:
        return found
    return str(LOCAL_OPERATOR) if LOCAL_OPERATOR.is_file() else None
