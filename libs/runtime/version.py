"""The version every daemon announces (C6): the installed distribution's, from pyproject.toml,
so it is written in one place."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def _installed() -> str:
    try:
        return version("nodus")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0.0.0+unknown"


VERSION = _installed()
