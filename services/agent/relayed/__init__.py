"""The Relayed path's member (G14-G16), for machines with no network device and no UDP:
`member` (one epoch's dataplane) runs WireGuard in user space (`wgdevice`) carried by two
relays (`homing`) in the `tunnel`, whose streams are spliced to local sockets (`sockets`) and
fed by the shim's SOCKS5 connections (`socks`); `timers` is the tunnel's clock."""
