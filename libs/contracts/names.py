"""Every NATS subject, stream, KV bucket name, agent request verb and default address, in one
place (tests/unit/test_names.py fails when one is spelled elsewhere).

Subjects name the node so NATS permissions can scope each agent to its own node (S1):
`nodus.node.<node>.req.<verb>`.
"""

from __future__ import annotations

from enum import StrEnum

# Default addresses: the bus a process reaches when told nothing (one nats-server on this
# host, NATS's own port), and the SOCKS5 endpoint a Relayed member's programs are sent to.
NATS_PORT = 4222
NATS_URL = f"nats://127.0.0.1:{NATS_PORT}"
SOCKS_ENDPOINT = "127.0.0.1:1080"

# Every subject Nodus publishes on starts with this (the services hold it whole, S1).
SUBJECTS = "nodus.>"

# Request/reply APIs (nats micro services; `$SRV.PING` etc. answer discovery).
API_JOBS_APPLY = "nodus.api.jobs.apply"
API_JOBS_DELETE = "nodus.api.jobs.delete"

# Event stream: job lifecycle events, the audit of what the placer did.
EVENTS_STREAM = "NODUS_EVENTS"
EVENTS_PREFIX = "nodus.evt."
EVENTS_SUBJECTS = [f"{EVENTS_PREFIX}>"]

# KV buckets.
BUCKET_JOBS = "nodus-jobs"  # org.name -> Job
BUCKET_NODES = "nodus-nodes"  # node -> NodeRecord (inventory, version, capabilities)
BUCKET_HEALTH = "nodus-health"  # node -> NodeHealth (heartbeats)
BUCKET_LEASES = "nodus-leases"  # node -> Lease (which gang epoch holds the machine)
BUCKET_ADDRESSES = "nodus-addresses"  # address (dots as '_') -> AddressClaim
BUCKET_EPOCHS = "nodus-epochs"  # org.name.epoch -> Epoch
BUCKET_JOINKEYS = "nodus-joinkeys"  # node.org.name.epoch -> JoinKeyGrant; used.nonce -> node
BUCKET_RANKTABLES = "nodus-ranktables"  # org.name -> Ranktable; the bucket is the global one
BUCKET_REDEEMED = "nodus-redeemed"  # node.nonce -> JoinRedemption: a join key is used once
BUCKET_MEMBERS = "nodus-members"  # org.name.epoch.node -> Member (the node's WireGuard key)
# org.name.epoch.to.from -> Member: the record `from` gives each peer; an agent reads only
# what is addressed to it (S1), so members introduce themselves to each other here.
BUCKET_PEERS = "nodus-peers"
BUCKET_RELAYS = "nodus-relays"  # relay name -> RelayRecord
BUCKET_PROBES = "nodus-probes"  # org.name.epoch -> ProbeRecord
BUCKET_RANKS = "nodus-ranks"  # org.name.epoch.rank.node -> RankStatus
# org.name.epoch.node.peer -> IceOffer: a Direct member's ICE offer to one peer (G11)
BUCKET_ICE = "nodus-ice"
BUCKET_PATHS = "nodus-paths"  # org.name.epoch.node -> MemberPaths (a Direct member's paths)
BUCKET_QUALIFICATIONS = "nodus-qualifications"  # path.type.type -> Qualification (G21)

ALL_BUCKETS = [
    BUCKET_JOBS,
    BUCKET_NODES,
    BUCKET_HEALTH,
    BUCKET_LEASES,
    BUCKET_ADDRESSES,
    BUCKET_EPOCHS,
    BUCKET_JOINKEYS,
    BUCKET_RANKTABLES,
    BUCKET_REDEEMED,
    BUCKET_MEMBERS,
    BUCKET_PEERS,
    BUCKET_RELAYS,
    BUCKET_PROBES,
    BUCKET_RANKS,
    BUCKET_ICE,
    BUCKET_PATHS,
    BUCKET_QUALIFICATIONS,
]

# Usage stream: bytes members sent through relays, de-duplicated by message id (G17).
USAGE_STREAM = "NODUS_USAGE"
USAGE_PREFIX = "nodus.usage."
USAGE_SUBJECTS = [f"{USAGE_PREFIX}>"]


def usage_subject(relay: str, gang: str) -> str:
    return f"{USAGE_PREFIX}{relay}.{gang}"


def relay_usage(relay: str) -> str:
    """Every usage record one relay publishes: what its bus identity may publish (S1)."""
    return f"{USAGE_PREFIX}{relay}.>"


def member_key(gang: str, epoch: int, node: str) -> str:
    return f"{gang}.{epoch}.{node}"


def peer_key(gang: str, epoch: int, to: str, sender: str) -> str:
    return f"{gang}.{epoch}.{to}.{sender}"


def probe_pair_key(gang: str, epoch: int, peer: str) -> str:
    """A probe pair an agent measures towards `peer` (NodeInfoReply.probing)."""
    return f"{gang}.{epoch}.{peer}"


def ice_key(gang: str, epoch: int, node: str, peer: str) -> str:
    """The offer `node` makes `peer` in one epoch: epoch-scoped, so a stale one is never read
    for a new epoch (C2)."""
    return f"{gang}.{epoch}.{node}.{peer}"


