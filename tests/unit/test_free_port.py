"""free_port gives a port a daemon can bind a moment later, outside the kernel's ephemeral
range when there is room below it, and the kernel's choice when there is none."""

from __future__ import annotations

import socket

import pytest

from libs.bus import server


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_a_port_below_the_ephemeral_range_each_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "_ephemeral_range", lambda: (32768, 60999))
    ports = [server.free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    assert all(10000 <= p < 32768 - 2048 and _bindable(p) for p in ports)


def test_a_kernel_that_hands_out_every_port_gets_its_own_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server, "_ephemeral_range", lambda: (1024, 65535))
    port = server.free_port()
    assert 1024 <= port <= 65535 and _bindable(port)
