"""JetStream's own answers, as Nodus decodes them (the server defines them; see
nats-server's `pub_ack_response` schema)."""

from __future__ import annotations

import msgspec


class PubAckError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class PubAck(msgspec.Struct):
    """A stream's answer to a publish: where the message was stored, or why it was not."""

    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: PubAckError | None = None