class AgentVerb(StrEnum):
    """What an agent answers on `nodus.node.<node>.req.<verb>`."""

    INFO = "info"  # NodeInfoRequest: inventory, version, liveness (the monitor's probe)
    EPOCHS = "epochs"  # JoinedEpochsRequest: the epochs this agent runs
    REBOOT = "reboot"  # RebootRequest: the lab machine's reboot (a remediation)
    HOST_REBOOT = "host-reboot"  # the real host's reboot, in band (R18)
    HEALTH = "health"  # HealthCheckRequest: a remediation's health check
    DIAGNOSE = "diagnose"  # an on-demand diagnostic for revalidation (R15)
    PROBE_SERVE = "probe-serve"  # serve one epoch's probe
    PROBE_PAIR = "probe-pair"  # measure one pair of a probe round
    SHIM_CHECK = "shim-check"  # the shim loads in this machine's image (Relayed)
    LAUNCH = "launch"  # start this node's ranks of an epoch
    LOGS = "logs"  # a rank's output
    STOP = "stop"  # stop this node's ranks of an epoch


def node_request(node: str, verb: AgentVerb) -> str:
    """Requests addressed to one node's agent; nobody answers for a node without an agent."""
    return f"{node_requests(node).removesuffix('>')}{verb.value}"


def node_requests(node: str) -> str:
    """Every request addressed to one node: what its agent may subscribe to (S1)."""
    return f"nodus.node.{node}.req.>"


def job_event(gang: str, kind: str) -> str:
    return f"{EVENTS_PREFIX}job.{gang}.{kind}"


def epoch_key(gang: str, epoch: int) -> str:
    return f"{gang}.{epoch}"


def joinkey_key(node: str, gang: str, epoch: int) -> str:
    return f"{node}.{gang}.{epoch}"


def address_key(address: str) -> str:
    """KV keys allow [-/_=.a-zA-Z0-9]; IPv6 colons become '_'."""
    return address.replace(":", "_")


def redeemed_key(node: str, nonce: str) -> str:
    return f"{node}.{nonce}"


def rank_key(gang: str, epoch: int, rank: int, node: str) -> str:
    """The node comes last, so NATS permissions let an agent write only its own ranks (S1)."""
    return f"{gang}.{epoch}.{rank}.{node}"


# -- Automated node repair (issue 6, R1-R16) ---------------------------------------------------

API_REMEDIATION_APPROVE = "nodus.api.remediation.approve"
API_REMEDIATION_CANCEL = "nodus.api.remediation.cancel"
API_REMEDIATION_REQUEST = "nodus.api.remediation.request"  # a person asks for a repair
# An external detector's request and its node labels (R8): the caller is the last token,
# which the bus's permissions fix to the detector's own name (libs.bus.auth.DETECTOR).
API_REMEDIATION_EXTERNAL = "nodus.api.remediation.external"
API_NODE_LABEL = "nodus.api.nodes.label"
API_REMEDIATION_BREAKER_RESET = "nodus.api.remediation.breaker.reset"

BUCKET_SIGNALS = "nodus-signals"  # node.source -> SignalReport (level-triggered findings)
BUCKET_ALERTS = "nodus-alerts"  # alert id -> Alert
BUCKET_RECOMMENDATIONS = "nodus-recommendations"  # alert id -> Recommendation
BUCKET_REMEDIATIONS = "nodus-remediations"  # remediation id -> Remediation
BUCKET_REMEDIATION_POLICY = "nodus-remediation-policy"  # default | cluster.<c> -> Policy
BUCKET_LADDERS = "nodus-ladders"  # node.cluster.kind.xid -> Ladder
BUCKET_BREAKERS = "nodus-breakers"  # cluster -> Breaker
BUCKET_CORDONS = "nodus-cordons"  # node -> Cordon (the placer skips cordoned nodes)
BUCKET_REPAIR_SLOTS = "nodus-repair-slots"  # node.<n> | pool.<p> | cluster.<c> -> RepairSlots
BUCKET_MACHINES = "nodus-machines"  # node -> MachineState (the local machine provider)
BUCKET_HOSTS = "nodus-hosts"  # host id -> HostRecord (hosts in revalidation, R15)
# op id -> ProviderOp: what a real machine provider carried out; created before it runs (R14)
BUCKET_PROVIDER_OPS = "nodus-provider-ops"
BUCKET_NODE_LABELS = "nodus-node-labels"  # node -> NodeLabels (set through the API, R8)

REMEDIATION_BUCKETS = [
    BUCKET_SIGNALS,
    BUCKET_ALERTS,
    BUCKET_RECOMMENDATIONS,
    BUCKET_REMEDIATIONS,
    BUCKET_REMEDIATION_POLICY,
    BUCKET_LADDERS,
    BUCKET_BREAKERS,
    BUCKET_CORDONS,
    BUCKET_REPAIR_SLOTS,
    BUCKET_MACHINES,
    BUCKET_HOSTS,
    BUCKET_PROVIDER_OPS,
    BUCKET_NODE_LABELS,
]
ALL_BUCKETS += [BUCKET_CORDONS]  # the placer reads cordons
# The runner reads a failed rank's machine: a fault or a repair may explain it (R17).
ALL_BUCKETS += [BUCKET_ALERTS, BUCKET_REMEDIATIONS]


def caller_subject(prefix: str, caller: str) -> str:
    """`prefix.<caller>`: a request whose sender the bus's permissions name."""
    return f"{prefix}.{caller}"


def signal_key(node: str, source: str) -> str:
    """Under the node's own prefix, so NATS permissions can scope a writer to it (S1)."""
    return f"{node}.{source}"


def alert_event(node: str, kind: str) -> str:
    """Alert notifications on the events stream: the same Alert record as the CLI and API."""
    return f"{EVENTS_PREFIX}alert.{node}.{kind}"


def remediation_event(node: str, state: str) -> str:
    return f"{EVENTS_PREFIX}remediation.{node}.{state}"
