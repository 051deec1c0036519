"""Join keys: one signed key per epoch names every member, each with a nonce of its own."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from libs.contracts.base import Record, decode, now
from libs.contracts.errors import ErrorCode, NodusError
from libs.mesh import MeshIdentity, verify_join_key
from libs.mesh.joinkeys import _b64, _unb64


def test_one_key_names_each_member_with_its_own_nonce() -> None:
    mesh = MeshIdentity()
    t = now()
    token = mesh.mint("acme.llama", 3, ["a", "b", "c"], t + timedelta(minutes=15))
    claims = verify_join_key(token, mesh.verify_key, t)
    assert (claims.gang, claims.epoch, claims.mesh_id) == ("acme.llama", 3, mesh.mesh_id)
    nonces = [claims.nonce_of(node) for node in ("a", "b", "c")]
    assert all(nonces) and len(set(nonces)) == 3
    assert claims.nonce_of("d") is None


def test_a_key_of_another_identity_or_expired_is_refused() -> None:
    mesh, other = MeshIdentity(), MeshIdentity()
    t = now()
    token = mesh.mint("acme.llama", 1, ["a"], t + timedelta(minutes=15))
    with pytest.raises(NodusError, match="join key rejected"):
        verify_join_key(token, other.verify_key, t)
    with pytest.raises(NodusError) as expired:
        verify_join_key(token, mesh.verify_key, t + timedelta(minutes=16))
    assert expired.value.code is ErrorCode.STALE_EPOCH
    forged = token.split(".")[0] + "." + _b64(b"\0" * 64)
    with pytest.raises(NodusError, match="join key rejected"):
        verify_join_key(forged, mesh.verify_key, t)


class OlderClaims(Record):
    """JoinClaims as agents read them before one key named every member."""

    gang: str
    epoch: int
    node: str
    mesh_id: str
    nonce: str
    expires_time: datetime


def test_one_member_keys_are_what_an_older_agent_reads() -> None:
    mesh = MeshIdentity()
    t = now()
    tokens = mesh.mint_each("acme.llama", 2, ["a", "b"], t + timedelta(minutes=15))
    for node, token in tokens.items():
        claims = verify_join_key(token, mesh.verify_key, t)
        assert claims.nonce_of(node) and claims.nonce_of("a" if node == "b" else "b") is None
        older = decode(_unb64(token.split(".")[0]), OlderClaims)  # no field it does not know
        assert (older.node, older.nonce) == (node, claims.nonce_of(node))
    assert len({verify_join_key(t_, mesh.verify_key, t).nonce for t_ in tokens.values()}) == 2
