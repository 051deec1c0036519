"""Who approves a repair (R5, R8, R9), without I/O.

Default: a person approves every repair. Automatic mode runs without a person only the actions
on its checklist of trusted actions. Consent per Xid code overrides both ways (e.g. Reboot for
Xid 119 and 95 approved in advance, Migrate always by a person). Nodes listed for approval
always wait for a person. Delete is always a person's decision."""

from __future__ import annotations

from dataclasses import dataclass

from libs.contracts.remediation import Action, Policy

DEFAULT_KEY = "default"


def policy_key(cluster: str | None) -> str:
    return f"cluster.{cluster}" if cluster else DEFAULT_KEY


def effective(policies: dict[str, Policy], cluster: str) -> Policy:
    """The cluster's own policy, else the default, else approve-before-repair."""
    return policies.get(policy_key(cluster)) or policies.get(DEFAULT_KEY) or Policy()


@dataclass(frozen=True, slots=True)
class Approval:
    automatic: bool
    rule: str


def approval(policy: Policy, node: str, action: Action, xid: int | None) -> Approval:
    if action is Action.DELETE:
        return Approval(False, "delete (RMA) is always a person's decision (R9)")
    if node in policy.approval_required_nodes:
        return Approval(False, f"node {node} is listed for approval in the policy")
    consent = policy.xid_consent.get(xid) if xid is not None else None
    if consent is not None:
        if action in consent.approve:
            return Approval(False, f"consent for Xid {xid}: {action.value} needs a person")
        if action in consent.auto:
            return Approval(True, f"consent for Xid {xid}: {action.value} approved in advance")
    if policy.mode == "Automatic" and action in policy.trusted_actions:
        return Approval(True, f"automatic policy: {action.value} is a trusted action")
    if policy.mode == "Automatic":
        return Approval(False, f"automatic policy: {action.value} is not a trusted action")
    return Approval(False, "policy ApproveBeforeRepair: every repair waits for a person")
