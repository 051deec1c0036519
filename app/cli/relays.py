"""`nodus get relays|relay`: each relay, whether it is live, the members homed on it and the
load the placer balances (their shares of their gangs' caps), so an operator sees gangs
spread over the relays and regions."""

from __future__ import annotations

import argparse
import sys

import msgspec

from app.cli.common import Kind, age, emit, needs_name
from app.output import table
from libs.client.client import Client
from libs.contracts.relay import RelayLoad

RELAY_COLUMNS = [
    "NAME",
    "REGION",
    "ADDRESS",
    "SHARED",
    "STATUS",
    "MEMBERS",
    "CAP MBIT/S",
    "GANGS",
    "VERSION",
]


def _row(relay: RelayLoad) -> list[str]:
    status = "Live" if relay.live else f"Silent {age(relay.heartbeat_time)}"
    return [
        relay.name,
        relay.region,
        relay.address,
        relay.shared_address or "-",  # the host's port where members dial it, if shared
        status,
        str(relay.members),
        str(relay.cap_mbps),
        str(len(relay.gangs)),
        relay.version,
    ]


async def _get_relays(args: argparse.Namespace) -> int:
    one = args.kind == "relay"
    if one and needs_name(args):
        return 2
    client = await Client.connect(args.nats, args.credentials)
    try:
        relays = await client.list_relays()
    finally:
        await client.close()
    if one:
        relays = [r for r in relays if r.name == args.name]
        if not relays:
            print(f"error: relay {args.name} not found", file=sys.stderr)
            return 1
    documents = [msgspec.to_builtins(r) for r in relays]
    if not emit(documents[0] if one else documents, args.output):
        print(table(RELAY_COLUMNS, [_row(r) for r in relays]))
    return 0


GET_KINDS = [Kind("relays", _get_relays), Kind("relay", _get_relays)]
