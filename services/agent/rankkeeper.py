"""A rank's keeper: the parent of one rank's process, as containerd's shim is for a container.

The agent starts it in a session of its own, so the rank outlives the agent (an upgrade, a
crash: O4), and the keeper, not the agent, is the rank's parent: it collects the exit status
that only a parent can, and leaves it in a file the agent reads, this agent or the next one.

    python -I rankkeeper.py EXIT_FILE -- COMMAND [ARG ...]

- The rank runs in the keeper's process group: signalling the group (the agent's stop) reaches
  the rank; the keeper itself ignores SIGTERM, SIGINT and SIGHUP so that it stays to record
  how the rank ended. SIGKILL on the group ends both, and leaves no exit file: stopped.
- If the keeper dies alone, the kernel kills the rank (PR_SET_PDEATHSIG): a rank never runs
  without someone to record its end.
- EXIT_FILE gets the rank's return code, as asyncio reports it (negative: killed by that
  signal), written whole or not at all. A command that cannot start is 127, said in its log.

Standard library only, started with `-I`: it loads fast and nothing of the rank's environment
(PYTHONPATH, ...) changes it."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def _die_with_keeper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # A stop that arrived before the rank existed is the rank's too: restore the default.
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)


def _record(exit_file: str, code: int) -> None:
    temporary = f"{exit_file}.tmp"
    with open(temporary, "w") as handle:
        handle.write(f"{code}\n")
    os.replace(temporary, exit_file)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: rankkeeper.py EXIT_FILE -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    exit_file, command = argv[0], argv[2:]
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(number, signal.SIG_IGN)
    try:
        # stdin, stdout and stderr are the keeper's: /dev/null and the rank's log.
        process = subprocess.Popen(command, preexec_fn=_die_with_keeper)
    except OSError as error:
        print(f"nodus: cannot start {command[0]}: {error.strerror or error}", flush=True)
        _record(exit_file, 127)
        return 127
    code = process.wait()
    _record(exit_file, code)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
