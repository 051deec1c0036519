"""Who may do what on the bus (S1): one NKey user per process, and the permissions the NATS
server enforces for each.

Sans-I/O: identities, permissions and the server's `authorization` block as data; writing
the files is `libs.bus.credentials`. An agent is confined to its own node: the keys it may
write or read name it at a fixed token, so a static server configuration scopes it (NATS
matches permissions token by token). Keys are `org.name.epoch...`; `*.*.*` is a gang epoch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import nkeys

from libs.contracts import names

# The roles a process can have. The services (placer, runner, remediator, and a monitor that
# reads many machines, as the lab's does) and the operator's CLI work across every gang and
# node, so they hold the Nodus subjects whole. A machine's own monitor is confined to its
# machine, as its agent is: both run on the GPU machine, beside users' workloads.
AGENT = "agent"
MONITOR = "monitor"
RELAY = "relay"
DETECTOR = "detector"  # an external fault detector: asks for repairs as itself (R8)
SERVICE = "service"
OPERATOR = "operator"
ROLES = (AGENT, MONITOR, RELAY, DETECTOR, SERVICE, OPERATOR)
# Identities that carry a node, relay or detector name.
NAMED_ROLES = (AGENT, MONITOR, RELAY, DETECTOR)

# Everything Nodus itself uses: what a service may publish and subscribe to.
NODUS_SUBJECTS = [
    names.SUBJECTS,
    "$JS.API.>",
    "$KV.>",
    "$JS.FC.>",
    "$JS.ACK.>",
    "$SRV.>",
    "_INBOX.>",
]

# How long a process waits for the server to say who it is: a bus whose users predate the
# question (no `$SYS.REQ.USER.INFO` in their permissions) does not answer it.
WHO_AM_I_WAIT = 1.0

_SUBJECT_TOKEN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

# A watch's consumer is named (libs.bus.kv), so its filter is part of the API subject.
_CONSUMER_NAME = "*"


@dataclass(frozen=True, slots=True)
class Identity:
    """One process's NKey user: `name` says who (agent-<node>, relay-<name>, placer, ...)."""

    name: str
    role: str
    seed: str  # SU...: the secret; written 0600 to the process's own file
    public_key: str  # U...: what the server knows
    node: str | None = None  # an agent's node; a relay's name


def agent_inbox(node: str) -> str:
    """The inbox prefix an agent connects with: replies come to its own inbox, since it may
    not subscribe to `_INBOX.>` (where every other client's replies are)."""
    return f"_INBOX.{node}"


def monitor_inbox(node: str) -> str:
    """The inbox prefix a machine's monitor connects with: no node's name starts with '_', so
    no agent's inbox is under it."""
    return f"_INBOX._monitor.{node}"


def new_identity(name: str, role: str, node: str | None = None) -> Identity:
    if role not in ROLES:
        raise ValueError(f"unknown bus role {role!r}; one of {', '.join(ROLES)}")
    if role in NAMED_ROLES and not (node and _SUBJECT_TOKEN.match(node)):
        raise ValueError(
            f"a {role} identity names its node, relay or detector: lower-case letters, digits "
            f"and '-' (a subject token), not {node!r}"
        )
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key
    return Identity(name, role, seed.decode(), public.decode(), node)


def public_key_of(seed: str) -> str:
    """The user a seed signs for; a clear ValueError for anything that is not a user seed."""
    try:
        pair = nkeys.from_seed(bytearray(seed.strip().encode()))
        public: bytes = pair.public_key
    except Exception as error:  # nkeys raises its own and binascii errors
        raise ValueError(f"not an NKey seed: {error!r}") from None
    if not public.startswith(b"U"):
        raise ValueError("not a user NKey seed (it must start with SU)")
    return public.decode()


@dataclass(frozen=True, slots=True)
class Keys:
    """What one process may do to one bucket, as key patterns (NATS wildcards)."""

    bucket: str
    write: tuple[str, ...] = ()
    read: tuple[str, ...] = ()  # get one key, and watch keys matching
    # May ask the bucket's stream about itself. Its answer may list every key's name (other
    # gangs', other nodes'), so a user confined to its keys may not: it binds the bucket as
    # it is (`Bus.open(confined=True)`) and reads the last of its keys directly instead.
    open: bool = False

    def subjects(self) -> list[str]:
        b, stream = self.bucket, f"KV_{self.bucket}"
        out = [f"$JS.API.STREAM.INFO.{stream}"] if self.open else []
        out += [f"$KV.{b}.{key}" for key in self.write]
        for key in self.read:
            out += [
                f"$JS.API.DIRECT.GET.{stream}.$KV.{b}.{key}",
                f"$JS.API.CONSUMER.CREATE.{stream}.{_CONSUMER_NAME}.$KV.{b}.{key}",
            ]
        if self.read:
            out += [f"$JS.API.CONSUMER.INFO.{stream}.*", f"$JS.FC.{stream}.>"]
        return out


