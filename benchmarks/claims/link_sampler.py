"""Each emulated host's link, sampled: eth0's tx and rx byte counters every ~2 ms, read from /proc/PID/net/dev of
one Python process in each network namespace (no process is started per sample). Run beside a job (root):

    python benchmarks/claims/link_sampler.py OUT.json SECONDS &  mpitrain cluster run -n 8 -- ...

OUT.json: {namespace: [[time.time(), rx_bytes, tx_bytes], ...]}; rates are the differences over a window.
"""
import json
import os
import sys
import time


def one_process_per_namespace() -> dict:
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"python" in open(f"/proc/{pid}/cmdline", "rb").read():
                found.setdefault(os.readlink(f"/proc/{pid}/ns/net"), pid)
        except OSError:
            continue
    return found


def main(out: str, seconds: float) -> None:
    samples, pids, end, looked = {}, {}, time.time() + seconds, 0.0
    while time.time() < end:
        if time.time() - looked > 2:  # the job's processes come and go
            pids, looked = one_process_per_namespace(), time.time()
        now = time.time()
        for ns, pid in list(pids.items()):
            try:
                with open(f"/proc/{pid}/net/dev") as f:
                    for line in f:
                        if line.strip().startswith("eth0:"):
                            fields = line.split(":", 1)[1].split()
                            samples.setdefault(ns, []).append((now, int(fields[0]), int(fields[8])))
            except OSError:
                pids.pop(ns, None)
        time.sleep(0.002)
    with open(out, "w") as f:
        json.dump(samples, f)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
