"""Two devices wired to each other in memory, on a clock the caller moves.

For tests of libs.wg and of code built on it: no sockets, no real time. Outgoing messages
are delivered at once (or held on `wire` while `connected` is False); every other event is
kept per device in `events`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any, TypeVar

from libs.wg.device import Device
from libs.wg.events import Event, Outgoing
from libs.wg.keys import generate_private_key

__all__ = ["Loopback"]

E = TypeVar("E")


class Loopback:
    def __init__(self, a: Device, b: Device, now: float = 0.0) -> None:
        self.a = a
        self.b = b
        self.now = now
        self.connected = True
        self.wire: list[tuple[Device, bytes | bytearray]] = []  # held while not connected
        self.events: dict[bytes, list[Event]] = {a.public_key: [], b.public_key: []}
        self.sources = {a.public_key: b"address of a", b.public_key: b"address of b"}

    @classmethod
    def create(
        cls, preshared_key: bytes | None = None, wall_clock_start: float = 1.7e9, **options: Any
    ) -> Loopback:
        """Two fresh devices that are each other's peer. Their wall clocks start at
        `wall_clock_start` and follow the loopback's clock."""
        loop: Loopback
        a = Device(
            generate_private_key(), wall_clock=lambda: wall_clock_start + loop.now, **options
        )
        b = Device(
            generate_private_key(), wall_clock=lambda: wall_clock_start + loop.now, **options
        )
        a.add_peer(b.public_key, preshared_key)
        b.add_peer(a.public_key, preshared_key)
        loop = cls(a, b)
        return loop

    def peer_of(self, device: Device) -> Device:
        return self.b if device is self.a else self.a

    def send(self, sender: Device, payload: bytes | bytearray | memoryview) -> None:
        self.route(sender, sender.send(self.peer_of(sender).public_key, payload, self.now))

    def deliver(self, receiver: Device, message: bytes | bytearray) -> None:
        """Hand one message to `receiver` as if it came from its peer, and route the results."""
        source = self.sources[self.peer_of(receiver).public_key]
        self.route(receiver, receiver.receive(message, self.now, source))

    def route(self, origin: Device, events: Iterable[Event]) -> None:
        """Deliver `origin`'s Outgoing messages (and the replies they cause) breadth first."""
        pending: deque[tuple[Device, Event]] = deque((origin, e) for e in events)
        while pending:
            device, event = pending.popleft()
            if not isinstance(event, Outgoing):
                self.events[device.public_key].append(event)
                continue
            receiver = self.peer_of(device)
            if not self.connected:
                self.wire.append((receiver, event.data))
                continue
            source = self.sources[device.public_key]
            pending.extend((receiver, e) for e in receiver.receive(event.data, self.now, source))

    def advance(self, seconds: float, step: float = 0.05) -> None:
        """Move the clock, ticking both devices at every step."""
        end = self.now + seconds
        while self.now < end:
            self.now = min(end, self.now + step)
            self.tick()

    def tick(self) -> None:
        self.route(self.a, self.a.tick(self.now))
        self.route(self.b, self.b.tick(self.now))

    def take(self, device: Device, kind: type[E]) -> list[E]:
        """Remove and return `device`'s events of one kind."""
        kept: list[Event] = []
        taken: list[E] = []
        for event in self.events[device.public_key]:
            if isinstance(event, kind):
                taken.append(event)
            else:
                kept.append(event)
        self.events[device.public_key] = kept
        return taken

    def held(self, receiver: Device | None = None) -> list[bytes | bytearray]:
        return [m for r, m in self.wire if receiver is None or r is receiver]
