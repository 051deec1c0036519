"""The Direct path's member (G7, G11-G13), for VMs: WireGuard on a `nodus0` device per epoch
(`nodus0`, on the kernel's WireGuard or wireguard-go, `wireguard`), each pair's path found by
ICE checks (`ice`) through the NAT mapping WireGuard's port keeps (`wgport`), agreed by both
sides and watched by heartbeats (`pairpath`), and carried by the relays while no direct path
holds (`fallback`); `member` runs one epoch's."""
