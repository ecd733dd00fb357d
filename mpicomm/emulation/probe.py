"""TCP stream probe between two emulated hosts: `serve` counts what arrives, `send` pushes for N seconds."""

#     python -m mpicomm.emulation.probe serve --bind ADDR --port P
#     python -m mpicomm.emulation.probe send --to ADDR --port P --seconds S
#
# `serve` accepts one connection, prints {"bytes": B, "seconds": T, "bps": ...}
# as JSON on stdout, measured from the first byte to the end of the stream,
# and exits. It gives up after --wait seconds without a connection.

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

CHUNK = 1 << 20


def serve(bind: str, port: int, wait: float) -> dict:
    with socket.create_server((bind, port)) as srv:
        srv.settimeout(wait)
        print("ready", file=sys.stderr, flush=True)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(wait)
            buf = bytearray(CHUNK)
            total, first = 0, None
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                if first is None:
                    first = time.perf_counter()
                total += n
            elapsed = time.perf_counter() - first if first else 0.0
    return dict(bytes=total, seconds=elapsed, bps=8 * total / elapsed if elapsed else 0.0)


def send(to: str, port: int, seconds: float, connect_wait: float = 10.0) -> dict:
    deadline = time.monotonic() + connect_wait
    while True:
        try:
            sock = socket.create_connection((to, port), timeout=connect_wait)
            break
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    payload = memoryview(bytearray(CHUNK))
    sent = 0
    with sock:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            sent += sock.send(payload)
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)  # the server closes after counting: wait so its clock sees the whole stream
    return dict(bytes=sent, seconds=seconds)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpicomm.emulation.probe")
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--bind", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--wait", type=float, default=30.0)
    c = sub.add_parser("send")
    c.add_argument("--to", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--seconds", type=float, default=1.5)
    args = p.parse_args(argv)
    result = serve(args.bind, args.port, args.wait) if args.mode == "serve" else send(args.to, args.port, args.seconds)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
