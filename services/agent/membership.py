"""This node's memberships as the bus knows them: a join key verified against the epoch it
brings and redeemed once (C2, G9), the member record binding the epoch's WireGuard key to this
node (relays admit only it, S2), its introductions to each peer (S1), and the epochs joined as
the keys brought them, which the probe and the launch ask for."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime

from nats.errors import Error as NatsError

from libs.bus import Bus, EpochGuard
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import Epoch, EpochMember, JoinKeyGrant, JoinRedemption
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.lifecycle import JoinedEpoch
from libs.contracts.relay import Member
from libs.mesh import verify_join_key
from libs.wg import key_to_base64, public_key

log = logging.getLogger("nodus.agent")


class Membership:
    def __init__(self, bus: Bus, node: str) -> None:
        self.node = node
        self.peers = bus.bucket(names.BUCKET_PEERS, Member)
        self.members = bus.bucket(names.BUCKET_MEMBERS, Member)
        self.redeemed = bus.bucket(names.BUCKET_REDEEMED, JoinRedemption)
        self.epoch_records: dict[tuple[str, int], Epoch] = {}  # as the join keys brought them
        self.joined: dict[str, JoinedEpoch] = {}  # joinkey key -> membership
        self.guard = EpochGuard()  # the newest epoch joined per gang (C2)

    def remember(self, key: str, epoch: Epoch, joined: JoinedEpoch) -> None:
        self.epoch_records[(epoch.gang, epoch.epoch)] = epoch
        self.joined[key] = joined

    def forget(self, key: str, gang: str, epoch: int) -> None:
        self.joined.pop(key, None)
        self.epoch_records.pop((gang, epoch), None)

    def member_of(self, epoch: Epoch) -> EpochMember:
        member = next((m for m in epoch.members if m.node == self.node), None)
        if member is None:
            raise NodusError(ErrorCode.INVALID, f"{self.node} is not a member of {epoch.gang}")
        return member

    def joined_epoch(self, gang: str, epoch: int) -> Epoch:
        """An epoch this node holds a key of, as the key brought it. One it left (its key was
        deleted: fenced) or that a newer one replaced is stale (the guard remembers)."""
        record = self.epoch_records.get((gang, epoch))
        current = self.guard.current(gang)
        if current is not None and (epoch < current or (record is None and epoch == current)):
            raise NodusError(ErrorCode.STALE_EPOCH, f"{gang} epoch {epoch} is fenced")
        if record is None:
            raise NodusError(
                ErrorCode.EPOCH_MISMATCH, f"{self.node} holds no join key of {gang} epoch {epoch}"
            )
        return record

    async def redeem(self, grant: JoinKeyGrant) -> tuple[Epoch, EpochMember, datetime]:
        """The grant's key verified, then used once (a second use is CONFLICT)."""
        epoch, member, nonce = self._verify(grant)
        t = now()
        redemption = JoinRedemption(
            gang=epoch.gang, epoch=epoch.epoch, node=self.node, redeemed_time=t
        )
        if await self.redeemed.create(names.redeemed_key(self.node, nonce), redemption) is None:
            raise NodusError(
                ErrorCode.CONFLICT,
                f"join key for {epoch.gang} epoch {epoch.epoch} was already used",
            )
        return epoch, member, t

    def _verify(self, grant: JoinKeyGrant) -> tuple[Epoch, EpochMember, str]:
        """The grant's key checked against the epoch it brings: signed by the epoch's mesh
        identity, for this node, not stale, not fenced (C2, G9); its nonce."""
        claims = verify_join_key(grant.token, grant.verify_key, now())
        current = self.guard.current(claims.gang)
        if current is not None and claims.epoch < current:
            raise NodusError(
                ErrorCode.STALE_EPOCH,
                f"{claims.gang}: join key for epoch {claims.epoch}, this node is on epoch {current}",
            )
        nonce = claims.nonce_of(self.node)
        if nonce is None:
            named = sorted(claims.nonces) if claims.node is None else [claims.node]
            raise NodusError(
                ErrorCode.INVALID, f"join key names {', '.join(named)}, not {self.node}"
            )
        epoch = grant.epoch
        if epoch is None or (epoch.gang, epoch.epoch) != (claims.gang, claims.epoch):
            raise NodusError(
                ErrorCode.EPOCH_MISMATCH,
                f"the grant of {claims.gang} epoch {claims.epoch} brings no such epoch",
            )
        if epoch.fenced:
            raise NodusError(ErrorCode.STALE_EPOCH, f"{claims.gang} epoch {claims.epoch} is fenced")
        if epoch.verify_key != grant.verify_key or epoch.mesh_id != claims.mesh_id:
            raise NodusError(
                ErrorCode.INVALID, "join key was not signed by the epoch's mesh identity"
            )
        return epoch, self.member_of(epoch), nonce

    async def register(
        self,
        epoch: Epoch,
        private: bytes,
        joined_time: datetime,
        again: bool = False,
    ) -> None:
        """This epoch's WireGuard key, bound to this node once (relays admit only it, S2),
        recorded and introduced to the peers. `again`, after an adoption (the agent before may
        have died half-way) or a new key: the record put again (only this node may write its
        key, and it reads no members: a create would ask what is there)."""
        member = self.member_of(epoch)
        record = Member(
            gang=epoch.gang,
            epoch=epoch.epoch,
            node=self.node,
            rank=member.rank,
            address=member.address,
            wg_public_key=key_to_base64(public_key(private)),
            joined_time=joined_time,
        )
        key = names.member_key(epoch.gang, epoch.epoch, self.node)
        try:
            if again:
                await self.members.put(key, record)
            elif await self.members.create(key, record) is None:
                raise NodusError(
                    ErrorCode.CONFLICT,
                    f"{self.node} already holds a key in {epoch.gang} epoch {epoch.epoch}",
                )
        except (NatsError, OSError, TimeoutError) as error:
            raise NodusError(
                ErrorCode.JOURNAL_UNAVAILABLE, f"{key}: the member record not written: {error!r}"
            ) from None
        await self._introduce(epoch, record)

    async def _introduce(self, epoch: Epoch, record: Member) -> None:
        """This member's record for each peer, addressed to it: peers read only what is
        addressed to them (S1)."""
        try:
            await asyncio.gather(
                *(
                    self.peers.put(
                        names.peer_key(epoch.gang, epoch.epoch, m.node, self.node), record
                    )
                    for m in epoch.members
                    if m.node != self.node
                )
            )
        except (NatsError, OSError, TimeoutError) as error:
            raise NodusError(
                ErrorCode.JOURNAL_UNAVAILABLE,
                f"{epoch.gang} epoch {epoch.epoch}: cannot introduce {self.node} to its "
                f"peers: {error!r}",
            ) from None

    async def forget_introductions(self, gang: str, epoch: int) -> None:
        record = self.epoch_records.get((gang, epoch))
        if record is None:
            return
        for m in record.members:
            if m.node != self.node:
                try:
                    await self.peers.delete(names.peer_key(gang, epoch, m.node, self.node))
                except (NodusError, NatsError, OSError, TimeoutError) as error:
                    log.info("%s epoch %d: its introductions stay: %s", gang, epoch, error)
                    return
