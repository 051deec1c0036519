"""The slow-receiver bench's members: gang members on `RelayClient`s with the records the
relays authenticate them by, senders streaming WireGuard-shaped transport messages, the
receiving side's flow (sequence numbers: lost, reordered), and the pipe that makes a member
stop reading its relay or read it at a trickle. See tests/bench/slow_receiver.py."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.bounds import derive
from libs.contracts.epochs import Epoch, EpochMember
from libs.contracts.jobs import PathClass
from libs.contracts.relay import Member
from libs.relayproto import x25519_public
from libs.wg.messages import TRANSPORT_HEADER
from services.relay.relay import Relay

if TYPE_CHECKING:
    from libs.relayproto.client import RelayClient

TAG = bytes(16)
PACE_BYTES = 1 << 20  # a sender waits for its relay connection above this much queued
BATCH = 8  # messages queued between two looks at the connection's buffer
PIPE_READ = 256 << 10
TRICKLE_TICK = 0.1  # seconds between a slowed receiver's reads


def relay_client_class() -> type[RelayClient]:
    """The member's client: libs/relayproto/client.py since issue 9, services/agent/
    relayclient.py before it (so the bench runs on both, for figures to compare)."""
    try:
        module = importlib.import_module("libs.relayproto.client")
    except ModuleNotFoundError:
        module = importlib.import_module("services.agent.relayclient")
    found: type[RelayClient] = module.RelayClient
    return found


@dataclass
class Flow:
    """One gang's one-way stream, as its receiver saw it."""

    name: str
    received: int = 0
    messages: int = 0
    last_seq: int = 0
    lost: int = 0  # sequence numbers skipped
    reordered: int = 0  # sequence numbers at or below one already seen
    sent_messages: int = 0
    refused_sends: int = 0  # send_now said the relay connection was down
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (time, bytes so far)
    losses: list[tuple[float, int]] = field(default_factory=list)  # (time, messages skipped)

    def deliver(self, message: bytes) -> None:
        seq = int.from_bytes(message[8:16], "little")
        if seq > self.last_seq + 1:
            self.lost += seq - self.last_seq - 1
            self.losses.append((time.monotonic(), seq - self.last_seq - 1))
        elif seq <= self.last_seq:
            self.reordered += 1
        self.last_seq = max(self.last_seq, seq)
        self.received += len(message)
        self.messages += 1
        self.timeline.append((time.monotonic(), self.received))

    def at(self, when: float) -> int:
        """Bytes delivered by `when` (the timeline is in time order)."""
        lo, hi = 0, len(self.timeline)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.timeline[mid][0] <= when:
                lo = mid + 1
            else:
                hi = mid
        return self.timeline[lo - 1][1] if lo else 0

    def lost_between(self, start: float, end: float) -> int:
        return sum(n for t, n in self.losses if start <= t < end)

    def first_after(self, when: float) -> float | None:
        return next((t for t, _ in self.timeline if t > when), None)

    def rates(self, start: float, end: float, step: float) -> list[float]:
        """Mbit/s in each `step` seconds from `start` to `end`."""
        out, at = [], start
        while at + step <= end + 1e-9:
            out.append(round((self.at(at + step) - self.at(at)) * 8 / step / 1e6, 1))
            at += step
        return out

    def longest_gap_ms(self, start: float, end: float) -> float:
        times = [start, *(t for t, _ in self.timeline if start < t < end), end]
        return round(max(b - a for a, b in itertools.pairwise(times)) * 1e3, 1)


class Node:
    """One gang member: its WireGuard key pair and, once connected, its relay client."""

    def __init__(self, gang: str, name: str, rank: int) -> None:
        self.gang, self.name, self.rank = gang, name, rank
        self.private = os.urandom(32)
        self.public = x25519_public(self.private)
        self.client: RelayClient | None = None
        self.task: asyncio.Task[None] | None = None
        self.on_message: Callable[[bytes, bytes], None] = lambda src, msg: None

    async def connect(self, relay: Relay, address: str | None = None, timeout: float = 10) -> None:
        """Connect until the relay knows this member (it reads the records from KV)."""
        deadline = time.monotonic() + timeout
        while True:
            client = relay_client_class()(
                relay.name,
                address or relay.address,
                self.gang,
                1,
                self.name,
                self.private,
                self.public,
                lambda src, msg: self.on_message(src, bytes(msg)),
            )
            try:
                await client.connect()
                break
            except Exception as error:  # NotAMember until the relay has read the records
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.name} could not join {relay.name}: {error}"
                    ) from error
                await asyncio.sleep(0.05)
        self.client = client
        self.task = asyncio.get_running_loop().create_task(client.run())

    @property
    def up(self) -> bool:
        return self.client is not None and self.client.up and not (self.task and self.task.done())

    def ended(self) -> str | None:
        """Why the client's connection ended, when the client says (newer clients do)."""
        why = getattr(self.client, "ended", None)
        return str(why) if why else None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