def agent_keys(node: str) -> list[Keys]:
    """An agent's own records, and what is addressed to it; nothing of other nodes or gangs."""
    epoch_of_gang = "*.*.*"  # org.name.epoch: any gang epoch, the node's token decides
    return [
        Keys(names.BUCKET_NODES, write=(node,), read=(node,)),
        Keys(names.BUCKET_HEALTH, write=(node,), read=(node,)),
        Keys(names.BUCKET_JOINKEYS, read=(f"{node}.>",)),
        Keys(names.BUCKET_REDEEMED, write=(f"{node}.*",), read=(f"{node}.*",)),
        Keys(names.BUCKET_MEMBERS, write=(f"{epoch_of_gang}.{node}",)),
        # A member's record for each peer: written under <to>.<from>, read under <me>.*
        Keys(
            names.BUCKET_PEERS,
            write=(f"{epoch_of_gang}.*.{node}",),
            read=(f"{epoch_of_gang}.{node}.*",),
        ),
        # ICE offers <from>.<to>: its own, and those made to it
        Keys(
            names.BUCKET_ICE,
            write=(f"{epoch_of_gang}.{node}.*",),
            read=(f"{epoch_of_gang}.*.{node}",),
        ),
        Keys(names.BUCKET_PATHS, write=(f"{epoch_of_gang}.{node}",)),
        # Its ranks' records: read back so a launch asked again starts nothing more
        Keys(
            names.BUCKET_RANKS,
            write=(f"{epoch_of_gang}.*.{node}",),
            read=(f"{epoch_of_gang}.*.{node}",),
        ),
        Keys(names.BUCKET_RELAYS, read=(">",)),  # addresses and regions: public
    ]


# What an agent opens at start: the buckets its bus user may use.
AGENT_BUCKETS = [keys.bucket for keys in agent_keys("node")]


def agent_permissions(node: str) -> dict[str, Any]:
    publish = [s for keys in agent_keys(node) for s in keys.subjects()]
    subscribe = [f"{agent_inbox(node)}.>", names.node_requests(node)]
    return _answering(publish, subscribe, "nodus-agent")


def _answering(publish: list[str], subscribe: list[str], service: str) -> dict[str, Any]:
    """The permissions of a confined user that answers requests as `service` (NATS micro
    discovery too: $SRV.PING, $SRV.INFO.<service>, ..., answered as replies)."""
    discovery = ["$SRV.*", f"$SRV.*.{service}", f"$SRV.*.{service}.*"]
    return {
        "publish": {"allow": publish},
        "subscribe": {"allow": [*subscribe, *discovery]},
        "allow_responses": True,
    }


def monitor_keys(node: str) -> list[Keys]:
    """A machine's monitor: its node's signals, and its node's heartbeats (boot id, NotReady)."""
    return [
        Keys(names.BUCKET_SIGNALS, write=(names.signal_key(node, "*"),)),
        Keys(names.BUCKET_HEALTH, read=(node,)),
    ]


def monitor_permissions(node: str) -> dict[str, Any]:
    """It reports what it finds on its machine, asks its machine's agent whether it answers,
    and runs its detectors when the remediator asks (R15); nothing of other nodes or gangs."""
    publish = [s for keys in monitor_keys(node) for s in keys.subjects()]
    publish += [
        names.node_request(node, names.AgentVerb.INFO),
        "$SYS.REQ.USER.INFO",  # whose monitor it is: one given another's seed says so at start
    ]
    subscribe = [f"{monitor_inbox(node)}.>", names.node_request(node, names.AgentVerb.DIAGNOSE)]
    return _answering(publish, subscribe, "nodus-monitor")


def relay_permissions(relay: str) -> dict[str, Any]:
    """A relay reads every gang's members and epochs (it admits them), writes its own record
    and its usage."""
    keys = [
        Keys(names.BUCKET_MEMBERS, read=(">",), open=True),
        Keys(names.BUCKET_EPOCHS, read=(">",), open=True),
        Keys(names.BUCKET_RELAYS, write=(relay,), read=(">",), open=True),
    ]
    publish = [s for k in keys for s in k.subjects()]
    publish += [
        f"$JS.API.STREAM.INFO.{names.USAGE_STREAM}",
        f"$JS.API.STREAM.INFO.{names.EVENTS_STREAM}",
        names.relay_usage(relay),
        "$SYS.REQ.USER.INFO",  # which relay it is: one given another's seed says so at start
    ]
    return {
        "publish": {"allow": publish},
        "subscribe": {"allow": ["_INBOX.>"]},
        "allow_responses": True,
    }


