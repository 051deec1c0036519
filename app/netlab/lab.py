"""Build a `Topology` on this host and take it down again, however the last run ended.

What the lab made is written to a state file before it is made, and to this machine's register
of labs (/run/nodus/labs, gone with the namespaces at a reboot), so a run that crashed (or was
SIGKILLed) is cleaned when the next lab starts, whatever its prefix: its processes killed, its
namespaces and the host's link deleted. Needs root and iproute2; NAT routers need nftables.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from app.netlab.topology import CORE, Topology, build_commands, nat_rules
from libs.contracts.errors import ErrorCode, NodusError

log = logging.getLogger("nodus.netlab")

TOOLS = ("ip", "nft")
COMMAND_TIMEOUT = 10.0


def missing_requirements() -> str | None:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "the network-namespace lab needs root"
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return f"the network-namespace lab needs {', '.join(absent)} (deploy/dev/system-deps.sh)"
    return None


def _run(argv: list[str], stdin: str | None = None) -> None:
    done = subprocess.run(
        argv, input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False
    )
    if done.returncode != 0:
        raise NodusError(
            ErrorCode.INTERNAL,
            f"network lab: {' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}",
        )


def _existing_namespaces() -> set[str]:
    done = subprocess.run(
        ["ip", "netns", "list"],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        check=False,
    )
    return {line.split()[0] for line in done.stdout.splitlines() if line.strip()}


def _owner(state: Path) -> int | None:
    try:
        pid = json.loads(state.read_text()).get("pid")
    except (OSError, ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) else None


def _alive(pid: int) -> bool:
    """A running process (a zombie is not: it has ended and waits to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _core_route_device() -> str | None:
    """The device through which this host routes the lab's core, or None if it does not."""
    done = subprocess.run(
        ["ip", "-o", "route", "show", str(CORE)],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        check=False,
    )
    words = done.stdout.split()
    if not words:
        return None
    return words[words.index("dev") + 1] if "dev" in words[:-1] else "?"


def _pids_in(namespace: str) -> list[int]:
    done = subprocess.run(
        ["ip", "netns", "pids", namespace],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        check=False,
    )
    return [int(pid) for pid in done.stdout.split() if pid.isdigit()]


def _kill_processes_in(namespace: str) -> None:
    """SIGKILL what still runs in `namespace` (a crashed run's agents and programs)."""
    for pid in _pids_in(namespace):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


RUN_DIR = Path("/run/nodus")
REGISTER = RUN_DIR / "labs"


def _records() -> list[Path]:
    """Every lab this machine recorded: the register, and the default state files."""
    return sorted(REGISTER.glob("*.json")) + sorted(RUN_DIR.glob("netlab-*.json"))


def clean_abandoned() -> list[str]:
    """Clean every recorded lab whose process has ended (a run that crashed or was killed, of
    any prefix); the prefixes cleaned."""
    cleaned = []
    for record in _records():
        owner = _owner(record)
        if owner is not None and (owner == os.getpid() or _alive(owner)):
            continue
        log.warning("network lab: cleaning the lab of %s, whose process has ended", record)
        clean_leftovers(record)
        cleaned.append(record.stem.removeprefix("netlab-"))
    return cleaned


def _unrecorded_lab(device: str) -> tuple[list[str], list[int]]:
    """The namespaces of a lab whose host link is `device` but that no record names (made by a
    version before the register), and the processes that run in them."""
    prefix = device.removesuffix("host")
    if prefix == device or not prefix:
        return [], []
    namespaces = sorted(n for n in _existing_namespaces() if n.startswith(prefix))
    return namespaces, [pid for namespace in namespaces for pid in _pids_in(namespace)]


# Seconds a lab waits for the host's route while another lab holds it (0: refuse at once, as
# `nodus up` does). Test runs on a shared machine set it: a lab of another run (another
# container on the same host network) ends, and this one takes the route then.
ROUTE_WAIT_VARIABLE = "NODUS_LAB_ROUTE_WAIT"


def _route_wait() -> float:
    try:
        return max(0.0, float(os.environ.get(ROUTE_WAIT_VARIABLE, "0") or 0))
    except ValueError:
        raise NodusError(
            ErrorCode.INVALID,
            f"{ROUTE_WAIT_VARIABLE}={os.environ[ROUTE_WAIT_VARIABLE]!r}: want seconds",
        ) from None


def _claim_core_route() -> None:
    """`_claim_core_route_once`, again every second for up to NODUS_LAB_ROUTE_WAIT seconds
    while another lab holds the route (one whose process ended meanwhile is cleaned)."""
    deadline = time.monotonic() + _route_wait()
    while True:
        try:
            clean_abandoned()
            _claim_core_route_once()
            return
        except NodusError as refusal:
            if refusal.code is not ErrorCode.CONFLICT or time.monotonic() >= deadline:
                raise
            log.info("network lab: %s; waiting for it", refusal)
            time.sleep(1.0)


def _claim_core_route_once() -> None:
    """Make sure this host does not route the core yet: a lab whose process ended is cleaned;
    a live one, or one that is not a lab's, is a conflict that says what holds the route."""
    device = _core_route_device()
    if device is None:
        return
    for record in _records():
        try:
            owned = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(owned, dict) and owned.get("host_link") == device:
            raise NodusError(
                ErrorCode.CONFLICT,
                f"network lab: this host routes {CORE} through {device} already, for the lab of "
                f"process {owned.get('pid')} ({record}): stop it first (two labs cannot share "
                "the host's route)",
            )
    namespaces, pids = _unrecorded_lab(device)
    if namespaces and not pids:
        log.warning("network lab: removing an unrecorded, idle lab: %s", ", ".join(namespaces))
        clean_leftovers_of(namespaces, device)
        if _core_route_device() is None:
            return
    raise NodusError(
        ErrorCode.CONFLICT,
        f"network lab: this host routes {CORE} through {device} already, and no lab this "
        "machine recorded holds it"
        + (
            f" (namespaces {', '.join(namespaces)}, processes {', '.join(map(str, pids))} "
            "still run there)"
            if namespaces
            else ""
        )
        + f": remove it (`ip link del {device}`) or stop what made it",
    )


class NetLab:
    """The namespaces of one lab; `state` names the file that remembers them (by default one
    per namespace prefix on this machine, so whichever run comes next cleans a crashed one)."""

    def __init__(self, topology: Topology, state: Path | None = None) -> None:
        self.topology = topology
        self.state = state or RUN_DIR / f"netlab-{topology.prefix.rstrip('-')}.json"

    # -- up ----------------------------------------------------------------------------------

    def create(self) -> None:
        """Clean what a previous run left, then build the lab; on failure, undo what was made."""
        reason = missing_requirements()
        if reason is not None:
            raise NodusError(ErrorCode.INVALID, reason)
        owner = _owner(self.state)
        if owner is not None and owner != os.getpid() and _alive(owner):
            raise NodusError(
                ErrorCode.CONFLICT,
                f"network lab: a lab of prefix {self.topology.prefix!r} is up (process {owner}, "
                f"{self.state}); stop it first",
            )
        clean_leftovers(self.state)
        clean_abandoned()
        t = self.topology
        clashing = sorted(set(t.namespaces) & _existing_namespaces())
        if clashing:
            raise NodusError(
                ErrorCode.CONFLICT,
                f"network lab: namespaces {', '.join(clashing)} exist and are not this lab's "
                "(another lab running, or made by hand); delete them with `ip netns del`",
            )
        if t.host_link is not None:
            _claim_core_route()
        self._remember()
        try:
            for namespace in t.namespaces:
                _run(["ip", "netns", "add", namespace])
            for argv in build_commands(t):
                _run(argv)
            for lan in t.lans:
                if lan.nat:
                    _run(
                        ["ip", "netns", "exec", lan.router, "nft", "-f", "-"], stdin=nat_rules(lan)
                    )
        except BaseException:
            self.destroy()
            raise
        log.info("network lab up: %d namespaces", len(t.namespaces))

    def _remember(self) -> None:
        record = json.dumps(
            {
                "pid": os.getpid(),
                "namespaces": self.topology.namespaces,
                "host_link": self.topology.host_link,
            }
        )
        for path in {self.state, self.registered}:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(record)

    @property
    def registered(self) -> Path:
        return REGISTER / f"{self.topology.prefix.rstrip('-')}.json"

    # -- down --------------------------------------------------------------------------------

    def destroy(self) -> None:
        clean_leftovers(self.state)
        self.registered.unlink(missing_ok=True)

    # -- running programs inside ---------------------------------------------------------------

    def machine_argv(self, machine: str, argv: list[str]) -> list[str]:
        """`argv` run as a process of `machine`: in its network namespace, with a mount
        namespace of its own whose /var/run/wireguard is private, so each machine's `nodus0`
        has its own control socket."""
        namespace = self.topology.machines[machine]
        return in_namespace(namespace, argv, private_wireguard=True)


def in_namespace(namespace: str, argv: list[str], private_wireguard: bool = False) -> list[str]:
    if not private_wireguard:
        return ["ip", "netns", "exec", namespace, *argv]
    # `ip netns exec` runs in a mount namespace of its own already (slave to the host's), so
    # a tmpfs mounted there is seen by this process tree only.
    script = (
        'mkdir -p /var/run/wireguard && mount -t tmpfs nodus-wg /var/run/wireguard && exec "$@"'
    )
    return ["ip", "netns", "exec", namespace, "sh", "-c", script, "sh", *argv]


def clean_leftovers(state: Path) -> None:
    """Remove what the lab recorded in `state`: processes, namespaces, the host's link."""
    try:
        record = json.loads(state.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as error:
        log.warning("network lab state %s unreadable (%s): removing it", state, error)
        state.unlink(missing_ok=True)
        return
    namespaces = [n for n in record.get("namespaces", []) if isinstance(n, str)]
    host_link = record.get("host_link")
    clean_leftovers_of(namespaces, host_link if isinstance(host_link, str) else None)
    state.unlink(missing_ok=True)


def clean_leftovers_of(namespaces: list[str], host_link: str | None) -> None:
    """Kill what runs in `namespaces`, delete them and the host's link."""
    existing = _existing_namespaces()
    for namespace in namespaces:
        if namespace in existing:
            _kill_processes_in(namespace)
    for namespace in namespaces:
        if namespace in existing:
            for attempt in range(20):  # busy while killed processes still hold it
                done = subprocess.run(
                    ["ip", "netns", "del", namespace],
                    capture_output=True,
                    timeout=COMMAND_TIMEOUT,
                    check=False,
                )
                if done.returncode == 0:
                    break
                time.sleep(0.05 * (attempt + 1))
            else:
                log.warning("network lab: could not delete namespace %s", namespace)
    if host_link is not None:  # gone with its peer, unless the control namespace was not made
        subprocess.run(
            ["ip", "link", "del", host_link],
            capture_output=True,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )
