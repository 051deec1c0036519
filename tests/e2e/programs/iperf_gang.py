"""iperf3 between the two ranks of a gang, as a job's command: rank 0 serves on its own
address (MASTER_ADDR), rank 1 runs the client against it and prints a summary of iperf3's JSON.

    python iperf_gang.py PORT SECONDS STREAMS

Rank 1 prints `{"event": "client-start"}` before its client runs (the tests time their faults
from it), then `{"iperf": {...}}`: whether iperf3 exited 0, the bytes of every 1-s interval
summed over the streams, the longest run of intervals that delivered nothing, and iperf3's
error if any. A client that finds no server yet (rank 0 starts at the same time) tries again;
any other failure is the result. Exit 0 only if iperf3 did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def serve(address: str, port: int, seconds: int) -> int:
    # One client, then exit; bounded, so a client that never comes does not hang the job.
    done = subprocess.run(
        ["iperf3", "-s", "-1", "-B", address, "-p", str(port)],
        timeout=seconds + 120,
        check=False,
    )
    return done.returncode


def client(address: str, port: int, seconds: int, streams: int) -> int:
    deadline = time.monotonic() + 60
    while True:
        print(json.dumps({"event": "client-start"}), flush=True)
        done = subprocess.run(
            [
                *("iperf3", "-c", address, "-p", str(port)),
                *("-P", str(streams), "-t", str(seconds), "-J", "--connect-timeout", "3000"),
            ],
            capture_output=True,
            text=True,
            timeout=seconds + 60,
            check=False,
        )
        try:
            report = json.loads(done.stdout)
        except ValueError:
            report = {"error": f"no JSON from iperf3: {done.stdout[-500:]} {done.stderr[-500:]}"}
        error = report.get("error", "")
        # Through the shim iperf3 may exit 0 with an error in its JSON: the error decides.
        if "unable to connect" in error and time.monotonic() < deadline:
            time.sleep(0.3)
            continue
        intervals = [int(i["sum"]["bytes"]) for i in report.get("intervals", [])]
        longest = run = 0
        for delivered in intervals:
            run = run + 1 if delivered == 0 else 0
            longest = max(longest, run)
        code = done.returncode or (1 if error else 0)
        summary = {
            "exit": code,
            "intervals": intervals,
            "zeroIntervals": longest,
            "error": error or None,
            "bitsPerSecond": report.get("end", {}).get("sum_received", {}).get("bits_per_second"),
        }
        print(json.dumps({"iperf": summary}), flush=True)
        return code


def main() -> int:
    port, seconds, streams = (int(a) for a in sys.argv[1:4])
    address = os.environ["MASTER_ADDR"]
    if os.environ.get("NODE_RANK") == "0":
        return serve(address, port, seconds)
    return client(address, port, seconds, streams)


if __name__ == "__main__":
    sys.exit(main())
