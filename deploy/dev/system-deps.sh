#!/usr/bin/env bash
# Debian packages the tests and the demo use (real programs, not stand-ins). Installs only
# what is missing; needs root (CI and these dev machines run as root) or passwordless sudo.
set -euo pipefail

# package:command-that-proves-it-is-there
WANTED=(
  "gcc:gcc"
  "make:make"
  "curl:curl"
  "iproute2:ip"
  # The shim (netshim/): headers and static libc for nodus-shim-check (libc6-dev has no
  # command: dpkg decides), musl for the ShimNotLoaded tests, proxychains4 for the bench,
  # unshare/nsenter for the error-mapping tests' network namespace.
  "libc6-dev:libc6-dev"
  "musl-tools:musl-gcc"
  "proxychains4:proxychains4"
  "util-linux:nsenter"
  "wireguard-go:wireguard-go"
  "wireguard-tools:wg"
  # The Relayed-path bench (tests/bench/relay.py): socat as the plain relay baseline.
  "socat:socat"
  # The real-program end-to-end tests (tests/e2e/test_real_programs.py): Debian's iperf3
  # through the shim between the members of a Relayed gang.
  "iperf3:iperf3"
  # The network-namespace lab (app/netlab, `nodus up --netns`): NAT routers masquerade with
  # nftables; members' namespaces filter UDP in the fallback tests.
  "nftables:nft"
  # The Direct path: the agent forgets the ICE checks' conntrack entries before WireGuard
  # takes their port over (services/agent/wgport.py).
  "conntrack:conntrack"
  # Metrics (O2): `nodus up --prometheus` runs Debian's Prometheus on the daemons' targets;
  # the metrics tests scrape a live system with it and check rules with its promtool.
  "prometheus:prometheus"
)

missing=()
for entry in "${WANTED[@]}"; do
  package=${entry%%:*}
  command=${entry#*:}
  if ! command -v "$command" >/dev/null 2>&1 && ! dpkg -s "$package" >/dev/null 2>&1; then
    missing+=("$package")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else
    echo "system-deps: need root to install: ${missing[*]}" >&2; exit 1
  fi
fi
echo "system-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
