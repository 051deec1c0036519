"""Probe rounds: every pair of members measured once, in one direction (G10), and in a round
no member sends two samples nor receives two. Links are full duplex, so a member may send one
sample while it receives another: round k has member i send to member i+k, which measures
all N(N-1)/2 pairs in N/2 rounds (rounded down; 4 rounds of 10 s for 8 members instead of the
7 that rounds of disjoint pairs take, so a gang is back to work sooner after a re-placement).
"""

from __future__ import annotations


def rounds(members: list[str]) -> list[list[tuple[str, str]]]:
    n = len(members)
    schedule: list[list[tuple[str, str]]] = []
    for k in range(1, n // 2 + 1):
        # With N even, the pairs N/2 apart come up twice in round N/2: measure each once.
        senders = range(n // 2) if 2 * k == n else range(n)
        schedule.append([(members[i], members[(i + k) % n]) for i in senders])
    return schedule