async def enrol(bus: Bus, gang: str, members: list[Node]) -> None:
    """The records the relays authenticate by: the epoch, and each member's WireGuard key."""
    t = now()
    await bus.bucket(names.BUCKET_EPOCHS, Epoch).put(
        names.epoch_key(gang, 1),
        Epoch(
            gang=gang,
            epoch=1,
            path=PathClass.RELAYED,
            mesh_id=os.urandom(16).hex(),
            verify_key="bench",
            members=[
                EpochMember(
                    rank=m.rank,
                    node=m.name,
                    address=f"10.0.0.{m.rank + 1}",
                    interface="eth0",
                    devices=[],
                    env={},
                )
                for m in members
            ],
            bounds=derive(PathClass.RELAYED, len(members)),
            created_time=t,
            join_keys_expire_time=t + timedelta(minutes=15),
            placed_by="bench",
        ),
    )
    for m in members:
        await bus.bucket(names.BUCKET_MEMBERS, Member).put(
            names.member_key(gang, 1, m.name),
            Member(
                gang=gang,
                epoch=1,
                node=m.name,
                rank=m.rank,
                address=f"10.0.0.{m.rank + 1}",
                wg_public_key=base64.b64encode(m.public).decode(),
                joined_time=t,
            ),
        )


def transport(seq: int, body: bytes) -> bytes:
    """A WireGuard transport message: type 4, receiver 0, counter `seq`, body, tag."""
    return TRANSPORT_HEADER.pack(4, 0, seq) + body + TAG


class Sender:
    """A member streaming to its peer as fast as its relay connection takes the messages."""

    def __init__(self, member: Node, dst: bytes, flow: Flow, body: int) -> None:
        self.member, self.dst, self.flow = member, dst, flow
        self.body = bytes(body)
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def _run(self) -> None:
        client = self.member.client
        assert client is not None
        flow = self.flow
        while True:
            for _ in range(BATCH):
                if client.send_now(self.dst, transport(flow.sent_messages + 1, self.body)):
                    flow.sent_messages += 1
                else:
                    flow.refused_sends += 1
                    await asyncio.sleep(0.01)
                    break
            await pace(client)


async def pace(client: RelayClient) -> None:
    """Wait while the relay connection holds more than PACE_BYTES (the relay is not reading),
    else just let the loop run. The one place that knows how a client says it is full."""
    if client.backlog() > PACE_BYTES:
        await client.drain()
    else:
        await asyncio.sleep(0)


class StallPipe:
    """A local TCP pipe between one member and its relay that can stop reading the relay's
    side, or read it at a trickle: the relay then sees a member that stopped reading (its TCP
    window closes) or reads slowly, while the member's own client is unchanged (what it
    sends still goes up at once). Listens on 127.0.0.1."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host.strip("[]"), int(port))
        self.reading = asyncio.Event()
        self.reading.set()
        self.rate = 0.0  # bytes/s read from the relay's side while slowed; 0: as fast as it can
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []
        self.address = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0, limit=PIPE_READ)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def stall(self) -> None:
        self.reading.clear()

    def slow(self, rate: float) -> None:
        self.rate = rate
        self.reading.set()

    def resume(self) -> None:
        self.rate = 0.0
        self.reading.set()

    async def stop(self) -> None:
        self.reading.set()
        if self.server is not None:
            self.server.close()
        for writer in self.writers:
            writer.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target, limit=PIPE_READ)
        self.writers += [writer, up_writer]
        loop = asyncio.get_running_loop()
        for task in (
            loop.create_task(self._copy(reader, up_writer, None)),
            loop.create_task(self._copy(up_reader, writer, self)),
        ):
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    @staticmethod
    async def _copy(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, gate: StallPipe | None
    ) -> None:
        try:
            while True:
                rate = 0.0
                if gate is not None:
                    await gate.reading.wait()  # stalled: the reader's buffer fills, unread
                    rate = gate.rate
                size = PIPE_READ if not rate else max(1, int(rate * TRICKLE_TICK))
                data = await reader.read(size)
                if not data:
                    break
                writer.write(data)
                await writer.drain()
                if rate:
                    await asyncio.sleep(len(data) / rate)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
