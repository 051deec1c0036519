"""An epoch's dataplane in the process that holds it: the dataplane process runs one, and an
agent made inside a test's process (no bus URL to hand a child) runs it in its own loop.

One face for both paths: `start` (until ready), `stop`, the home relay, the path to a peer."""

from __future__ import annotations

from libs.bus import Bus
from libs.contracts.dataplane import EpochState
from libs.contracts.errors import ErrorCode, NodusError
from libs.jobs.relays import Whereabouts
from services.agent.direct.member import FIRST_ROUND_WAIT, DirectMember
from services.agent.relayed.member import RelayedMember


class InlineDataplane:
    def __init__(self, runtime: RelayedMember | DirectMember) -> None:
        self.runtime = runtime
        self.ready = False
        self.stopped = False

    @classmethod
    def build(cls, bus: Bus, state: EpochState, wg_private: bytes) -> InlineDataplane:
        spec = state.dataplane
        member = next(
            (m for m in state.epoch.members if spec is not None and m.node == spec.node), None
        )
        if spec is None or member is None:
            raise NodusError(ErrorCode.INVALID, f"{state.key}: no dataplane for this member")
        where = Whereabouts(spec.region, spec.region_class)
        if spec.kind == "direct":
            return cls(DirectMember(bus, state.epoch, member, wg_private, spec.underlay, where))
        host, _, port = spec.socks_listen.rpartition(":")
        return cls(RelayedMember(bus, state.epoch, member, wg_private, (host, int(port)), where))

    @property
    def kind(self) -> str:
        return "direct" if isinstance(self.runtime, DirectMember) else "relayed"

    async def start(self) -> None:
        try:
            await self.runtime.start()
        except BaseException:
            await self.runtime.stop()
            self.stopped = True
            raise
        self.ready = True

    async def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            await self.runtime.stop()

    async def detach(self) -> None:
        """In the agent's own process it cannot outlive the agent: it stops, and the next agent
        starts it again from the persisted key."""
        await self.stop()

    def running(self) -> bool:
        return not self.stopped

    async def home(self) -> tuple[str, str] | None:
        return self.home_now()

    def home_now(self) -> tuple[str, str] | None:
        """Relayed: the path (derp:<region>) and the relay carrying the tunnel now."""
        runtime = self.runtime
        if isinstance(runtime, RelayedMember) and runtime.socks is not None:
            tunnel = runtime.tunnel
            if tunnel is not None and tunnel.home is not None:
                return tunnel.path, tunnel.home.name
        return None

    async def path_to(self, peer: str, wait: float = FIRST_ROUND_WAIT) -> str | None:
        """The path the workload's bytes take to `peer` now: the tunnel's relay on the Relayed
        path; on the Direct path, once the pair's first checks ended (or `wait` passed),
        `direct` or the relay that carries it."""
        runtime = self.runtime
        if isinstance(runtime, RelayedMember):
            return runtime.tunnel.path if runtime.tunnel is not None else None
        if wait > 0:
            await runtime.first_round(peer, wait)
        return runtime.path_to(peer)
