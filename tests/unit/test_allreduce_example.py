"""The example all-reduce fails a rank whose peer went silent, as torch.distributed's collective
timeout does, instead of hanging its job in Running for ever."""

from __future__ import annotations

import subprocess
import sys
import time

from app.local import REPO
from libs.bus.server import free_port


def test_a_rank_whose_peer_never_comes_fails_after_the_timeout_with_a_message() -> None:
    env = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "NODUS_NODE_IPS": "127.0.0.1,127.0.0.1",
        "ALLREDUCE_TIMEOUT_SECONDS": "1",
    }
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "workloads" / "allreduce.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode != 0
    assert "no word from a peer for 1 s" in done.stderr, done.stderr
    assert time.monotonic() - started < 20
