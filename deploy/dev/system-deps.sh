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
  # (wireguard-go, for the Direct path's nodus0, is installed below: its version matters.)
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
  # takes their port over (services/agent/direct/wgport.py).
  "conntrack:conntrack"
  # Metrics (O2): `nodus up --prometheus` runs Debian's Prometheus on the daemons' targets;
  # the metrics tests scrape a live system with it and check rules with its promtool.
  "prometheus:prometheus"
)

# wireguard-go with the TUN and UDP offloads (O5): 0.0.20231211 is the first Debian build with
# both (TSO/GRO through virtio-net headers on the tun, UDP GSO/GRO, batched crypto); bookworm's
# 0.0.20220316 moves packets one at a time, at a fifth of the speed for five times the CPU.
# That build still says "v0.0.20220316" to `wireguard-go --version`: dpkg knows better.
WIREGUARD_GO_MIN="0.0.20231211"

wireguard_go_current() {
  local installed
  installed=$(dpkg-query -W -f='${Version}' wireguard-go 2>/dev/null) || return 1
  dpkg --compare-versions "$installed" ge "$WIREGUARD_GO_MIN"
}

# The Debian mirror and release this machine already uses ("URI SUITE SIGNED-BY"), from its
# apt sources (deb822 .sources or one-line .list): the backports suite sits beside it.
debian_source() {
  local codename=$1
  python3 - "$codename" <<'PY'
import glob, re, sys
codename = sys.argv[1]
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in re.split(r"\n\s*\n", open(path).read()):
        fields = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        if fields.get("enabled", "yes") == "no" or "deb" not in fields.get("types", "").split():
            continue
        if codename in fields.get("suites", "").split() and "main" in fields.get("components", "").split():
            print(fields["uris"].split()[0], codename, fields.get("signed-by", "-"))
            sys.exit(0)
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        m = re.match(r"^deb\s+(?:\[(?P<opts>[^]]*)\]\s+)?(?P<uri>\S+)\s+(?P<suite>\S+)\s+(?P<comps>.*)", line)
        if m and m["suite"] == codename and "main" in m["comps"].split():
            signed = re.search(r"signed-by=(\S+)", m["opts"] or "")
            print(m["uri"], codename, signed[1] if signed else "-")
            sys.exit(0)
sys.exit(1)
PY
}

missing=()
for entry in "${WANTED[@]}"; do
  package=${entry%%:*}
  command=${entry#*:}
  if ! command -v "$command" >/dev/null 2>&1 && ! dpkg -s "$package" >/dev/null 2>&1; then
    missing+=("$package")
  fi
done
# Fast path (CI runs this on every `make test`): everything there, wireguard-go new enough.
if [ ${#missing[@]} -eq 0 ] && wireguard_go_current; then exit 0; fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else
    echo "system-deps: need root to install: ${missing[*]} wireguard-go>=$WIREGUARD_GO_MIN" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
if [ ${#missing[@]} -gt 0 ]; then
  echo "system-deps: installing ${missing[*]}" >&2
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
wireguard_go_current && exit 0

# The default suites' wireguard-go predates the offloads (bookworm): take the release's
# backports, from the same mirror, as a sources file of its own.
candidate=$(apt-cache policy wireguard-go | awk '/Candidate:/ {print $2}')
target=wireguard-go
if ! dpkg --compare-versions "${candidate:-0}" ge "$WIREGUARD_GO_MIN"; then
  distribution=$(. /etc/os-release && echo "${ID:-}")
  if [ "$distribution" != debian ]; then
    # No backports suite known to carry it (Ubuntu's kernels have the WireGuard module,
    # which the agent prefers): the default build, and the agent's warning about it.
    echo "system-deps: wireguard-go ${candidate:-?} on ${distribution:-?} predates the" \
      "offloads; Direct runs slowly unless the kernel has WireGuard" >&2
    dpkg -s wireguard-go >/dev/null 2>&1 ||
      $SUDO apt-get install -y -qq --no-install-recommends wireguard-go >/dev/null
    exit 0
  fi
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  if [ -z "$codename" ] || ! source=$(debian_source "$codename"); then
    echo "system-deps: wireguard-go ${candidate:-?} predates the offloads and no Debian" \
      "source for '${codename:-?}' was found to add its backports from" >&2
    exit 1
  fi
  read -r uri suite signed_by <<<"$source"
  echo "system-deps: adding $suite-backports from $uri for wireguard-go>=$WIREGUARD_GO_MIN" >&2
  {
    echo "Types: deb"
    echo "URIs: $uri"
    echo "Suites: $suite-backports"
    echo "Components: main"
    [ "$signed_by" != "-" ] && echo "Signed-By: $signed_by"
  } | $SUDO tee /etc/apt/sources.list.d/nodus-backports.sources >/dev/null
  $SUDO apt-get update -qq >/dev/null
  target="wireguard-go/$suite-backports"
fi
echo "system-deps: installing $target" >&2
$SUDO apt-get install -y -qq --no-install-recommends "$target" >/dev/null
if ! wireguard_go_current; then
  echo "system-deps: wireguard-go is $(dpkg-query -W -f='${Version}' wireguard-go 2>/dev/null)," \
    "not >= $WIREGUARD_GO_MIN" >&2
  exit 1
fi
