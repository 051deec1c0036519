"""The stream protocol inside a member-to-member WireGuard session, sans-I/O."""

from libs.tunnel.link import (
    Closed,
    CreditAvailable,
    Data,
    Event,
    Link,
    LinkError,
    OpenResult,
    Reset,
    StreamOpened,
)

__all__ = [
    "Closed",
    "CreditAvailable",
    "Data",
    "Event",
    "Link",
    "LinkError",
    "OpenResult",
    "Reset",
    "StreamOpened",
]
