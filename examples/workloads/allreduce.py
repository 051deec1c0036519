"""A multi-rank all-reduce that uses its environment the way torch.distributed does.

Rendezvous at MASTER_ADDR:MASTER_PORT (rank 0 keeps the store, like torchrun's TCPStore), then
every rank listens on an ephemeral port of its own address (as NCCL and Gloo do) and the ranks
form a ring over TCP. It all-reduces a vector, checks the sum on every rank, and prints one
JSON line with the bus bandwidth (as nccl-tests defines it). Exit code 0 only if verified.

Each iteration is a step of a job that can be restarted: with NODUS_CHECKPOINT_DIR (set by
Nodus, shared by the ranks and kept across epochs) rank 0 records every finished step, and a
restarted gang (NODUS_RESTART_COUNT > 0) resumes after the last one. Every step's data differs,
so a resumed run verifies the same result as one that never stopped.

    MASTER_ADDR MASTER_PORT RANK|NODE_RANK WORLD_SIZE NODUS_NODE_IPS  (set by Nodus)
    NODUS_CHECKPOINT_DIR NODUS_RESTART_COUNT                          (set by Nodus)
    ALLREDUCE_MIB (default 16)  ALLREDUCE_ITERS (default 3)
    ALLREDUCE_STEP_SECONDS (default 0: a pause after each step, to stop a run midway)
    ALLREDUCE_TIMEOUT_SECONDS (default 300: like torch.distributed's collective timeout, a peer
        silent this long fails the rank, with a message, instead of hanging it for ever)
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time
from array import array

HEADER = struct.Struct(">II")
TIMEOUT = float(os.environ.get("ALLREDUCE_TIMEOUT_SECONDS", "300"))


def env_int(*names: str, default: int | None = None) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    if default is None:
        raise SystemExit(f"allreduce: none of {names} is set")
    return default


def connect_retry(address: tuple[str, int], deadline: float) -> socket.socket:
    """Like NCCL and the TCPStore: a refused connection is retried until the peer listens."""
    while True:
        try:
            sock = socket.create_connection(address, timeout=30)
            sock.settimeout(TIMEOUT)  # the collective's bound, not the connect's
            return sock
        except (ConnectionRefusedError, TimeoutError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def recv_exact(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError("peer closed mid-message")
        got += n
    return bytes(buffer)


def rendezvous(
    rank: int, world: int, own: str, master: tuple[str, int]
) -> tuple[socket.socket, socket.socket]:
    """Return (to_next, from_prev) sockets of the ring."""
    listener = socket.socket(socket.AF_INET6 if ":" in own else socket.AF_INET)
    listener.bind((own, 0))  # an ephemeral port, as NCCL's bootstrap does
    listener.listen(4)
    listener.settimeout(TIMEOUT)
    my_port = listener.getsockname()[1]
    deadline = time.monotonic() + 120
    if rank == 0:
        store = socket.socket(socket.AF_INET6 if ":" in master[0] else socket.AF_INET)
        store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        store.bind(master)
        store.listen(world)
        store.settimeout(TIMEOUT)
        table = {0: (own, my_port)}
        clients = []
        while len(table) < world:
            conn, _ = store.accept()
            conn.settimeout(TIMEOUT)  # an accepted socket does not inherit it
            peer_rank, port = HEADER.unpack(recv_exact(conn, HEADER.size))
            (length,) = struct.unpack(">I", recv_exact(conn, 4))
            table[peer_rank] = (recv_exact(conn, length).decode(), port)
            clients.append(conn)
        blob = json.dumps({str(k): v for k, v in table.items()}).encode()
        for conn in clients:
            conn.sendall(struct.pack(">I", len(blob)) + blob)
            conn.close()
        store.close()
    else:
        conn = connect_retry(master, deadline)
        address = own.encode()
        conn.sendall(HEADER.pack(rank, my_port) + struct.pack(">I", len(address)) + address)
        (length,) = struct.unpack(">I", recv_exact(conn, 4))
        table = {int(k): tuple(v) for k, v in json.loads(recv_exact(conn, length)).items()}
        conn.close()
    nxt = table[(rank + 1) % world]
    to_next = connect_retry((str(nxt[0]), int(nxt[1])), deadline)
    from_prev, _ = listener.accept()
    from_prev.settimeout(TIMEOUT)
    listener.close()
    for sock in (to_next, from_prev):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return to_next, from_prev


def ring_allreduce(
    data: array, rank: int, world: int, to_next: socket.socket, from_prev: socket.socket
) -> None:
    """Reduce-scatter then all-gather, 2(W-1) steps of N/W elements each."""
    n = len(data)
    bounds = [n * i // world for i in range(world + 1)]
    item = data.itemsize

    def chunk(i: int) -> tuple[int, int]:
        i %= world
        return bounds[i], bounds[i + 1]

    def exchange(send: bytes, size: int) -> bytes:
        # Send and receive at once: every rank sends before it reads, and a chunk larger than
        # the sockets' buffers would otherwise deadlock the ring.
        sender = threading.Thread(target=to_next.sendall, args=(send,))
        sender.start()
        received = recv_exact(from_prev, size)
        sender.join()
        return received

    for step in range(world - 1):  # reduce-scatter
        s0, s1 = chunk(rank - step)
        r0, r1 = chunk(rank - step - 1)
        incoming = array(data.typecode, exchange(data[s0:s1].tobytes(), (r1 - r0) * item))
        data[r0:r1] = array(data.typecode, map(float.__add__, data[r0:r1], incoming))
    for step in range(world - 1):  # all-gather
        s0, s1 = chunk(rank + 1 - step)
        r0, r1 = chunk(rank - step)
        data[r0:r1] = array(data.typecode, exchange(data[s0:s1].tobytes(), (r1 - r0) * item))


CHECKPOINT = "allreduce-checkpoint.json"


def load_checkpoint(directory: str | None) -> dict[str, object]:
    """The last finished step, as rank 0 recorded it; nothing yet: step -1."""
    if not directory:
        return {"step": -1, "verified": True}
    try:
        with open(os.path.join(directory, CHECKPOINT)) as f:
            loaded: dict[str, object] = json.load(f)
            return loaded
    except FileNotFoundError:
        return {"step": -1, "verified": True}


def save_checkpoint(directory: str, step: int, verified: bool) -> None:
    """Atomically: a rank killed while writing leaves the previous checkpoint."""
    os.makedirs(directory, exist_ok=True)
    partial = os.path.join(directory, f".{CHECKPOINT}.{os.getpid()}")
    with open(partial, "w") as f:
        json.dump({"step": step, "verified": verified}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, os.path.join(directory, CHECKPOINT))


def main() -> int:
    rank = env_int("RANK", "NODE_RANK", "PET_NODE_RANK")
    world = env_int("WORLD_SIZE", "PET_NNODES")
    master = (os.environ["MASTER_ADDR"], env_int("MASTER_PORT", default=29500))
    ips = os.environ.get("NODUS_NODE_IPS", "").split(",")
    own = ips[rank] if len(ips) == world else socket.gethostbyname(socket.gethostname())
    size = env_int("ALLREDUCE_MIB", default=16) << 20
    iterations = env_int("ALLREDUCE_ITERS", default=3)
    pause = float(os.environ.get("ALLREDUCE_STEP_SECONDS", "0"))
    checkpoints = os.environ.get("NODUS_CHECKPOINT_DIR")
    count = size // 8
    # Read before the rendezvous: nobody writes until every rank finished a step.
    resumed = load_checkpoint(checkpoints)
    first_step = int(str(resumed["step"])) + 1

    started = time.monotonic()
    to_next, from_prev = rendezvous(rank, world, own, master)
    connected = time.monotonic() - started
    times = []
    ok = bool(resumed["verified"])
    for step in range(first_step, iterations + 1):  # step 0 is a warm-up
        expected = [float(sum(r + (i % 7) + step for r in range(world))) for i in range(7)]
        data = array("d", (float(rank + (i % 7) + step) for i in range(count)))
        t0 = time.monotonic()
        ring_allreduce(data, rank, world, to_next, from_prev)
        times.append(time.monotonic() - t0)
        ok &= all(data[i] == expected[i % 7] for i in range(0, count, max(1, count // 4096)))
        ok &= data[count - 1] == expected[(count - 1) % 7]
        if checkpoints and rank == 0:
            save_checkpoint(checkpoints, step, ok)
        if pause:
            time.sleep(pause)
    to_next.close()
    from_prev.close()
    best = min(times[1:]) if len(times) > 1 else (times[0] if times else float("nan"))
    algbw = size / best / 1e9 * 8
    report = {
        "rank": rank,
        "world": world,
        "bytes": size,
        "seconds": round(best, 4),
        "algGbps": round(algbw, 4),
        "busGbps": round(algbw * 2 * (world - 1) / world, 4),
        "rendezvousSeconds": round(connected, 3),
        "restartCount": env_int("NODUS_RESTART_COUNT", default=0),
        "resumedAtStep": first_step,
        "steps": iterations + 1,
        "verified": ok,
    }
    print(json.dumps(report), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TimeoutError:
        print(f"allreduce: no word from a peer for {TIMEOUT:g} s; giving up", file=sys.stderr)
        raise
