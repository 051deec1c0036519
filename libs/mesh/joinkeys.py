"""Join keys: Ed25519-signed claims minted by the epoch's fresh mesh identity.

A token is `base64url(claims JSON) "." base64url(signature)`. The signing key lives only in
the placer's memory while it mints the epoch's keys; the epoch record keeps the verify key.
One key serves the epoch's members: it names each member with a nonce of its own, and one
signature covers them all (a signature per member cost the placer a fifth of a decision).
Agents that read no such key (older ones) get a one-member key each (`mint_each`). Single
use is per member: its agent redeems its own nonce with a compare-and-set create.
"""

from __future__ import annotations

import base64
import secrets
from datetime import datetime, timedelta

import msgspec
from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from libs.contracts.base import decode, encode
from libs.contracts.epochs import JoinClaims
from libs.contracts.errors import ErrorCode, NodusError


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _nonces(count: int) -> list[str]:
    """`count` random 128-bit nonces, in hex, from one read of the system's randomness."""
    pool = secrets.token_hex(16 * count)
    return [pool[i : i + 32] for i in range(0, 32 * count, 32)]


class MeshIdentity:
    """A fresh identity per epoch: a mesh id and the key that signs its join keys."""

    def __init__(self) -> None:
        self.mesh_id = secrets.token_hex(16)
        self._signing_key = SigningKey.generate()
        self.verify_key = _b64(bytes(self._signing_key.verify_key))

    def mint(self, gang: str, epoch: int, nodes: list[str], expires: datetime) -> str:
        """The epoch's join key: each of `nodes` may redeem it once, with its own nonce."""
        claims = JoinClaims(
            gang=gang,
            epoch=epoch,
            mesh_id=self.mesh_id,
            expires_time=expires,
            nonces=dict(zip(nodes, _nonces(len(nodes)), strict=True)),
        )
        return self._signed(claims)

    def mint_each(
        self, gang: str, epoch: int, nodes: list[str], expires: datetime
    ) -> dict[str, str]:
        """A one-member key for each of `nodes`, which any agent reads."""
        return {
            node: self._signed(
                JoinClaims(
                    gang=gang,
                    epoch=epoch,
                    mesh_id=self.mesh_id,
                    expires_time=expires,
                    node=node,
                    nonce=nonce,
                )
            )
            for node, nonce in zip(nodes, _nonces(len(nodes)), strict=True)
        }

    def _signed(self, claims: JoinClaims) -> str:
        body = encode(claims)
        signature = self._signing_key.sign(body).signature
        return f"{_b64(body)}.{_b64(signature)}"

    @staticmethod
    def expiry(now: datetime, ttl_seconds: float) -> datetime:
        return now + timedelta(seconds=ttl_seconds)


def verify_join_key(token: str, verify_key: str, now: datetime) -> JoinClaims:
    """Check signature and expiry; the caller checks gang, epoch and node and redeems the nonce."""
    try:
        body_text, signature_text = token.split(".")
        body, signature = _unb64(body_text), _unb64(signature_text)
        VerifyKey(_unb64(verify_key)).verify(body, signature)
        claims = decode(body, JoinClaims)
    except (ValueError, BadSignatureError, msgspec.DecodeError) as error:
        raise NodusError(ErrorCode.INVALID, f"join key rejected: {error or 'malformed'}") from None
    if claims.expires_time <= now:
        raise NodusError(
            ErrorCode.STALE_EPOCH,
            f"join key for {claims.gang} epoch {claims.epoch} expired at {claims.expires_time}",
        )
    return claims
