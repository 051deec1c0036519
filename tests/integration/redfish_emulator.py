"""A real Redfish BMC for the tests: sushy-tools' `sushy-emulator` with its fake system driver
(one system per node, powered On), an HTTP server on 127.0.0.1 with basic auth from an
htpasswd file. Its own API is how a test sees what the BMC did: each System's PowerState, its
boot source override, and the reset actions in its access log."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt
import pytest

from libs.bus.server import free_port

USER, PASSWORD = "nodus", "bmc-secret"


@dataclass
class Emulator:
    url: str
    systems: dict[str, str]  # node -> system id
    credentials_file: Path
    log: Path
    process: subprocess.Popen[bytes] | None = None
    started: float = field(default_factory=time.monotonic)

    def system_path(self, node: str) -> str:
        return f"/redfish/v1/Systems/{self.systems[node]}"

    def get(self, path: str) -> dict[str, Any]:
        request = urllib.request.Request(self.url + path)
        token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
        with urllib.request.urlopen(request, timeout=5) as response:
            data: dict[str, Any] = json.load(response)
            return data

    def system(self, node: str) -> dict[str, Any]:
        return self.get(self.system_path(node))

    def resets(self, node: str) -> int:
        """Reset actions the emulator served for the node's system (its access log)."""
        action = f"POST {self.system_path(node)}/Actions/ComputerSystem.Reset"
        return sum(action in line for line in self.log.read_text().splitlines())


def start_emulator(directory: Path, nodes: list[str]) -> Emulator:
    directory.mkdir(parents=True, exist_ok=True)
    systems = {node: str(uuid.uuid4()) for node in nodes}
    htpasswd = directory / "htpasswd"
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    htpasswd.write_text(f"{USER}:{hashed}\n")
    config = directory / "emulator.conf"
    fake = [
        {"uuid": sid, "name": node, "power_state": "On", "nics": []}
        for node, sid in systems.items()
    ]
    config.write_text(
        f"SUSHY_EMULATOR_STATE_DIR = {str(directory / 'state')!r}\n"
        f"SUSHY_EMULATOR_FAKE_SYSTEMS = {fake!r}\n"
        f"SUSHY_EMULATOR_AUTH_FILE = {str(htpasswd)!r}\n"
    )
    credentials = directory / "bmc-credentials.yaml"
    credentials.write_text(f"username: {USER}\npassword: {PASSWORD}\n")
    credentials.chmod(0o600)
    port = free_port()
    log = directory / "emulator.log"
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from sushy_tools.emulator.main import main; sys.exit(main())",
            "--config",
            str(config),
            "--fake",
            "--interface",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    emulator = Emulator(f"http://127.0.0.1:{port}", systems, credentials, log, process)
    deadline = time.monotonic() + 20
    while True:
        try:
            emulator.get("/redfish/v1/Systems")
            return emulator
        except (urllib.error.URLError, ConnectionError):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(
                    f"sushy-emulator did not start: {log.read_text()[-2000:]}"
                ) from None
            time.sleep(0.1)


@pytest.fixture(name="emulator")
def emulator_fixture(tmp_path: Path) -> Iterator[Emulator]:
    started = start_emulator(tmp_path / "bmc", ["gpu-a", "gpu-b"])
    yield started
    assert started.process is not None
    started.process.terminate()
    try:
        started.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        started.process.kill()
        started.process.wait()
