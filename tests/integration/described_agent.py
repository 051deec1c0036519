"""A real `nodus agent` with no fleet file (O1: it describes its own machine), run until it
registers: what it registered, what it printed, how it exited."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from libs.bus import Bus
from libs.bus.auth import AGENT
from libs.bus.server import NatsServer
from libs.contracts import names
from libs.contracts.fleet import NodeRecord

REPO = Path(__file__).resolve().parents[2]


async def _registered(url: str, node: str) -> NodeRecord:
    bus = await Bus.open(url, name="test", buckets=[names.BUCKET_NODES])
    try:
        nodes = bus.bucket(names.BUCKET_NODES, NodeRecord)
        for _ in range(200):
            found = await nodes.get(node)
            if found is not None:
                return found.value
            await asyncio.sleep(0.05)
        raise AssertionError(f"{node} never registered")
    finally:
        await bus.close()


def run_described_agent(
    nats_server: NatsServer, node: str, machine_file: Path, state: Path, env: dict[str, str]
) -> tuple[NodeRecord, str, int]:
    """`nodus agent --node NODE --region r --provider p` on its own bus user (confined to its
    node, S1), stopped once registered: (its record, its output, its exit code)."""
    agent = subprocess.Popen(
        [
            *(sys.executable, "-m", "app", "agent", "--node", node),
            *("--region", "r", "--provider", "p", "--machine-file", str(machine_file)),
            *("--nats", nats_server.url),
            *("--credentials", nats_server.user(f"agent-{node}", AGENT, node)),
            *("--no-nodus0", "--no-port-rules", "--socks-listen", "127.0.0.1:0"),
            *("--state-dir", str(state)),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        record = asyncio.run(_registered(nats_server.url, node))
    finally:
        agent.terminate()
        out, _ = agent.communicate(timeout=20)
    return record, out, agent.returncode
