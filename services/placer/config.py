"""The placer's settings: its default config file, read into `libs.contracts.placer`."""

from __future__ import annotations

from pathlib import Path

from libs.contracts.files import load_yaml_file
from libs.contracts.placer import PlacerConfig

DEFAULT_CONFIG = Path(__file__).with_name("default-config.yaml")


def load_config(path: Path | None = None) -> PlacerConfig:
    """Read the config YAML (the default one without a path); every problem names the file
    and the field."""
    return load_yaml_file(path or DEFAULT_CONFIG, PlacerConfig, "placer config", empty_ok=True)
