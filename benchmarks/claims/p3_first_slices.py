"""When p3's first slices are back on every rank after the backward: from a run's timeline, and as simulated.

    python benchmarks/claims/p3_first_slices.py --timeline F   # a jobs.train --timeline of p3, 8 hosts x 1
    python benchmarks/claims/p3_first_slices.py --simulate     # the same as runtime.sim has it (8 x 1, 1 Gbit/s,
                                                               # compute x10, eager buffers and rendezvous)
Times in ms after the step's backward ended (in a run: the last rank's; the ranks' ends spread is printed).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CALIBRATION = "benchmarks/claims/validation-grid-resnet50-v100-8r-sixteenth-session-calibration.json"


def measured(path: str, slices=(0, 1, 2), steps=range(2, 7)) -> None:
    doc = json.load(open(path))
    spans = [e for e in (doc["traceEvents"] if isinstance(doc, dict) else doc) if e.get("ph") == "X"]
    by = collections.defaultdict(list)
    for e in spans:
        by[(e["pid"], e["name"])].append(e)
    for v in by.values():
        v.sort(key=lambda e: e["ts"])
    pids = sorted({e["pid"] for e in spans})
    last = {p: by[(p, "backward stem.0")] for p in pids}  # the backward's last layer
    for k in steps:
        ends = [last[p][k]["ts"] + last[p][k]["dur"] for p in pids]
        first, end = min(ends), max(ends)
        out = []
        for s in slices:
            pulls = [e["ts"] + e["dur"] for p in pids for e in by[(p, f"pull s{s}")][:]
                     if first < e["ts"] + e["dur"] and e["ts"] < end + 1.5e6]
            out.append(f"s{s} {(max(pulls) - end) / 1e3:.0f}" if pulls else f"s{s} -")
        print(f"step {k}: back on every rank (ms after the last backward): {', '.join(out)}; "
              f"the ranks' backward ends spread {(end - first) / 1e3:.0f} ms")


def simulated() -> None:
    from jobs.sim.validate import emulated_cluster
    from jobs.simulate import modelled, parse_args
    from runtime.sim import p3_owners, simulate

    cal = json.load(open(CALIBRATION))
    prof = modelled(parse_args(["--model", "resnet50-224", "--compute", "emulated:v100", "--batch-size", "64"]))
    prof = prof.scaled(0.1)  # compute x10: 10 Gbit/s carried at 1 Gbit/s, as the run
    eager = emulated_cluster(8, "1gbit", cal, 2.0, device="gpu")
    for cluster in (eager, eager.with_(send_buffer=0)):
        ends, back = [], collections.defaultdict(list)  # the steps' backward ends; {slice: its results' times}
        ready, delivered = p3_owners.OwnerExchange.ready, p3_owners.OwnerExchange._delivered

        def on_ready(self, key, *args):
            if key == 0:  # slice 0 holds the first layers: the backward's last gradient completes it
                ends.append(self.engine.now)
            return ready(self, key, *args)

        def on_delivered(self, a, b):
            key, kind = self._conns[(a, b)][0][:2]
            if kind == p3_owners.RESULT and key in (0, 1, 2):
                back[key].append(self.engine.now)
            return delivered(self, a, b)

        p3_owners.OwnerExchange.ready, p3_owners.OwnerExchange._delivered = on_ready, on_delivered
        try:
            t = simulate(prof, cluster, "p3").t_iter_s
        finally:
            p3_owners.OwnerExchange.ready, p3_owners.OwnerExchange._delivered = ready, delivered
        out = []
        for s, v in sorted(back.items()):
            n = cluster.ranks - 1  # a step's results of a slice, one to each rank but its owner: the last of them
            last = {k: max(v[n * k:n * k + n]) for k in range(len(v) // n)}
            out.append(f"s{s} {statistics.median(1e3 * (w - ends[k]) for k, w in last.items() if k >= 2):.0f}")
        print(f"send_buffer {cluster.send_buffer:.0f} B: T_iter {t:.3f} s; back on every rank (ms after the "
              f"backward, median of the steps): {', '.join(out)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--timeline", metavar="JSON")
    p.add_argument("--simulate", action="store_true")
    args = p.parse_args()
    if args.timeline:
        measured(args.timeline)
    if args.simulate:
        simulated()
    if not (args.timeline or args.simulate):
        p.error("--timeline JSON and/or --simulate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
