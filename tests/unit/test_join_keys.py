"""Join keys: one signed key per epoch names every member, each with a nonce of its own."""

from __future__ import annotations

from datetime import timedelta

import pytest

from libs.contracts.base import encode, now
from libs.contracts.epochs import JoinClaims
from libs.contracts.errors import ErrorCode, NodusError
from libs.mesh import MeshIdentity, verify_join_key
from libs.mesh.joinkeys import _b64


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


def test_a_one_member_key_of_an_older_placer_still_verifies() -> None:
    mesh = MeshIdentity()
    t = now()
    claims = JoinClaims(
        gang="acme.llama",
        epoch=1,
        node="a",
        mesh_id=mesh.mesh_id,
        nonce="n1",
        expires_time=t + timedelta(minutes=15),
    )
    body = encode(claims)
    token = f"{_b64(body)}.{_b64(mesh._signing_key.sign(body).signature)}"
    verified = verify_join_key(token, mesh.verify_key, t)
    assert verified.nonce_of("a") == "n1"
    assert verified.nonce_of("b") is None
