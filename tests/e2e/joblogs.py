"""A job's rank logs as a user reads them (`nodus logs NAME --rank N`), and the JSON lines the
example workloads print in them."""

from __future__ import annotations

import json
from typing import Any

from libs.client.client import Client


async def rank_log(client: Client, name: str, rank: int) -> str:
    """All of a rank's output so far (what `nodus logs NAME --rank N` prints)."""
    text, offset = "", 0
    while True:
        reply = await client.logs(name, rank, offset)
        if not reply.data:
            return text
        text += reply.data
        offset = reply.offset


def json_lines(text: str) -> list[dict[str, Any]]:
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
    return found
