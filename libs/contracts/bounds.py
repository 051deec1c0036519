"""The one place every bound is derived from (C3): relay rate, buffers, timeouts."""

from __future__ import annotations

from libs.contracts.epochs import Bounds
from libs.contracts.jobs import PathClass

RELAY_GANG_BITS_PER_SECOND = 1_000_000_000  # G18: 1 Gbit/s per Relayed gang
# Buffers hold rate x RTT; this RTT covers a transcontinental relay path.
ASSUMED_WORST_RTT_SECONDS = 0.25
PROBE_READINESS_SECONDS = 60.0  # G10.1
PROBE_SAMPLE_SECONDS = 10.0  # G10.2
JOIN_KEY_TTL_SECONDS = 15 * 60.0  # G9
SHIM_SELF_TEST_SECONDS = 20.0  # G10.3: the image's launcher loading the shim, at most
# Something that heartbeats and stays silent this long is gone (the placer's default
# heartbeatTimeoutSeconds for nodes); a holder renews three times within it.
HEARTBEAT_TIMEOUT_SECONDS = 15.0
HEARTBEATS_PER_TIMEOUT = 3
# Relayed members' tunnels: the most memory an agent gives one member's tunnel buffers unless
# configured (a plan needing more is refused, C3); a stream's flow-control window, by default
# and as clamped from the per-member buffer (so many streams fit in the limit); and what a
# Direct member queues to the relays (its fallback) before it drops WireGuard datagrams.
TUNNEL_BUFFER_LIMIT_BYTES = 64 << 20
STREAM_WINDOW_BYTES = 4 << 20
STREAM_WINDOW_MIN_BYTES = 256 << 10
STREAM_WINDOW_MAX_BYTES = 8 << 20
FALLBACK_QUEUE_BYTES = 4 << 20
# The most one tunnel link keeps sent and unacknowledged to one peer, over all its streams
# (what relays may hold for the pair, and what it resends after a failover); a gang's links
# keep their member's rate x RTT (link_inflight), which is less in a larger gang.
LINK_MAX_INFLIGHT_BYTES = 16 << 20
# A relay queues to one member at most this many times what every other member's link may keep
# in flight to it: only a member that stopped reading reaches the limit.
DESTINATION_HEADROOM = 2
# What the scheduler assumes when comparing placements (G19), until measured numbers exist.
RELATIVE_TO_DIRECT = {PathClass.PRIVATE: 1.0, PathClass.DIRECT: 1.0, PathClass.RELAYED: 0.25}


def stream_window(bounds: Bounds) -> int:
    """One tunnel stream's window: the derived per-member buffer, clamped."""
    wanted = bounds.tunnel_buffer_bytes or STREAM_WINDOW_BYTES
    return max(STREAM_WINDOW_MIN_BYTES, min(wanted, STREAM_WINDOW_MAX_BYTES))


def link_inflight(bounds: Bounds) -> int:
    """What one link keeps unacknowledged to one peer: the member's share of the gang's rate x
    RTT (a member sends at most that much in all), clamped to a stream window and the cap."""
    wanted = bounds.tunnel_buffer_bytes or LINK_MAX_INFLIGHT_BYTES
    return max(STREAM_WINDOW_MIN_BYTES, min(wanted, LINK_MAX_INFLIGHT_BYTES))


def destination_queue_bytes(members: int) -> int:
    """What a relay queues to one member of a gang of `members` before it drops what else is
    meant for it: the other members' links in flight to it, with headroom."""
    others = max(1, members - 1)
    return DESTINATION_HEADROOM * others * link_inflight(derive(PathClass.RELAYED, members))


def derive(
    path: PathClass, members: int, probe_sample_seconds: float = PROBE_SAMPLE_SECONDS
) -> Bounds:
    """Per-member relay rate is the gang's rate split evenly (G18); buffers are rate x RTT."""
    if members < 1:
        raise ValueError("a gang has at least one member")
    gang_rate = RELAY_GANG_BITS_PER_SECOND if path is PathClass.RELAYED else 0
    member_rate = gang_rate // members
    buffer_bytes = int(member_rate / 8 * ASSUMED_WORST_RTT_SECONDS) if member_rate else 0
    return Bounds(
        relay_gang_bits_per_second=gang_rate,
        relay_member_bits_per_second=member_rate,
        tunnel_buffer_bytes=buffer_bytes,
        probe_readiness_seconds=PROBE_READINESS_SECONDS,
        probe_sample_seconds=probe_sample_seconds,
        join_key_ttl_seconds=JOIN_KEY_TTL_SECONDS,
    )
