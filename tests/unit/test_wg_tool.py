"""The `wg` side of nodus0's configuration (the kernel's WireGuard) and what the agent reads of
a wireguard-go's version: sans-I/O, against the formats wireguard-tools and Debian print."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.wg import generate_private_key, key_to_base64, public_key
from libs.wg.uapi import DeviceConfig, DeviceState, PeerConfig, PeerState, UapiError
from libs.wg.wgtool import parse_dump, private_key_input, render_set_argv
from services.agent.direct.wireguard import has_offloads, release_date

PEER = public_key(generate_private_key())
OTHER = public_key(generate_private_key())


def test_set_argv_carries_the_key_on_stdin_and_every_peer_field() -> None:
    private = generate_private_key()
    config = DeviceConfig(
        private_key=private,
        listen_port=51820,
        peers=(PeerConfig(PEER, ("100.64.0.2/32",), "198.18.2.1:51820", 15),),
    )
    argv = render_set_argv("nodus0", config)
    assert argv == [
        *("wg", "set", "nodus0", "private-key", "/dev/stdin", "listen-port", "51820"),
        *("peer", key_to_base64(PEER), "endpoint", "198.18.2.1:51820"),
        *("persistent-keepalive", "15", "allowed-ips", "100.64.0.2/32"),
    ]
    assert key_to_base64(private) not in " ".join(argv)  # never on a command line
    assert private_key_input(config) == (key_to_base64(private) + "\n").encode()


def test_set_argv_removes_and_replaces_peers() -> None:
    removal = DeviceConfig(peers=(PeerConfig(PEER, remove=True),))
    assert render_set_argv("nodus0", removal) == [
        "wg",
        "set",
        "nodus0",
        "peer",
        key_to_base64(PEER),
        "remove",
    ]
    keepalive_off = DeviceConfig(peers=(PeerConfig(PEER, persistent_keepalive=0),))
    assert render_set_argv("nodus0", keepalive_off)[-2:] == ["persistent-keepalive", "off"]
    replace = DeviceConfig(replace_peers=True, peers=(PeerConfig(PEER, ("100.64.0.2/32",)),))
    with pytest.raises(UapiError):
        render_set_argv("nodus0", replace)
    current = DeviceState(peers={PEER: PeerState(PEER), OTHER: PeerState(OTHER)})
    argv = render_set_argv("nodus0", replace, current)
    assert argv[3:6] == ["peer", key_to_base64(OTHER), "remove"]
    assert argv.count("remove") == 1


def test_dump_is_read_as_the_device_state() -> None:
    dump = (
        f"{key_to_base64(generate_private_key())}\t{key_to_base64(OTHER)}\t51820\toff\n"
        f"{key_to_base64(PEER)}\t(none)\t198.18.2.1:51820\t100.64.0.2/32,100.64.0.3/32\t"
        "1700000000\t1234\t5678\t15\n"
        f"{key_to_base64(OTHER)}\t(none)\t(none)\t(none)\t0\t0\t0\toff\n"
    )
    state = parse_dump(dump)
    assert state.listen_port == 51820
    peer = state.peers[PEER]
    assert peer.endpoint == "198.18.2.1:51820"
    assert peer.allowed_ips == ["100.64.0.2/32", "100.64.0.3/32"]
    assert (peer.last_handshake, peer.rx_bytes, peer.tx_bytes) == (1700000000, 1234, 5678)
    assert peer.persistent_keepalive == 15
    idle = state.peers[OTHER]
    assert idle.endpoint is None and idle.allowed_ips == [] and idle.persistent_keepalive == 0


@given(st.text(max_size=300))
def test_a_malformed_dump_is_refused_not_guessed(text: str) -> None:
    try:
        parse_dump(text)
    except UapiError:
        pass


@pytest.mark.parametrize(
    ("version", "date", "offloads"),
    [
        ("0.0.20220316-1+b4", 20220316, False),  # bookworm
        ("0.0.20231211-1~bpo12+1", 20231211, True),  # bookworm-backports
        ("0.0.20230223", 20230223, True),  # what that backports build's --version says
        ("0.0.20250522-1", 20250522, True),  # trixie
        ("unknown", None, False),
    ],
)
def test_offloads_are_read_from_the_release(version: str, date: int | None, offloads: bool) -> None:
    assert release_date(version) == date
    assert has_offloads(version) is offloads
