"""A relay's own key file: 32 raw bytes, made private from its first byte, read back whole."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from libs.contracts.errors import NodusError
from services.relay.main import _create_key, _read_secret


def test_a_key_that_begins_or_ends_with_a_whitespace_byte_is_read_whole(tmp_path: Path) -> None:
    # About one random key in twenty does; stripped, the relay could never start again.
    key = b"\n" + os.urandom(30) + b" "
    (tmp_path / "relay.key").write_bytes(key)
    assert _read_secret(tmp_path / "relay.key", "relay key", 32) == key


def test_a_new_key_is_32_bytes_readable_by_the_relay_alone(tmp_path: Path) -> None:
    path = tmp_path / "relays" / "relay-0.key"
    _create_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(_read_secret(path, "relay key", 32)) == 32


def test_a_key_of_the_wrong_size_is_refused_clearly(tmp_path: Path) -> None:
    (tmp_path / "relay.key").write_bytes(os.urandom(31))
    with pytest.raises(NodusError, match="expected 32 bytes, found 31"):
        _read_secret(tmp_path / "relay.key", "relay key", 32)


def test_a_text_secret_loses_its_trailing_newline(tmp_path: Path) -> None:
    (tmp_path / "mesh.key").write_text("ab" * 32 + "\n")
    assert _read_secret(tmp_path / "mesh.key", "mesh key") == b"ab" * 32
