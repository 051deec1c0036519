"""The same configuration as libs.wg.uapi, spoken through wireguard-tools' `wg`: the way to a
kernel WireGuard device (netlink; `wg` also reaches a wireguard-go device over its UAPI socket).

Sans-I/O: `render_set_argv` makes the `wg set` command line (the private key goes on stdin,
never on a command line), `parse_dump` reads `wg show DEVICE dump`.
"""

from __future__ import annotations

from libs.wg.keys import check_key, key_from_base64, key_to_base64
from libs.wg.uapi import DeviceConfig, DeviceState, PeerState, UapiError


def render_set_argv(
    device: str, config: DeviceConfig, current: DeviceState | None = None
) -> list[str]:
    """`wg set` for `config`; `current` (the device's state) is needed to replace peers, which
    `wg set` does as removals of the peers not listed, in the same netlink message."""
    argv = ["wg", "set", device]
    if config.private_key is not None:
        check_key(config.private_key, "private key")
        argv += ["private-key", "/dev/stdin"]
    if config.listen_port is not None:
        argv += ["listen-port", str(config.listen_port)]
    listed = {peer.public_key for peer in config.peers}
    if config.replace_peers:
        if current is None:
            raise UapiError("replacing peers through `wg set` needs the device's current state")
        for key in sorted(set(current.peers) - listed):
            argv += ["peer", key_to_base64(key), "remove"]
    for peer in config.peers:
        check_key(peer.public_key, "peer public key")
        argv += ["peer", key_to_base64(peer.public_key)]
        if peer.remove:
            argv.append("remove")
            continue
        if peer.endpoint is not None:
            argv += ["endpoint", peer.endpoint]
        if peer.persistent_keepalive is not None:
            keepalive = peer.persistent_keepalive
            argv += ["persistent-keepalive", str(keepalive) if keepalive else "off"]
        if peer.allowed_ips:  # `wg set` replaces a peer's allowed IPs, as uapi's render does
            argv += ["allowed-ips", ",".join(peer.allowed_ips)]
    return argv


def private_key_input(config: DeviceConfig) -> bytes | None:
    """What `wg set` reads on stdin for `render_set_argv`'s private-key /dev/stdin."""
    if config.private_key is None:
        return None
    return (key_to_base64(config.private_key) + "\n").encode()


def parse_dump(text: str) -> DeviceState:
    """`wg show DEVICE dump`: the device's line (private key, public key, listen port, fwmark),
    then one line per peer (public key, preshared key, endpoint, allowed IPs, latest handshake,
    rx, tx, keepalive), tab-separated."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise UapiError("`wg show dump` printed nothing")
    device = lines[0].split("\t")
    if len(device) != 4:
        raise UapiError(f"`wg show dump`: not a device line: {lines[0][:120]!r}")
    try:
        state = DeviceState(listen_port=int(device[2]))
        for line in lines[1:]:
            fields = line.split("\t")
            if len(fields) != 8:
                raise UapiError(f"`wg show dump`: not a peer line: {line[:120]!r}")
            key, _, endpoint, allowed, handshake, rx, tx, keepalive = fields
            peer = PeerState(
                public_key=key_from_base64(key),
                endpoint=None if endpoint == "(none)" else endpoint,
                allowed_ips=[] if allowed == "(none)" else allowed.split(","),
                last_handshake=float(handshake),
                rx_bytes=int(rx),
                tx_bytes=int(tx),
                persistent_keepalive=0 if keepalive == "off" else int(keepalive),
            )
            state.peers[peer.public_key] = peer
    except ValueError as error:
        raise UapiError(f"`wg show dump`: {error}") from None
    return state
