"""The remediator and the monitor in `nodus up`: the monitor reads each local machine's files
under `STATE_DIR/machines/NAME/`, the remediator repairs through the local machine provider.
Persistence and cooldown are short here, for demos (`nodus fault inject`); the daemons'
defaults are the production ones."""

from __future__ import annotations

from typing import Protocol


class _System(Protocol):
    @property
    def state_dir(self) -> object: ...

    @property
    def fleet_path(self) -> object: ...

    def _spawn(self, name: str, args: list[str]) -> object: ...


def start_remediation(system: _System, replicas: int = 1) -> None:
    from pathlib import Path

    state_dir = Path(str(system.state_dir)).resolve()
    for index in range(replicas):
        system._spawn(
            f"remediator-{index}",
            [
                "remediator",
                "--replica",
                f"remediator-{index}",
                "--state-dir",
                str(state_dir),
                "--persistence-seconds",
                "10",
                "--cooldown-seconds",
                "120",
            ],
        )
    system._spawn(
        "monitor",
        [
            "monitor",
            "--state-dir",
            str(state_dir),
            "--fleet",
            str(Path(str(system.fleet_path)).resolve()),
            "--simulate",
        ],
    )
