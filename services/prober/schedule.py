"""Probe rounds: every pair of members measured once, no member in two measurements at once.
The circle method gives N-1 rounds for N members (N rounds when N is odd)."""

from __future__ import annotations


def rounds(members: list[str]) -> list[list[tuple[str, str]]]:
    players: list[str | None] = list(members)
    if len(players) % 2:
        players.append(None)  # a bye
    n = len(players)
    schedule: list[list[tuple[str, str]]] = []
    for _ in range(n - 1):
        pairs = []
        for i in range(n // 2):
            a, b = players[i], players[n - 1 - i]
            if a is not None and b is not None:
                pairs.append((a, b))
        schedule.append(pairs)
        players = [players[0], players[-1], *players[1:-1]]
    return schedule
