"""O1's NVML path on a machine without an NVIDIA driver: nvidia-ml-py, unmodified, loads a
libnvidia-ml.so.1 built here from tests/fixtures/nvml/fake_nvml.c (NVML's own signatures and
structures) through the dynamic loader's search path, as it loads the driver's on a GPU
machine, and the agent's discovery reads it. Nothing of ours is mocked: what is checked is
what the agent would register, and what it says about what it could not read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from libs.bus import Bus
from libs.bus.server import NatsServer
from tests.integration.described_agent import run_described_agent

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "tests" / "fixtures" / "nvml" / "fake_nvml.c"
H100 = "NVIDIA H100 80GB HBM3"
H100_BYTES = 81559 << 20  # what NVML says of an H100 SXM's framebuffer
BUSES = ["18", "2a", "3a", "5d", "9a", "ab", "ba", "db"]

# Run in a fresh process: the loader reads LD_LIBRARY_PATH when the process starts, and
# pynvml keeps the library it loaded for the life of the process.
PROBE = """
import dataclasses, json, logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
from services.agent.discover import gpu_report
from libs.discovery.gpus import DiscoveryError
try:
    report, warnings = gpu_report()
except DiscoveryError as error:
    print(json.dumps({"error": str(error)}))
else:
    print(json.dumps({"report": dataclasses.asdict(report) if report else None,
                      "warnings": warnings}))
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the stand-in libnvidia-ml.so.1")
    folder = tmp_path_factory.mktemp("nvml")
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-Wall",
            "-Werror",
            "-Wl,-soname,libnvidia-ml.so.1",
            "-o",
            str(folder / "libnvidia-ml.so.1"),
            str(SOURCE),
        ],
        check=True,
    )
    return folder


def _gpu_line(bus: str, state: str = "ok", numa: int = 0, name: str = H100) -> str:
    return f"gpu {name}|00000000:{bus.upper()}:00.0|{H100_BYTES}|{numa}|{state}"


def _discover(library: Path, tmp_path: Path, lines: list[str]) -> dict[str, object]:
    config = tmp_path / "nvml.conf"
    config.write_text("\n".join(lines) + "\n")
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(library),
        "NODUS_FAKE_NVML": str(config),
        "PYTHONPATH": str(REPO),
        # No GPU tool on the path: what is read is NVML's.
        "PATH": str(tmp_path / "no-tools"),
    }
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    result["log"] = done.stderr
    return result


def test_eight_h100_through_the_real_bindings(library: Path, tmp_path: Path) -> None:
    lines = ["init 0", "driver 550.90.07", "cuda 12040", "numa yes"]
    lines += [_gpu_line(bus, numa=0 if i < 4 else 1) for i, bus in enumerate(BUSES)]
    result = _discover(library, tmp_path, lines)
    report = result["report"]
    assert isinstance(report, dict), result
    assert (report["backend"], report["driver_version"], report["runtime_version"]) == (
        "cuda",
        "550.90.07",
        "12.4",
    )
    gpus = report["gpus"]
    assert [g["pci_bus_id"] for g in gpus] == [f"0000:{bus}:00.0" for bus in BUSES]
    assert {g["product"] for g in gpus} == {H100}
    assert {g["memory_mib"] for g in gpus} == {81559}
    assert [g["numa_node"] for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert report["warnings"] == [] and result["warnings"] == []


def test_what_nvml_cannot_say_is_reported_not_guessed(library: Path, tmp_path: Path) -> None:
    """An older library without NUMA node ids, a GPU whose memory NVML does not report, one
    fallen off the bus, a product the driver has no name for."""
    lines = ["init 0", "driver 535.54.03", "cuda 12020", "numa no"]
    lines += [
        _gpu_line("18"),
        _gpu_line("2a", state="nomem"),
        _gpu_line("3a", state="lost"),
        _gpu_line("5d", name="NVIDIA Graphics Device"),
    ]
    result = _discover(library, tmp_path, lines)
    report = result["report"]
    assert isinstance(report, dict), result
    gpus = report["gpus"]
    # The lost GPU is left out; the others keep CUDA's positions.
    assert [(g["index"], g["pci_bus_id"]) for g in gpus] == [
        (0, "0000:18:00.0"),
        (1, "0000:2a:00.0"),
        (2, "0000:5d:00.0"),
    ]
    assert [g["memory_mib"] for g in gpus] == [81559, 0, 81559]
    assert {g["numa_node"] for g in gpus} == {None}  # sysfs says it
    warnings = "\n".join(report["warnings"])
    assert "GPU 0000:2a:00.0: memory size not reported (NVML: Not Supported)" in warnings
    assert "NVML GPU 2: GPU is lost: left out of the inventory" in warnings
    assert "'NVIDIA Graphics Device' names no model" in warnings


@pytest.mark.parametrize(
    ("code", "quiet"), [(9, True), (18, False)], ids=["driver-not-loaded", "version-mismatch"]
)
def test_nvml_that_cannot_start_is_not_a_gpu_report(
    library: Path, tmp_path: Path, code: int, quiet: bool
) -> None:
    """No driver loaded: not an NVIDIA machine (said only at debug level). A driver/library
    mismatch is an NVIDIA machine NVML cannot read: said as a warning."""
    result = _discover(library, tmp_path, [f"init {code}", _gpu_line("18")])
    assert result["report"] is None and result["warnings"] == []
    log = str(result["log"])
    level = "DEBUG" if quiet else "WARNING"
    assert f"{level}:nodus.agent.discover:NVML:" in log, log


def test_an_unreadable_bus_id_is_refused(library: Path, tmp_path: Path) -> None:
    result = _discover(library, tmp_path, ["init 0", "gpu NVIDIA H100 80GB HBM3|gpu0|1|0|ok"])
    assert result == {"error": "'gpu0' is not a PCI bus id", "log": result["log"]}


def test_the_agent_registers_what_nvml_said_and_what_it_could_not_read(
    library: Path, tmp_path: Path, nats_server: NatsServer, bus: Bus
) -> None:
    """`nodus agent` on an eight-GPU machine, one GPU of which NVML cannot size: the registered
    inventory has the GPUs with C5's names and the warning; the agent's log says it too."""
    config = tmp_path / "nvml.conf"
    lines = ["init 0", "driver 550.90.07", "cuda 12040", "numa yes"]
    lines += [
        _gpu_line(bus, numa=i // 4, state="nomem" if i == 5 else "ok")
        for i, bus in enumerate(BUSES)
    ]
    config.write_text("\n".join(lines) + "\n")
    env = {
        **{k: v for k, v in os.environ.items() if k != "NODUS_FLEET"},
        "LD_LIBRARY_PATH": str(library),
        "NODUS_FAKE_NVML": str(config),
    }
    record, out, code = run_described_agent(
        nats_server, "gpu-a", tmp_path / "none.yaml", tmp_path / "gpu-a", env
    )
    acc = record.inventory.accelerators
    assert (acc.count, acc.model, acc.backend, acc.collectives) == (8, "H100", "cuda", "nccl")
    assert [d.name for d in acc.devices] == [f"CUDA{i}" for i in range(8)]
    assert [d.numa_node for d in acc.devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [d.memory_mib for d in acc.devices] == [81559] * 5 + [0] + [81559] * 2
    said = "GPU 0000:ab:00.0: memory size not reported (NVML: Not Supported)"
    assert acc.warnings == [said]
    assert f"discovery: {said}" in out, out
    assert code == 0, out
