"""Detectors over the real formats (R1): kernel-log Xid lines old and new, PCIe drops,
dcgm-exporter text, Node Problem Detector conditions, InfiniBand sysfs trees, reachability;
malformed input is skipped and counted, never raised (S3)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.contracts.remediation import Action, AlertKind
from libs.faults.catalog import meaning, xid_entry
from services.monitor.detectors import prom
from services.monitor.detectors.dcgm import Dcgm
from services.monitor.detectors.infiniband import (
    Infiniband,
    Malformed,
    PortSample,
    parse_state,
    read_ports,
)
from services.monitor.detectors.kmsg import KernelLog, parse_line
from services.monitor.detectors.machine import MachineDetectors, MachinePaths, diagnose
from services.monitor.detectors.npd import NodeProblems
from services.monitor.detectors.reachability import Reachability, heartbeat

T0 = datetime(2025, 1, 1, tzinfo=UTC)

# -- kernel log --------------------------------------------------------------------------------

NEW_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus."


@pytest.mark.parametrize(
    ("line", "xid", "pci", "pid", "process"),
    [
        (NEW_79, 79, "0000:3b:00", "1234", "python3"),
        (
            "[ 1234.567890] NVRM: Xid (0000:03:00): 79, GPU has fallen off the bus.",
            79,
            "0000:03:00",
            None,
            None,
        ),
        (
            "4,1234,5678901234,-;NVRM: Xid (PCI:0000:3B:00): 48, pid='<unknown>', name=<unknown>, "
            "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer",
            48,
            "0000:3b:00",
            "<unknown>",
            "<unknown>",
        ),
        (
            "Jan  2 10:11:12 gpu-07 kernel: [ 88.1] NVRM: Xid (0000:01:00): 13, 0004 00000000 "
            "0000a097 00001b0c 00001000 00000000",
            13,
            "0000:01:00",
            None,
            None,
        ),
        (
            "NVRM: Xid (PCI:0000:3b:00): 119, pid=2345, name=python, Timeout after 6s of waiting "
            "for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL)",
            119,
            "0000:3b:00",
            "2345",
            "python",
        ),
        (
            "NVRM: Xid (PCI:0000:3b:00): 95, pid=7, name=x, Uncontained: FBHUB.",
            95,
            "0000:3b:00",
            "7",
            "x",
        ),
    ],
)
def test_xid_lines_of_old_and_new_drivers(
    line: str, xid: int, pci: str, pid: str | None, process: str | None
) -> None:
    event = parse_line(line)
    assert event is not None and event.kind is AlertKind.XID
    assert (event.xid, event.subject, event.pid, event.process) == (xid, pci, pid, process)


@pytest.mark.parametrize(
    "line",
    [
        "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
        "NVRM: The NVIDIA GPU 0000:3b:00.0 (PCI ID: 10de:2330) installed in this system has "
        "fallen off the bus and is not responding to commands.",
        "pcieport 0000:3b:00.0: pciehp: Slot(2): Link Down",
        "pcieport 0000:3a:00.0: AER: Uncorrected (Fatal) error received: 0000:3b:00.0",
    ],
)
def test_pcie_drops(line: str) -> None:
    event = parse_line(line)
    assert event is not None and event.kind is AlertKind.GPU_OFF_BUS
    assert event.subject == "0000:3b:00"


def test_unrelated_lines_say_nothing() -> None:
    assert parse_line("usb 1-1: new high-speed USB device number 2 using xhci_hcd") is None
    assert parse_line(" SUBSYSTEM=pci") is None


def test_kernel_log_keeps_hardware_faults_until_the_log_starts_over() -> None:
    log = KernelLog("gpu-07", "/x/kmsg", transient=timedelta(minutes=15))
    log.feed(
        (
            NEW_79 + "\n" + "NVRM: Xid (PCI:0000:3c:00): 13, pid=1, name=a, Graphics Exception\n"
        ).encode(),
        T0,
    )
    log.feed(b"NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has f", T0)  # partial
    found = {(f.kind, f.xid, f.severity) for f in log.findings(T0)}
    assert found == {(AlertKind.XID, 79, "critical"), (AlertKind.XID, 13, "info")}
    later = T0 + timedelta(minutes=20)
    assert [f.xid for f in log.findings(later)] == [79]  # the application error expired
    finding = log.findings(later)[0]
    assert finding.evidence.lines == [NEW_79]
    assert finding.evidence.labels == {"pci": "0000:3b:00", "pid": "1234", "process": "python3"}
    assert finding.evidence.where == "/x/kmsg" and finding.evidence.node == "gpu-07"
    log.reset()
    assert log.findings(later) == []


def test_a_broken_xid_line_is_counted() -> None:
    log = KernelLog("n", "kmsg")
    log.feed(b"NVRM: Xid (garbage\n\xff\xfe\n" + b"x" * 5000 + b"\n", T0)
    assert log.malformed == 2
    assert log.findings(T0) == []


def test_xid_catalog() -> None:
    assert xid_entry(79).action is Action.POWER_CYCLE
    assert xid_entry(48).action is Action.REBOOT
    assert xid_entry(95).action is Action.REBOOT and xid_entry(119).action is Action.REBOOT
    assert xid_entry(94).action is Action.NONE
    for code in (13, 31, 43):
        assert xid_entry(code).action is Action.NONE and xid_entry(code).transient
    assert xid_entry(4242).action is Action.NONE  # unknown: a person decides
    told = meaning(AlertKind.XID, "0000:3b:00", 79, "", "gpu-07")
    assert told.summary == "Xid 79 (GPU has fallen off the bus) on GPU 0000:3b:00 on gpu-07"


# -- dcgm-exporter -----------------------------------------------------------------------------

DCGM = """# HELP DCGM_FI_DEV_ECC_DBE_VOL_TOTAL Total number of double-bit volatile ECC errors.
# TYPE DCGM_FI_DEV_ECC_DBE_VOL_TOTAL counter
DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="0",UUID="GPU-a",pci_bus_id="00000000:3B:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-07"} 2
DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="1",UUID="GPU-b",pci_bus_id="00000000:3C:00.0",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-07"} 0
# TYPE DCGM_FI_DEV_ROW_REMAP_FAILURE gauge
DCGM_FI_DEV_ROW_REMAP_FAILURE{gpu="1",UUID="GPU-b",pci_bus_id="00000000:3C:00.0"} 1
DCGM_FI_DEV_ROW_REMAP_PENDING{gpu="1",UUID="GPU-b",pci_bus_id="00000000:3C:00.0"} 0
DCGM_FI_DEV_CLOCKS_EVENT_REASONS{gpu="0",UUID="GPU-a",pci_bus_id="00000000:3B:00.0"} 64
DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a"} 91
"""


def test_dcgm_fields() -> None:
    dcgm = Dcgm("gpu-07", "dcgm.prom")
    found = {(f.kind, f.subject): f for f in dcgm.observe(DCGM, T0)}
    assert set(found) == {
        (AlertKind.ECC_DOUBLE_BIT, "0000:3b:00"),
        (AlertKind.ROW_REMAP_FAILURE, "0000:3c:00"),
        (AlertKind.THERMAL_THROTTLING, "0000:3b:00"),
    }
    dbe = found[(AlertKind.ECC_DOUBLE_BIT, "0000:3b:00")]
    assert dbe.evidence.values == {"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 2.0}
    assert dbe.evidence.lines[0].startswith('DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="0"')
    assert dbe.severity == "critical"
    assert dcgm.malformed == 0


def test_thermal_violation_is_a_rate() -> None:
    dcgm = Dcgm("n", "d", thermal_fraction=0.2)
    line = 'DCGM_FI_DEV_THERMAL_VIOLATION{{gpu="0"}} {}\n'
    assert dcgm.observe(line.format(1_000_000), T0) == []
    # 10 s later, 1 s more throttled: 10 %, not a fault
    assert dcgm.observe(line.format(2_000_000), T0 + timedelta(seconds=10)) == []
    # 10 s later, 5 s more throttled: 50 %
    found = dcgm.observe(line.format(7_000_000), T0 + timedelta(seconds=20))
    assert [f.kind for f in found] == [AlertKind.THERMAL_THROTTLING]
    assert found[0].subject == "gpu0"


def test_prometheus_text() -> None:
    text = (
        '# comment\n\nmetric_a{a="x\\"y",b="line\\nbreak",c="back\\\\slash"} 1.5 1700000000000\n'
        'metric_b NaN\nmetric_c{} +Inf\nbroken{a=1} 2\nmetric_d{a="x"} notanumber\n'
    )
    parsed = prom.parse(text)
    assert [s.name for s in parsed.samples] == ["metric_a", "metric_b", "metric_c"]
    assert parsed.samples[0].labels == {"a": 'x"y', "b": "line\nbreak", "c": "back\\slash"}
    assert parsed.malformed == 2


# -- Node Problem Detector ---------------------------------------------------------------------

RO = {
    "type": "ReadonlyFilesystem",
    "status": "True",
    "reason": "FilesystemIsReadOnly",
    "message": "Remounting filesystem read-only",
    "lastTransitionTime": "2025-01-01T00:00:00Z",
}


@pytest.mark.parametrize(
    "document",
    [[RO], {"conditions": [RO]}, {"kind": "Node", "status": {"conditions": [RO]}}],
)
def test_npd_condition_shapes(document: object) -> None:
    npd = NodeProblems("gpu-07", "npd.json")
    found = npd.observe(json.dumps(document).encode(), T0)
    assert [(f.kind, f.severity) for f in found] == [(AlertKind.READONLY_FILESYSTEM, "critical")]
    assert found[0].evidence.labels["reason"] == "FilesystemIsReadOnly"


def test_npd_false_clears_and_malformed_keeps_the_last_good_view() -> None:
    npd = NodeProblems("n", "npd.json")
    assert npd.observe(json.dumps([RO]).encode(), T0)
    assert len(npd.observe(b'[{"type": "ReadonlyFi', T0)) == 1  # caught mid-write
    assert npd.malformed == 1
    assert npd.observe(json.dumps([{**RO, "status": "False"}]).encode(), T0) == []


# -- InfiniBand --------------------------------------------------------------------------------


def write_port(
    root: Path, device: str, port: str, state: str, phys: str, downed: int | str
) -> None:
    base = root / device / "ports" / port
    (base / "counters").mkdir(parents=True, exist_ok=True)
    (base / "state").write_text(state + "\n")
    (base / "phys_state").write_text(phys + "\n")
    (base / "counters" / "link_downed").write_text(f"{downed}\n")


def test_infiniband_port_down_and_flapping_over_a_window(tmp_path: Path) -> None:
    root = tmp_path / "sys" / "class" / "infiniband"
    write_port(root, "mlx5_0", "1", "4: ACTIVE", "5: LinkUp", 0)
    write_port(root, "mlx5_1", "1", "1: DOWN", "3: Disabled", 0)
    ib = Infiniband("gpu-07", str(root), window=timedelta(minutes=10), flaps=3)
    found = ib.observe(read_ports(root), T0)
    assert [(f.kind, f.subject) for f in found] == [(AlertKind.INFINIBAND_PORT_DOWN, "mlx5_1/1")]
    assert found[0].evidence.lines == ["state: 1: DOWN", "phys_state: 3: Disabled"]
    # mlx5_0 goes down and up three times within the window: flapping
    for minute, count in ((1, 1), (2, 2), (3, 3)):
        write_port(root, "mlx5_0", "1", "4: ACTIVE", "5: LinkUp", count)
        found = ib.observe(read_ports(root), T0 + timedelta(minutes=minute))
    flapping = [f for f in found if f.kind is AlertKind.INFINIBAND_FLAPPING]
    assert [f.subject for f in flapping] == ["mlx5_0/1"]
    assert flapping[0].evidence.values["linkDownedDelta"] == 3
    # quiet for longer than the window: no longer flapping
    found = ib.observe(read_ports(root), T0 + timedelta(minutes=20))
    assert not [f for f in found if f.kind is AlertKind.INFINIBAND_FLAPPING]


def test_infiniband_slow_climb_is_not_flapping_and_malformed_is_counted() -> None:
    ib = Infiniband("n", "/sys/class/infiniband", window=timedelta(minutes=10), flaps=3)
    for hour in range(5):
        sample = PortSample("mlx5_0", "1", "4: ACTIVE", "5: LinkUp", str(hour))
        assert ib.observe([sample], T0 + timedelta(hours=hour)) == []
    assert ib.observe([PortSample("mlx5_0", "1", "ACTIVE", "LinkUp", "x")], T0) == []
    assert ib.malformed == 1
    assert parse_state(" 5:  LinkUp ") == (5, "LinkUp")
    with pytest.raises(Malformed):
        parse_state("five")


# -- reachability and NotReady -----------------------------------------------------------------


def test_reachability_needs_failures_in_a_row() -> None:
    probe = Reachability("gpu-07", "127.0.1.7", failures=3)
    for i in range(2):
        probe.record(False, "no answer", T0 + timedelta(seconds=i))
    assert probe.findings(T0) == []
    probe.record(False, "no answer", T0 + timedelta(seconds=3))
    found = probe.findings(T0)
    assert [(f.kind, f.severity) for f in found] == [(AlertKind.HOST_UNREACHABLE, "critical")]
    assert len(found[0].evidence.lines) == 3
    probe.record(True, "", T0)
    assert probe.findings(T0) == []


def test_an_agent_silent_for_a_restart_is_not_an_unreachable_host() -> None:
    """An agent that restarts (a crash, an upgrade: O4) misses probes for a few seconds; only
    a silence as long as the heartbeat timeout is a host unreachable (R17 would end the
    running gang's epoch)."""
    probe = Reachability("gpu-07", "127.0.1.7", failures=3, silent_for=timedelta(seconds=15))
    for i in range(5):  # five probes a second apart: a restart on a loaded machine
        probe.record(False, "no answer", T0 + timedelta(seconds=i))
    assert probe.findings(T0 + timedelta(seconds=5)) == []
    probe.record(True, "", T0 + timedelta(seconds=5))  # back: the count starts again
    for i in range(6, 22):
        probe.record(False, "no answer", T0 + timedelta(seconds=i))
    assert probe.findings(T0 + timedelta(seconds=20)) == []
    found = probe.findings(T0 + timedelta(seconds=21))
    assert [f.kind for f in found] == [AlertKind.HOST_UNREACHABLE]
    assert "over 15 s" in found[0].detail


def test_not_ready_is_info_only() -> None:
    assert heartbeat("n", T0, timedelta(seconds=15), T0 + timedelta(seconds=5)) == []
    found = heartbeat("n", T0, timedelta(seconds=15), T0 + timedelta(seconds=60))
    assert [(f.kind, f.severity) for f in found] == [(AlertKind.NODE_NOT_READY, "info")]
    assert meaning(AlertKind.NODE_NOT_READY, "heartbeat").action is Action.NONE


# -- one machine's files -----------------------------------------------------------------------


def test_machine_files_and_diagnostics(tmp_path: Path) -> None:
    paths = MachinePaths.under(tmp_path)
    write_port(Path(paths.infiniband), "mlx5_0", "1", "4: ACTIVE", "5: LinkUp", 0)
    Path(paths.kmsg).write_text("[ 1.0] Linux version 6.1\n")
    machine = MachineDetectors("gpu-07", paths)
    assert all(not found for found in machine.scan(T0).values())
    with open(paths.kmsg, "a") as log:
        log.write(NEW_79 + "\n")
    assert [f.xid for f in machine.scan(T0)["kmsg"]] == [79]
    assert [f.xid for f in diagnose("gpu-07", paths, T0)] == [79]
    Path(paths.kmsg).write_text("[ 0.5] Linux version 6.1\n")  # a new boot: the log shrank
    assert machine.scan(T0)["kmsg"] == []
    assert diagnose("gpu-07", paths, T0) == []


# -- malformed input never crashes (S3) --------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_kernel_log_survives_any_bytes(data: bytes) -> None:
    log = KernelLog("n", "kmsg")
    log.feed(data, T0)
    log.feed(b"\n", T0)
    assert isinstance(log.findings(T0), list)


xid_like = st.builds(
    lambda prefix, pci, code, rest: f"{prefix}NVRM: Xid ({pci}): {code}{rest}",
    st.sampled_from(["", "[ 1.2] ", "6,1,2,-;", "Jan  1 00:00:00 h kernel: "]),
    st.text(max_size=20),
    st.text(max_size=6),
    st.text(max_size=40),
)


@settings(max_examples=300, deadline=None)
@given(xid_like)
def test_xid_like_lines_parse_or_count(line: str) -> None:
    log = KernelLog("n", "kmsg")
    log.feed_line(line, T0)
    assert log.malformed + len(log.findings(T0)) == 1


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_prometheus_parser_survives_any_text(text: str) -> None:
    parsed = prom.parse(text)
    assert parsed.malformed >= 0
    Dcgm("n", "d").observe(text, T0)


prom_like = st.builds(
    lambda name, labels, value: f"{name}{{{labels}}} {value}",
    st.sampled_from(["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ROW_REMAP_FAILURE", "x"]),
    st.text(alphabet='abc="\\,{} \n', max_size=30),
    st.text(alphabet="0123456789.eE+-naIf", max_size=8),
)


@settings(max_examples=300, deadline=None)
@given(prom_like)
def test_dcgm_like_lines_parse_or_count(text: str) -> None:
    dcgm = Dcgm("n", "d")
    dcgm.observe(text, T0)
    parsed = prom.parse(text)
    lines = [
        line for line in text.splitlines() if line.strip() and not line.strip().startswith("#")
    ]
    assert len(parsed.samples) + parsed.malformed == len(lines)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=10),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(
                st.sampled_from(["type", "status", "conditions", "x"]), inner, max_size=4
            )
        ),
        max_leaves=20,
    )
)
def test_npd_survives_any_json(document: object) -> None:
    npd = NodeProblems("n", "npd.json")
    found = npd.observe(json.dumps(document).encode(), T0)
    assert isinstance(found, list)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40), st.text(max_size=40), st.text(max_size=30))
def test_infiniband_survives_any_sysfs_text(state: str, phys: str, downed: str) -> None:
    ib = Infiniband("n", "root")
    before = ib.malformed
    ib.observe([PortSample("mlx5_0", "1", state, phys, downed)], T0)
    ib.observe([PortSample("mlx5_0", "1", state, phys, downed)], T0 + timedelta(seconds=1))
    assert ib.malformed >= before
