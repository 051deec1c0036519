"""The dataplane's control framing and the epochs an agent keeps on disk (O4)."""

from __future__ import annotations

import os
import stat
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest

from libs.contracts.base import now
from libs.contracts.bounds import derive
from libs.contracts.dataplane import (
    ControlReply,
    DataplaneProcess,
    DataplaneSpec,
    EpochState,
    PathRequest,
)
from libs.contracts.epochs import Epoch, EpochMember
from libs.contracts.jobs import PathClass
from libs.contracts.lifecycle import JoinedEpoch
from libs.jobs.relays import Whereabouts
from services.agent.dataplane.control import (
    MAX_FRAME,
    FrameBuffer,
    decode_reply,
    decode_request,
    frame,
    reachable,
)
from services.agent.dataplane.inline import InlineDataplane
from services.agent.dataplane.store import EpochStore
from services.agent.localepochs import Host, LocalEpochs


def test_frames_arrive_whole_however_the_bytes_are_cut() -> None:
    data = frame(PathRequest(peer="lam-b", wait=1.5))
    buffer = FrameBuffer()
    bodies = [buffer.feed(data[i : i + 1]) for i in range(len(data))]
    assert bodies[:-1] == [None] * (len(data) - 1)
    assert decode_request(bodies[-1] or b"") == PathRequest(peer="lam-b", wait=1.5)
    reply = frame(ControlReply(ready=True, path="derp:eu", relay="relay-0"))
    assert decode_reply(FrameBuffer().feed(reply) or b"").relay == "relay-0"


def test_an_oversized_frame_is_refused() -> None:
    with pytest.raises(ValueError):
        FrameBuffer().feed((MAX_FRAME + 1).to_bytes(4, "big"))


def test_a_long_socket_path_is_reached_through_its_directory(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    with reachable(deep / "control.sock") as name:
        assert len(name) < 100 and name.endswith("/control.sock")


def _state(key: str) -> EpochState:
    t = now()
    member = EpochMember(
        rank=0, node="vast-a", address="127.0.1.1", interface="eth0", devices=[], env={}
    )
    epoch = Epoch(
        gang="acme.rl",
        epoch=1,
        path=PathClass.RELAYED,
        mesh_id="m",
        verify_key="v",
        members=[member],
        bounds=derive(PathClass.RELAYED, 2),
        created_time=t,
        join_keys_expire_time=t + timedelta(minutes=15),
        placed_by="test",
    )
    return EpochState(
        key=key,
        epoch=epoch,
        joined=JoinedEpoch(gang="acme.rl", epoch=1, rank=0, address="127.0.1.1"),
        joined_time=t,
        dataplane=DataplaneSpec(kind="relayed", node="vast-a", socks_listen="127.0.0.1:1080"),
    )


def test_an_epoch_is_kept_with_its_key_private_and_read_back(tmp_path: Path) -> None:
    store = EpochStore(tmp_path)
    key = "vast-a.acme.rl.1"
    private = os.urandom(32)
    store.save(_state(key), private)
    store.save_process(
        key, DataplaneProcess(pid=42, start_ticks=7, boot_id="b", started_time=now())
    )
    assert stat.S_IMODE((store.directory(key) / "wg.key").stat().st_mode) == 0o600
    assert stat.S_IMODE(store.directory(key).stat().st_mode) == 0o700
    (found,) = store.load_all()
    assert found.state.key == key and found.state.dataplane == _state(key).dataplane
    assert found.wg_private == private
    assert found.process is not None and (found.process.pid, found.process.boot_id) == (42, "b")
    store.forget_process(key)
    assert store.load(key).process is None


def test_an_unreadable_epoch_is_dropped_not_fatal(tmp_path: Path) -> None:
    store = EpochStore(tmp_path)
    store.save(_state("vast-a.acme.rl.1"), os.urandom(32))
    broken = store.directory("vast-a.acme.rl.2")
    broken.mkdir(parents=True)
    (broken / "state.json").write_text("{not json")
    assert [s.state.key for s in store.load_all()] == ["vast-a.acme.rl.1"]
    assert not broken.exists()


async def test_an_epochs_dataplane_knows_where_its_machine_is() -> None:
    # Without the gang's relays its member falls back on the nearest (pick_relays).
    host = Host("vast-a", "127.0.1.1", "127.0.0.1:1080", False, False, "eu-west-1", "eu")

    async def report(key: str, why: str | None) -> None: ...

    epochs = LocalEpochs(None, host, None, None, str, lambda e: e.members[0], report)  # type: ignore[arg-type]
    state = _state("vast-a.acme.rl.1")
    spec = epochs.spec(state.epoch)
    assert spec is not None and (spec.region, spec.region_class) == ("eu-west-1", "eu")
    built = InlineDataplane.build(None, msgspec.structs.replace(state, dataplane=spec), b"k" * 32)  # type: ignore[arg-type]
    assert built.runtime.where == Whereabouts("eu-west-1", "eu")
