"""Request and reply bodies of the services' request/reply APIs."""

from __future__ import annotations

from libs.contracts.base import Name, Record
from libs.contracts.fleet import NodeRecord
from libs.contracts.jobs import Job


class ApplyRequest(Record):
    job: Job


class ApplyReply(Record):
    job: Job
    created: bool


class DeleteRequest(Record):
    org: Name
    name: Name


class DeleteReply(Record):
    deleted: bool


class NodeInfoRequest(Record):
    pass


class NodeInfoReply(Record):
    node: NodeRecord
    # Made afresh each time the agent's process starts: an asker whose long request went to an
    # earlier process knows that its request was lost with it.
    agent_instance: str = ""
    # The probe pairs it is measuring now ("gang.epoch.peer"): an asker that sent one it does
    # not hold knows that its request was lost on the way.
    probing: list[str] = []