# Detectors' replies come here (their CLI does not know its name before the server says it);
# no node's name starts with '_', so no agent's inbox is under it.
DETECTOR_INBOX = "_INBOX._detector"


def _publish_rules(user_info: dict[str, Any]) -> dict[str, Any]:
    """The publish permissions in the server's `$SYS.REQ.USER.INFO` answer ({} unconfined)."""
    return (user_info.get("permissions") or {}).get("publish") or {}


def _named_after(user_info: dict[str, Any], prefix: str) -> str | None:
    """The token after `prefix` in the first subject the user may publish that starts so."""
    for subject in _publish_rules(user_info).get("allow") or []:
        if isinstance(subject, str) and subject.startswith(prefix):
            return subject[len(prefix) :].split(".", 1)[0]
    return None


def detector_of(user_info: dict[str, Any]) -> str | None:
    """The detector a bus user is, from the server's `$SYS.REQ.USER.INFO` answer: the name its
    permissions let it speak as. None for a user the server does not confine (an operator)."""
    return _named_after(user_info, names.API_NODE_LABEL + ".")


def relay_of(user_info: dict[str, Any]) -> str | None:
    """The relay a bus user is, from the server's `$SYS.REQ.USER.INFO` answer: the name whose
    usage it may publish. None for a user the server does not confine (an operator) or one
    that is no relay."""
    return _named_after(user_info, names.USAGE_PREFIX)


def may_publish(user_info: dict[str, Any], subject: str) -> bool:
    """Whether the server lets this user publish to `subject`, matched as NATS matches
    permissions: token by token, `*` one token, `>` the rest. An unconfined user may."""
    if not user_info.get("permissions"):
        return True
    publish = _publish_rules(user_info)
    allow, deny = publish.get("allow"), publish.get("deny") or []
    allowed = allow is None or any(_covers(pattern, subject) for pattern in allow)
    return allowed and not any(_covers(pattern, subject) for pattern in deny)


def _covers(pattern: object, subject: str) -> bool:
    if not isinstance(pattern, str):
        return False
    wanted, tokens = pattern.split("."), subject.split(".")
    for index, token in enumerate(wanted):
        if token == ">":
            return len(tokens) > index
        if index >= len(tokens) or token not in ("*", tokens[index]):
            return False
    return len(wanted) == len(tokens)


def detector_permissions(detector: str) -> dict[str, Any]:
    """An external detector speaks only as itself: the subjects of its repair requests and node
    labels end in its name, which is how the remediator knows who asked (R8). It reads nothing
    of the bus; its replies come to an inbox, and the server tells it who it is."""
    return {
        "publish": {
            "allow": [
                names.caller_subject(names.API_REMEDIATION_EXTERNAL, detector),
                names.caller_subject(names.API_NODE_LABEL, detector),
                "$SYS.REQ.USER.INFO",
            ]
        },
        "subscribe": {"allow": [f"{DETECTOR_INBOX}.>"]},
    }


def permissions(identity: Identity) -> dict[str, Any] | None:
    """None: the operator's CLI, which may do anything on this bus."""
    if identity.role == AGENT:
        assert identity.node
        return agent_permissions(identity.node)
    if identity.role == MONITOR:
        assert identity.node
        return monitor_permissions(identity.node)
    if identity.role == RELAY:
        assert identity.node
        return relay_permissions(identity.node)
    if identity.role == DETECTOR:
        assert identity.node
        return detector_permissions(identity.node)
    if identity.role == SERVICE:
        # And who it is: a machine's monitor run on a service's user asks at start.
        publish = [*NODUS_SUBJECTS, "$SYS.REQ.USER.INFO"]
        return {"publish": {"allow": publish}, "subscribe": {"allow": NODUS_SUBJECTS}}
    return None


def authorization(identities: list[Identity]) -> dict[str, Any]:
    """The server's `authorization` block: every identity's NKey and permissions. A client
    without a known key is refused at connect."""
    users = []
    for identity in identities:
        user: dict[str, Any] = {"nkey": identity.public_key}
        allowed = permissions(identity)
        if allowed is not None:
            user["permissions"] = allowed
        users.append(user)
    return {"users": users, "timeout": 2}
