"""The operator's credentials for the buses a test run or a bench starts: a fresh operator
seed, named by NODUS_CREDENTIALS while the run lasts, which every NatsServer the run starts
admits as the operator (libs/bus/server.py). pytest's session fixture and every bench's main
use it, so a bench runs from a plain shell the way it runs under pytest."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from libs.bus.auth import OPERATOR, new_identity
from libs.bus.connection import CREDENTIAL_VARIABLES
from libs.bus.credentials import write_secret


@contextmanager
def operator_credentials(directory: Path | None = None) -> Iterator[str]:
    """A new operator seed in `directory` (a temporary one by default) as NODUS_CREDENTIALS,
    with every other credential variable unset; the environment is restored afterwards."""
    with tempfile.TemporaryDirectory(prefix="nodus-operator-") as temporary:
        seed = (directory or Path(temporary)) / "operator.nk"
        seed.parent.mkdir(parents=True, exist_ok=True)
        write_secret(seed, new_identity("operator", OPERATOR).seed + "\n")
        saved = {key: os.environ.pop(key, None) for key in CREDENTIAL_VARIABLES}
        os.environ["NODUS_CREDENTIALS"] = str(seed)
        try:
            yield str(seed)
        finally:
            os.environ.pop("NODUS_CREDENTIALS", None)
            for key, value in saved.items():
                if value is not None:
                    os.environ[key] = value
